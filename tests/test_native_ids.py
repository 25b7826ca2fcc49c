"""Native ids of backend "cpu": the wire carries a Communicator's id modulo CpuBackend.id_limit, so two live Communicators
must not share one, and a dropped Communicator's late finalizer must not free a newer one that reuses its id."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import jax_moe
from jax_moe.backends import cpu
from support.helpers import check_roundtrip, mesh_of, random_routing, random_tokens, roundtrip

N, E, R, HIDDEN, T = 2, 4, 2, 64, 5


@pytest.fixture
def two_ids(monkeypatch):
    """Ids modulo 2: every other Communicator reuses a native id."""
    try:
        jax_moe.backends.load("cpu")
    except jax_moe.BackendUnavailable as e:
        pytest.skip(str(e))
    gc.collect()
    monkeypatch.setattr(cpu.CpuBackend, "id_limit", 2)


def make() -> jax_moe.Communicator:
    return jax_moe.Communicator(jax_moe.MoEConfig(E, R, HIDDEN, T), mesh_of(N), "ep", backend="cpu")


def works(comm: jax_moe.Communicator, rng: np.random.Generator) -> None:
    x, scale = random_tokens(rng, N * T, HIDDEN, False)
    idx = random_routing(rng, N, T, R, E, mask=0.3)
    w = rng.random((N * T, R)).astype(np.float32)
    check_roundtrip(comm, N, x, idx, w, scale, roundtrip(comm, x, idx, w, scale))


def test_a_live_communicators_id_is_not_reused(two_ids, rng):
    a = make()
    b = make()
    if b.backend.native_id == a.backend.native_id:  # ids taken by other tests' failed constructions
        a, b = b, make()
    with pytest.raises(RuntimeError, match=r"still alive.*at most 2 Communicators"):
        make()  # its id maps to a's or b's native id, and both are alive
    works(a, rng)  # neither was torn down by the refused construction
    works(b, rng)


def test_a_dropped_communicators_id_is_reused_and_its_finalizer_spares_the_new_one(two_ids, rng):
    a = make()
    a_id = a.backend.native_id
    cycle: list = [a]
    cycle.append(cycle)
    del a, cycle  # garbage that only the cycle collector frees: its finalizer has not run
    gc.disable()
    try:
        c = make()
        if c.backend.native_id != a_id:
            c = make()
    finally:
        gc.enable()
    assert c.backend.native_id == a_id
    gc.collect()  # nothing of a's may be left to free c's state
    works(c, rng)
