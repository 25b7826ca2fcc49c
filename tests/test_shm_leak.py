"""Backend "cpu" over the libfabric shm provider leaves nothing in /dev/shm: an engine's region goes with the last
Communicator that uses it, and at interpreter exit with the Communicators still alive then (two processes of
tests/support/shm_leak_worker.py)."""
from __future__ import annotations

import json
import os

import pytest

from support.multiprocess import free_port, launch
from support.shm_leak_worker import DEVICES_PER_PROC, regions_of


def test_no_shm_region_outlives_its_communicators():
    try:
        from jax_moe import fabric

        fabric.TransferEngine("shm").close()
    except Exception as e:  # noqa: BLE001 - no shm provider in this build or machine
        pytest.skip(f"libfabric provider shm unavailable: {e}")
    nproc, port = 2, free_port()
    outs = launch("shm_leak_worker.py", [(i, nproc, port) for i in range(nproc)], timeout_s=180)
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


def test_regions_of_dead_processes_are_removed_and_no_others(tmp_path):
    """A SIGKILLed process cannot close its shm endpoints: whoever started it removes its regions once it ended
    (remove_of, exact), and remove_stale takes those of every process not running; neither touches a live process's
    region nor anything else (names "<pid>_<16 hex>:<n>")."""
    import subprocess
    import sys

    from jax_moe.shm_regions import remove_of, remove_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    names = {f"{dead}_0123456789abcdef:0": False, f"{dead}_fedcba9876543210:3": False,
             f"{os.getpid()}_0123456789abcdef:0": True, f"{dead}_notours": True, "other": True}
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert remove_of([os.getpid()], str(tmp_path)) == []  # a running process's regions stay
    other = f"{int(dead) + 1}_0123456789abcdef:0"  # another dead pid: remove_of takes only the pids it is given
    (tmp_path / other).write_bytes(b"x")
    assert sorted(remove_of([int(dead)], str(tmp_path))) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(os.listdir(tmp_path)) == sorted([n for n, keep in names.items() if keep] + [other])
    (tmp_path / other).unlink()
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale(str(tmp_path))
    assert sorted(removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in names.items() if keep)
