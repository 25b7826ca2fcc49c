"""One process of tests/test_shm_leak.py: `python shm_leak_worker.py PROC NPROC PORT`.

Each process (2 CPU devices, so 2 engines and 2 shm regions) runs one dispatch/combine on a Communicator and deletes
it, then runs one on a second Communicator that it keeps until exit; it prints its pid and the /dev/shm regions of its
pid at each step as one JSON line.
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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
    import numpy as np
    from jax.experimental import multihost_utils

    import jax_moe
    from support.helpers import random_routing, random_tokens, roundtrip

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


if __name__ == "__main__":
    worker(*map(int, sys.argv[1:4]))
