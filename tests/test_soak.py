"""Per-call leaks: thousands of calls of one Communicator must leave memory, file descriptors and threads flat."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe
from support.helpers import expert_fn, mesh_of, random_routing, random_tokens, shard


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("backend", ["cpu"])
def test_calls_leak_nothing(rng, backend):
    n, t, hidden = 2, 4, 128
    comm = jax_moe.Communicator(jax_moe.MoEConfig(4, 2, hidden, t), mesh_of(n), "ep", backend=backend)

    def body(x, idx, w):
        d = comm.dispatch(x, idx)
        return comm.combine(expert_fn(d.expert_x, d.expert_counts, comm), w, d)

    f = jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    x, _ = random_tokens(rng, n * t, hidden, False)
    args = shard(comm.mesh, x, random_routing(rng, n, t, 2, 4), rng.random((n * t, 2)).astype(np.float32))
    for _ in range(300):  # warm-up: compile, allocator pools, JAX's caches
        out = f(*args)
    jax.block_until_ready(out)
    before = (rss_mb(), fds(), threads())
    for i in range(2000):
        out = f(*args)
        if i % 100 == 0:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    after = (rss_mb(), fds(), threads())
    print(f"soak: RSS {before[0]:.1f} -> {after[0]:.1f} MB, fds {before[1]} -> {after[1]}, threads {before[2]} -> {after[2]}")
    # 2000 calls: a leak of 1 KiB per call is 2 MB; allow JAX's own noise below that.
    assert after[0] - before[0] < 2.0, f"RSS grew {after[0] - before[0]:.2f} MB over 2000 calls"
    assert after[1] == before[1], f"file descriptors {before[1]} -> {after[1]}"
    assert after[2] == before[2], f"threads {before[2]} -> {after[2]}"


def test_communicators_made_and_dropped_leak_nothing(rng):
    """Communicators built and dropped in a loop (a model rebuilt per experiment): threads and fds stay flat."""
    import gc

    n, t, hidden = 2, 4, 128
    x, _ = random_tokens(rng, n * t, hidden, False)
    mesh = mesh_of(n)
    args = shard(mesh, x, random_routing(rng, n, t, 2, 4))

    def one_comm() -> None:
        comm = jax_moe.Communicator(jax_moe.MoEConfig(4, 2, hidden, t), mesh, "ep", backend="cpu")
        f = jax.jit(jax.shard_map(lambda x, i: comm.dispatch(x, i).expert_x, mesh=mesh, in_specs=(P("ep"),) * 2,
                                  out_specs=P("ep")))
        jax.block_until_ready(f(*args))

    for _ in range(5):
        one_comm()
    gc.collect()
    before = (fds(), threads())
    for _ in range(50):
        one_comm()
    gc.collect()
    after = (fds(), threads())
    print(f"soak: 50 Communicators: fds {before[0]} -> {after[0]}, threads {before[1]} -> {after[1]}")
    assert after == before


def test_a_dropped_communicator_frees_its_buffers_at_once():
    """No reference cycle between a Communicator and its backend: dropping it frees the native state right away,
    without waiting for the cyclic garbage collector."""
    import gc

    from jax_moe import _core

    gc.collect()
    base = _core.cpu.live_comms()
    comm = jax_moe.Communicator(jax_moe.MoEConfig(4, 2, 128, 4), mesh_of(2), "ep", backend="cpu")
    assert _core.cpu.live_comms() == base + 1
    gc.disable()
    try:
        del comm
        assert _core.cpu.live_comms() == base
    finally:
        gc.enable()
