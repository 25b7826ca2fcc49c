"""Finalizers that the cycle collector runs only queue their clean-up (jax_moe.backends.deferred): waiting for programs
inside a collection runs jax's Python in the middle of whatever allocation started it. The queued clean-up runs at the
next safe point; a Communicator dropped outside a collection is freed at once."""
from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.backends import deferred
from support.helpers import cpu_module, mesh_of, random_routing, random_tokens, shard

N, T, HIDDEN = 2, 4, 64


@pytest.fixture
def cpu():
    module = cpu_module()
    gc.collect()
    deferred.run_pending()
    return module


def make() -> jax_moe.Communicator:
    return jax_moe.Communicator(jax_moe.MoEConfig(4, 2, HIDDEN, T), mesh_of(N), "ep", backend="cpu")


def dispatch_once(comm: jax_moe.Communicator, rng: np.random.Generator) -> None:
    x, _ = random_tokens(rng, N * T, HIDDEN, False)
    args = shard(comm.mesh, x, random_routing(rng, N, T, 2, 4))
    f = jax.jit(jax.shard_map(lambda x, i: comm.dispatch(x, i).expert_x, mesh=comm.mesh, in_specs=(P("ep"),) * 2,
                              out_specs=P("ep")))
    jax.block_until_ready(f(*args))


def test_work_inside_a_collection_waits_for_the_next_safe_point():
    done: list[int] = []

    class Holder:
        pass

    h = Holder()
    h.me = h  # a cycle: only the collector frees it
    weakref.finalize(h, lambda: deferred.after_programs(lambda: done.append(1)))
    del h
    gc.collect()
    assert done == [] and deferred.pending() == 1
    deferred.run_pending()
    assert done == [1] and deferred.pending() == 0
    deferred.after_programs(lambda: done.append(2))  # outside a collection: at once
    assert done == [1, 2]


def test_a_collected_communicator_is_freed_at_the_next_safe_point(cpu, rng):
    base = cpu.live_comms()
    a = make()
    dispatch_once(a, rng)
    cycle: list = [a]
    cycle.append(cycle)
    del a, cycle
    gc.collect()
    assert deferred.pending() == 1 and cpu.live_comms() == base + 1  # queued, not freed inside the collector
    b = make()  # a safe point: the collected one's state goes before b's is allocated
    assert deferred.pending() == 0 and cpu.live_comms() == base + 1
    dispatch_once(b, rng)
    del b
    assert cpu.live_comms() == base  # dropped outside a collection: freed at once
