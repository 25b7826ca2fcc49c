"""Trace-time bookkeeping of a Communicator's rounds: send halves whose handle has not been received yet.

The native backends' calls run in program order (jax_moe/backends/ffi_call.py), so any number of rounds works as
long as, at every point of the program, no more rounds of one direction are open (sent, not yet received) than the
backend has buffers for (`Backend.rounds_in_flight`): one on "cuda", the receive lanes on "cpu". A program that opens
more would wait for a receive that comes later in the same order; it is refused here, when it is traced, with an
error that says what to do. A handle received twice is refused too (it would hand out the same round twice and put
every later round out of step).

Counting is per traced function (the JAX trace the halves are called in); a handle received in another trace than
the one that sent it is found there too.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

import jax
from jax._src import core  # private: the current trace, to count per traced function

if TYPE_CHECKING:
    from jax_moe.communicator import Communicator

# trace -> {(comm id, direction): {handle key: what opened it}}
_open: "weakref.WeakKeyDictionary[Any, dict[tuple[int, str], dict[int, str]]]" = weakref.WeakKeyDictionary()
# handle key -> (trace, comm id, direction), for receives in another trace; and keys already received
_where: "dict[int, tuple[weakref.ref, int, str]]" = {}
_received: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def _trace() -> Any:
    return core.trace_ctx.trace


def _key(state: Any) -> Optional[Any]:
    """The object that identifies a round: the first array of the send's state (a tracer, unique per trace)."""
    leaves = jax.tree.leaves(state)
    return leaves[0] if leaves and isinstance(leaves[0], core.Tracer) else None


def opened(comm: "Communicator", direction: str, state: Any, op: str) -> None:
    """A send half of `direction` ("dispatch" or "combine") was traced; `state` is what its receive consumes."""
    key = _key(state)
    if key is None:  # evaluated eagerly: nothing can be reordered
        return
    limit = comm.backend.rounds_in_flight
    trace = _trace()
    table = _open.setdefault(trace, {}).setdefault((comm.id, direction), {})
    if limit is not None and len(table) >= limit:
        raise RuntimeError(
            f"jax_moe.{op}: {len(table)} {direction} round(s) of this Communicator are already open here (sent, "
            f"not yet received: {', '.join(table.values())}); backend {comm.backend_name!r} holds {limit} at a "
            f"time, and its calls run in program order, so this send would wait for a receive that comes after "
            f"it. Call {direction}_recv on the earlier handle first, or use another Communicator for this round.")
    table[id(key)] = f"{op} #{len(table) + 1}"
    _where[id(key)] = (weakref.ref(trace), comm.id, direction)
    weakref.finalize(key, _where.pop, id(key), None)


def closed(comm: "Communicator", direction: str, state: Any, op: str) -> None:
    """The receive half of the round whose send returned `state` was traced."""
    key = _key(state)
    if key is None:
        return
    if _received.get(id(key)) is key:
        raise RuntimeError(f"jax_moe.{op}: this handle was already received; every {direction}_send handle is "
                           f"received exactly once (a second receive would take the next round's data)")
    _received[id(key)] = key
    where = _where.pop(id(key), None)
    if where is None:
        return
    trace = where[0]()
    if trace is not None:
        _open.get(trace, {}).get((where[1], where[2]), {}).pop(id(key), None)
