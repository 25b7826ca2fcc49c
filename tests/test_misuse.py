"""Misuse of the halves must not poison later calls silently: refused at trace time where the program shows it
(tests/test_program_shapes.py), else at run time with an error that names it, promptly, never a timeout."""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe
from support.helpers import (BACKENDS, CPU_BACKENDS, backend_mesh, check_roundtrip, random_routing, random_tokens,
                             ranks_for, roundtrip, shard)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sends_never_received_fail_the_next_send_at_once(rng, backend):
    """Programs that send and never receive (a handle dropped): once the backend's buffers are all held by such
    rounds, the next send fails at once naming the misuse, instead of waiting for the timeout."""
    n = ranks_for(backend, 2)
    cfg = jax_moe.MoEConfig(4 * n, 2, 128, 4)
    comm = jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend, timeout_s=30)
    leak = jax.jit(jax.shard_map(lambda x, i: (comm.dispatch_send(x, i), x)[1], mesh=comm.mesh,
                                 in_specs=(P("ep"),) * 2, out_specs=P("ep")))
    x, _ = random_tokens(rng, n * 4, 128, False)
    idx = random_routing(rng, n, 4, 2, 4 * n)
    w = rng.random((n * 4, 2)).astype(np.float32)
    limit = comm.backend.rounds_in_flight
    if limit is None:  # nothing held: any number of unreceived sends is harmless
        jax.block_until_ready(leak(*shard(comm.mesh, x, idx)))
        check_roundtrip(comm, n, x, idx, w, None, roundtrip(comm, x, idx, w))
        return
    for _ in range(limit):
        jax.block_until_ready(leak(*shard(comm.mesh, x, idx)))
    t0 = time.monotonic()
    with pytest.raises(Exception, match="never received"):
        jax.block_until_ready(roundtrip(comm, x, idx, w))
    assert time.monotonic() - t0 < 10, "the misuse must be reported at once, not after the 30 s timeout"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_handle_received_twice_across_programs_is_refused(rng, backend):
    """A handle returned by one program and received by two later ones: "cpu" refuses the second receive at once
    (its lane may hold another round by then, and a second credit would let a sender overwrite a lane nobody read);
    "xla" holds no per-round state and returns the same rows again."""
    n = 2
    cfg = jax_moe.MoEConfig(4 * n, 2, 128, 4)
    comm = jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend, timeout_s=30)
    send = jax.jit(jax.shard_map(lambda x, i: comm.dispatch_send(x, i), mesh=comm.mesh, in_specs=(P("ep"),) * 2,
                                 out_specs=P("ep")))
    recv = jax.jit(jax.shard_map(lambda h: comm.dispatch_recv(h).expert_x, mesh=comm.mesh, in_specs=(P("ep"),),
                                 out_specs=P("ep")))
    x, _ = random_tokens(rng, n * 4, 128, False)
    idx = random_routing(rng, n, 4, 2, 4 * n)
    handle = send(*shard(comm.mesh, x, idx))
    first = np.asarray(recv(handle))
    if backend == "xla":
        np.testing.assert_array_equal(np.asarray(recv(handle)), first)
        return
    t0 = time.monotonic()
    with pytest.raises(Exception, match="was received already"):
        jax.block_until_ready(recv(handle))
    assert time.monotonic() - t0 < 10, "refused at once, not after the timeout"
