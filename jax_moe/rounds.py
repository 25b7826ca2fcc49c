"""Trace-time bookkeeping of a Communicator's rounds: send halves whose handle has not been received yet.

The native backends' calls run in program order (jax_moe/backends/ffi_call.py), so any number of rounds works as long
as, at every point of the program, no more rounds of one direction are open (sent, not yet received) than the backend
has buffers for (`Backend.rounds_in_flight`): its area slots on "cuda", its receive lanes on "cpu". A program that opens
more would wait for a receive that comes later in the same order; it is refused here, when it is traced, before the send
is bound, with an error that says what to do. A handle received twice in one traced function is refused too (it would
hand out the same round twice and put every later round out of step). A backend whose receives take the oldest open
round (`Backend.receives_in_order`: "cuda" with two slots, whose acknowledgements say "every round up to this one was
read") is refused a receive out of send order, and a one-shot call while a round of its direction is open (its receive
would come first).

Rounds are recorded per traced function (the JAX trace the halves are called in) and counted over it and the traces
it is nested in (a nested jit, a cond branch, a loop body opens its rounds while the enclosing ones are open). A
handle that enters a nested trace (a loop carry, a cond operand, a nested jit) arrives there as another tracer: its
receive then closes the oldest open round of that Communicator and direction, wherever it was opened. What tracing cannot see (handles kept across
programs) the native backends check when they run.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import jax
from jax._src import core  # private: the current trace, to count per traced function
from jax_moe.backends.base import CommView


# trace -> {(comm id, direction): {id(handle key): (weak ref to the key, what opened it)}}, in opening order. Only
# weak references to tracers: a tracer refers to its trace, so a strong one would keep every trace (and what its
# jaxpr holds, Communicators included) alive for good.
_open: "weakref.WeakKeyDictionary[Any, dict[tuple[int, str], dict[int, tuple[weakref.ref, str]]]]" = \
    weakref.WeakKeyDictionary()
# trace -> {id(handle key): weak ref to the key} received in that trace
_received: "weakref.WeakKeyDictionary[Any, dict[int, weakref.ref]]" = weakref.WeakKeyDictionary()


def _trace() -> Any:
    return core.trace_ctx.trace


def _key(handle: Any) -> Optional[Any]:
    """The object that identifies a round: the first array of the send's handle (a tracer, unique per trace)."""
    leaves = jax.tree.leaves(handle)
    return leaves[0] if leaves and isinstance(leaves[0], core.Tracer) else None


def _traces_here() -> list[Any]:
    """The current trace and the traces it is nested in (a jit, cond, scan or shard_map body inside another)."""
    out, trace = [], _trace()
    while trace is not None and len(out) < 1000:
        out.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return out


def _tables(comm: CommView, direction: str) -> list[dict]:
    """The open rounds of `direction` recorded in this traced function, then in each one it is nested in."""
    return [_open.get(t, {}).get((comm.id, direction), {}) for t in _traces_here()]


def check_open(comm: CommView, direction: str, op: str, one_shot: bool = False) -> None:
    """Before a send half of `direction` ("dispatch" or "combine") is bound: refuses it if the backend's buffers for
    that direction are all held by rounds open here: opened in this traced function or in the ones it is nested in
    (a nested jit, a cond branch, a loop body runs while its enclosing function's rounds are open) and not received.
    one_shot (`dispatch`, `combine`): on a backend that receives in order, also while any round is open here."""
    limit = comm.backend.rounds_in_flight
    tables = _tables(comm, direction)
    held = [what for table in tables for _, what in table.values()]
    if one_shot and held and getattr(comm.backend, "receives_in_order", False):
        raise RuntimeError(
            f"jax_moe.{op}: {len(held)} {direction} round(s) of this Communicator are open here (sent, not yet "
            f"received: {', '.join(held)}); backend {comm.backend_name!r} receives the rounds of one direction in "
            f"the order they were sent, and this call's receive would come before theirs. Receive them "
            f"({direction}_recv) before this call, or split it into {direction}_send and {direction}_recv too.")
    if limit is None or len(held) < limit:
        return
    nested = sum(1 for table in tables[1:] if table) > 0
    where = (" here and in the functions this one is nested in (an enclosing jit, or the program around a cond "
             "branch or loop body)") if nested else " here"
    raise RuntimeError(
        f"jax_moe.{op}: {len(held)} {direction} round(s) of this Communicator are already open{where} (sent, not yet "
        f"received: {', '.join(held)}); backend {comm.backend_name!r} holds {limit} at a time, and its calls run in "
        f"program order, so this send would wait for a receive that comes after it. Call {direction}_recv on an "
        f"earlier handle first, or use another Communicator for this round.")


def opened(comm: CommView, direction: str, handle: Any, op: str) -> None:
    """A send half was bound; `handle` (the backend's) is what its receive consumes."""
    key = _key(handle)
    if key is None:  # evaluated eagerly: nothing can be reordered
        return
    table = _open.setdefault(_trace(), {}).setdefault((comm.id, direction), {})
    table[id(key)] = (weakref.ref(key), f"{op} #{len(table) + 1}")


def _check_oldest(comm: CommView, direction: str, op: str, table: dict, key: Any) -> None:
    """Refuses receiving `key`'s round (opened in `table`) while an older round of the direction is open: one opened
    before it in the same traced function, or in a function this one is nested in."""
    ancestors = _tables(comm, direction)[1:]
    older = [what for t in ancestors if t is not table for _, what in t.values()]
    for ref, what in table.values():
        if ref() is key:
            break
        older.append(what)
    if older:
        raise RuntimeError(
            f"jax_moe.{op}: backend {comm.backend_name!r} receives the rounds of one direction in the order they were "
            f"sent, and {', '.join(older)} of this Communicator is still open (sent before this round, not yet "
            f"received). Receive it first.")


def closed(comm: CommView, direction: str, handle: Any, op: str) -> None:
    """The receive half of the round whose send returned `handle` is about to be bound."""
    key = _key(handle)
    if key is None:
        return
    seen = _received.setdefault(_trace(), {})
    if (ref := seen.get(id(key))) is not None and ref() is key:
        raise RuntimeError(f"jax_moe.{op}: this handle was already received; every {direction}_send handle is "
                           f"received exactly once (a second receive would take the next round's data)")
    seen[id(key)] = weakref.ref(key)
    tables = [t.get((comm.id, direction)) for t in list(_open.values())]
    for table in tables:
        entry = table.get(id(key)) if table else None
        if entry is not None and entry[0]() is key:
            if getattr(comm.backend, "receives_in_order", False):
                _check_oldest(comm, direction, op, table, key)
            del table[id(key)]
            return
    # A handle from another trace, seen here as another tracer: its round is the oldest one still open in the
    # nearest enclosing trace that has one, else (a loop body's trace is not always chained to the function around
    # the loop) in any live trace. A handle both branches of a cond receive closes two rounds: an under-count, which
    # the backend's run-time check still catches.
    for table in _tables(comm, direction)[1:] + tables:
        if table:
            del table[next(iter(table))]
            return
