"""The /dev/shm regions of TransferEngine shm endpoints whose process is gone.

libfabric's shm provider backs each endpoint with /dev/shm/<name> and unlinks it when the endpoint closes. A process
killed with SIGKILL (or ended by os._exit) closes nothing, so its regions (16 MB each) stay until someone removes
them. Our endpoints are named "<pid>_<16 hex>:<n>" (src/fabric/ofi/ofi_backend.cc), so a region whose pid is not
running belongs to no live endpoint: every native backend removes those when it starts, and a killed process's regions
go with the next jax_moe process on the host. A pid reused by a new process keeps its regions (never one too many
removed)."""
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
    """Unlinks the endpoint regions of processes that are not running; returns their names."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _REGION.match(name)
        if m is None or _running(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            pass
    return removed
