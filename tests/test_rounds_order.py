"""jax_moe.rounds for a backend whose receives take the oldest open round of their direction (`receives_in_order`,
backend "cuda"): receives out of send order and one-shot calls while a round is open are refused at trace time, with
the cause; in order they pass. Run against a stand-in Communicator, so CI checks the rule without a GPU (the GPU
suite runs the same patterns through the real backend, tests/test_program_shapes.py)."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from jax_moe import rounds

_ids = itertools.count(10_000)


def _comm(in_order: bool, limit: int = 2) -> SimpleNamespace:
    backend = SimpleNamespace(rounds_in_flight=limit, receives_in_order=in_order)
    return SimpleNamespace(id=next(_ids), backend=backend, backend_name="stand-in")


def _trace(fn) -> None:
    """Runs fn(x) under a jit trace (its handles are tracers, as in a real program)."""
    jax.jit(lambda x: (fn(x), x)[1]).lower(jnp.zeros((2,), jnp.float32))


def _send(comm, x, k: int):
    rounds.check_open(comm, "dispatch", "dispatch_send")
    h = x + k  # a handle: a fresh tracer per round
    rounds.opened(comm, "dispatch", h, "dispatch_send")
    return h


def test_in_send_order_passes():
    comm = _comm(True)

    def body(x):
        a, b = _send(comm, x, 1), _send(comm, x, 2)
        rounds.closed(comm, "dispatch", a, "dispatch_recv")
        rounds.closed(comm, "dispatch", b, "dispatch_recv")
        c = _send(comm, x, 3)
        rounds.closed(comm, "dispatch", c, "dispatch_recv")

    _trace(body)


@pytest.mark.parametrize("in_order", [True, False])
def test_receives_out_of_send_order(in_order):
    """Refused, naming the older round, where receives take the oldest open round; else any order passes (and a
    one-shot call once nothing is open)."""
    comm = _comm(in_order)

    def body(x):
        a, b = _send(comm, x, 1), _send(comm, x, 2)
        rounds.closed(comm, "dispatch", b, "dispatch_recv")
        rounds.closed(comm, "dispatch", a, "dispatch_recv")
        rounds.check_open(comm, "dispatch", "dispatch", one_shot=True)

    if not in_order:
        _trace(body)
        return
    with pytest.raises(RuntimeError, match=r"dispatch_recv: backend 'stand-in' receives the rounds of one direction "
                                           r"in the order they were sent, and dispatch_send #1 .* still open"):
        _trace(body)


def test_a_one_shot_call_while_a_round_is_open_is_refused():
    comm = _comm(True)

    def body(x):
        _send(comm, x, 1)
        rounds.check_open(comm, "dispatch", "dispatch", one_shot=True)

    with pytest.raises(RuntimeError, match=r"jax_moe.dispatch: 1 dispatch round\(s\) .* open here .* in the order "
                                           r"they were sent"):
        _trace(body)


def test_a_one_shot_call_with_nothing_open_passes_and_other_directions_do_not_count():
    comm = _comm(True)

    def body(x):
        rounds.check_open(comm, "dispatch", "dispatch", one_shot=True)
        h = x + 1
        rounds.opened(comm, "combine", h, "combine_send")
        rounds.check_open(comm, "dispatch", "dispatch", one_shot=True)
        rounds.closed(comm, "combine", h, "combine_recv")

    _trace(body)


def test_a_round_open_in_the_enclosing_function_is_older_than_a_nested_one():
    comm = _comm(True, limit=3)

    def body(x):
        _send(comm, x, 1)

        def inner(y):
            b = _send(comm, y, 2)
            rounds.closed(comm, "dispatch", b, "dispatch_recv")  # the enclosing round is older
            return y

        return jax.jit(inner)(x)

    with pytest.raises(RuntimeError, match="dispatch_send #1 of this Communicator is still open"):
        _trace(body)
