"""Clean-up that must wait for the programs already dispatched (a dropped Communicator's native state: those programs
may still call into it), run by finalizers.

A finalizer that the cycle collector calls runs inside whatever allocation started the collection, also inside
jaxlib's C++. Waiting for programs there (jax.effects_barrier) runs jax's Python in the middle of it. The full CPU
suite crashed at interpreter exit in 2 of 7 runs on 2026-12-05 (a core showed the code objects of that very path,
weakref.finalize.__call__ and RuntimeTokenSet.block_until_ready, freed while still in use). So during a
collection the work is only queued, and done at the next safe point: the next native Communicator made or the next
native call traced (`run_pending`). Outside a collection (`del comm`) it runs at once, as before.
"""
from __future__ import annotations

import gc
import sys
from typing import Callable

from jax_moe.backends.ffi_call import wait_for_programs

_collecting = False  # a collection is running (gc.callbacks): finalizers run inside it
_pending: list[Callable[[], None]] = []  # appended and popped only (atomic under the GIL; no lock inside the collector)


def _track(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_track)


def after_programs(work: Callable[[], None]) -> None:
    """Runs `work` once the programs dispatched so far have run: now, or, inside a collection, at the next safe
    point. At interpreter exit: nothing (the native modules' exit hooks free every Communicator's state)."""
    if sys.is_finalizing():
        return
    if _collecting:
        _pending.append(work)
        return
    wait_for_programs()
    work()


def run_pending() -> None:
    """Does the work queued during collections (call from plain Python code only, never from a finalizer)."""
    if _collecting or not _pending:
        return
    todo = []
    while _pending:
        todo.append(_pending.pop())
    wait_for_programs()
    for work in reversed(todo):
        work()


def pending() -> int:
    """How many clean-ups wait for the next safe point (for tests)."""
    return len(_pending)
