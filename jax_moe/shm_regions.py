"""The /dev/shm regions of TransferEngine shm endpoints whose process is gone.

libfabric's shm provider backs each endpoint with /dev/shm/<name> and unlinks it when the endpoint closes. A process
killed with SIGKILL (or ended by os._exit) closes nothing, so its regions (16 MB each) stay until someone removes
them. Our endpoints are named "<pid>_<16 hex>:<n>" (src/fabric/ofi/ofi_backend.cc).

Who may remove what: a process that started the others knows their pids and outlives them (examples/launch.py, the
test harness): remove_of(their pids) once they ended is exact. remove_stale() takes every region whose pid is not
running *in this pid namespace*: right on a host or in one container, wrong where containers share /dev/shm but not
their pid namespace (a live peer's pid looks dead there), so nothing calls it on its own; the test session does."""
from __future__ import annotations

import os
import re

SHM_DIR = "/dev/shm"
_REGION = re.compile(r"^(\d+)_[0-9a-f]{16}:\d+$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlinks the endpoint regions of processes that are not running (in this pid namespace); returns their names."""
    return _remove(directory, lambda pid: not _running(pid))


def remove_of(pids, directory: str = SHM_DIR) -> list[str]:
    """Unlinks the endpoint regions of these processes, once they have ended; returns their names."""
    ended = {int(p) for p in pids if not _running(int(p))}
    return _remove(directory, lambda pid: pid in ended)


def _remove(directory: str, doomed) -> list[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _REGION.match(name)
        if m is None or not doomed(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            pass
    return removed
