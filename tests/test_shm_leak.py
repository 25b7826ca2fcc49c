"""Backend "cpu" over the libfabric shm provider leaves nothing in /dev/shm: an engine's region goes with the last
Communicator that uses it, and at interpreter exit with the Communicators still alive then.

Also the worker: `python test_shm_leak.py PROC NPROC PORT`. Each process (2 CPU devices, so 2 engines and 2 shm
regions) runs one dispatch/combine on a Communicator and deletes it, then runs one on a second Communicator that it
keeps until exit; it prints its pid and the /dev/shm regions of its pid at each step as one JSON line.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

DEVICES_PER_PROC = 2


def regions_of(pid: int) -> list[str]:
    """/dev/shm entries of the shm endpoints of process `pid` ("<pid>_<random>:<n>", src/fabric/ofi/ofi_backend.cc)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{pid}_"))
    except OSError:
        return []


def worker(proc: int, nproc: int, port: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROC)
    jax.distributed.initialize(f"127.0.0.1:{port}", nproc, proc, initialization_timeout=60)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np
    from jax.experimental import multihost_utils

    import jax_moe
    from helpers import random_routing, random_tokens
    from test_reference import roundtrip

    n, pid = jax.device_count(), os.getpid()
    mesh = jax.make_mesh((n,), ("ep",))
    rng = np.random.default_rng(0)
    e, r, hidden, t = 2 * n, 2, 64, 4
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = random_routing(rng, n, t, r, e)
    w = rng.random((n * t, r)).astype(np.float32)
    cfg = jax_moe.MoEConfig(e, r, hidden, t)

    def one_roundtrip(comm) -> None:
        jax.block_until_ready(roundtrip(comm, x, idx, w))

    counts = {"before": regions_of(pid)}
    comm = jax_moe.Communicator(cfg, mesh, "ep", backend="cpu", fabric_provider="shm")
    one_roundtrip(comm)
    counts["with_comm"] = regions_of(pid)
    del comm
    gc.collect()
    deadline = time.monotonic() + 10  # an engine lingers a moment after its last Communicator (src/cpu/engine_pool.h)
    while regions_of(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    counts["after_delete"] = regions_of(pid)
    multihost_utils.sync_global_devices("deleted")
    kept = jax_moe.Communicator(cfg, mesh, "ep", backend="cpu", fabric_provider="shm")  # alive until exit
    one_roundtrip(kept)
    counts["with_kept"] = regions_of(pid)
    print(json.dumps({"pid": pid, **counts}), flush=True)


def test_no_shm_region_outlives_its_communicators():
    import pytest

    from multiprocess import free_port, launch

    try:
        from jax_moe import fabric

        fabric.TransferEngine("shm").close()
    except Exception as e:  # noqa: BLE001 - no shm provider in this build or machine
        pytest.skip(f"libfabric provider shm unavailable: {e}")
    nproc, port = 2, free_port()
    outs = launch(os.path.basename(__file__), [(i, nproc, port) for i in range(nproc)], timeout_s=180)
    reports = []
    for out in outs:
        line = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert line, out[-3000:]
        reports.append(json.loads(line[-1]))
    left = {rep["pid"]: regions_of(rep["pid"]) for rep in reports}
    for rep in reports:  # the regions a failed run left behind: remove them (their processes are gone)
        for name in left[rep["pid"]]:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
    for rep in reports:
        print(rep)
        assert rep["before"] == [], rep
        assert len(rep["with_comm"]) == DEVICES_PER_PROC, rep  # one engine (shm endpoint) per local device
        assert rep["after_delete"] == [], f"process {rep['pid']} kept its regions after its Communicator: {rep}"
        assert len(rep["with_kept"]) == DEVICES_PER_PROC, rep
    assert left == {rep["pid"]: [] for rep in reports}, f"regions left after the processes exited: {left}"


if __name__ == "__main__":
    worker(*map(int, sys.argv[1:4]))
