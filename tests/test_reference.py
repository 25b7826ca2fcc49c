"""The contract of dispatch/combine (section 2 of the Foundation issue), checked against the NumPy oracle.

Fresh random routings every run: masked entries, skewed loads, T < max_tokens, N in {1, 2, 4, 8}, bf16 and fp8.
Parametrised over backends so that every backend runs the same checks ("cuda" on GPUs: marked gpu, skipped elsewhere).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.backends.xla import XlaBackend
from support.helpers import (BACKENDS, WEIGHTS_AT, backend_mesh, bits, check_roundtrip, expert_fn, mesh_of,
                             random_routing, random_tokens, ranks_for, roundtrip, run, shard)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", ["random", "skewed", "partial"])
@WEIGHTS_AT
def test_roundtrip_matches_oracle(rng, backend, n, fp8, case, weights_at_dispatch):
    e, r, hidden, max_tokens = 16, 4, 256, 12
    t = 5 if case == "partial" else max_tokens
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    cfg = jax_moe.MoEConfig(e, r, hidden, max_tokens, dispatch_dtype=dtype)
    comm = jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend)
    x, scale = random_tokens(rng, n * t, hidden, fp8)
    idx = random_routing(rng, n, t, r, e, mask=0.25, skew=case == "skewed")
    w = rng.random((n * t, r)).astype(np.float32)
    outs = roundtrip(comm, x, idx, w, scale, weights_at_dispatch=weights_at_dispatch)
    check_roundtrip(comm, n, x, idx, w, scale, outs)


@pytest.mark.parametrize("backend", BACKENDS)
@WEIGHTS_AT
def test_every_token_to_one_expert_fills_max_recv_rows(rng, backend, weights_at_dispatch):
    """The worst case: every token of every rank picks all R experts on rank 0 (R <= L)."""
    n, e, r, hidden, t = ranks_for(backend, 4), 16, 4, 128, 6
    cfg = jax_moe.MoEConfig(e, r, hidden, t)
    comm = jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend)
    assert comm.max_recv_rows == n * t * min(r, e // n)
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = np.stack([rng.permutation(e // n)[:r] for _ in range(n * t)]).astype(np.int32)  # all on rank 0
    w = rng.random((n * t, r)).astype(np.float32)
    outs = roundtrip(comm, x, idx, w, weights_at_dispatch=weights_at_dispatch)
    assert np.asarray(outs[2]).reshape(n, -1)[0].sum() == comm.max_recv_rows
    check_roundtrip(comm, n, x, idx, w, None, outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@WEIGHTS_AT
def test_split_halves_equal_one_shot(rng, backend, fp8, weights_at_dispatch):
    n, e, r, hidden, t = ranks_for(backend, 4), 8, 2, 128, 7
    cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    comm = jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend)
    x, scale = random_tokens(rng, n * t, hidden, fp8)
    idx = random_routing(rng, n, t, r, e)
    w = rng.random((n * t, r)).astype(np.float32)
    one = roundtrip(comm, x, idx, w, scale, weights_at_dispatch=weights_at_dispatch)
    two = roundtrip(comm, x, idx, w, scale, split_halves=True, weights_at_dispatch=weights_at_dispatch)
    for a, b in zip(one, two):
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_at_dispatch_or_combine(rng, backend):
    """Weights given to dispatch (the expert ranks may sum a token's rows) give what the same weights given to combine
    give, within bf16 rounding; weights at combine other than the dispatched ones are the ones applied."""
    n, e, r, hidden, t = ranks_for(backend, 4), 16, 4, 128, 9  # L = 4 (2 on "cuda"): tokens share ranks between k
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), backend_mesh(backend, n), "ep", backend=backend)
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = random_routing(rng, n, t, r, e)
    w = rng.random((n * t, r)).astype(np.float32)
    other = rng.standard_normal((n * t, r)).astype(np.float32)
    at_combine = np.asarray(roundtrip(comm, x, idx, w)[3]).astype(np.float32)
    at_dispatch = np.asarray(roundtrip(comm, x, idx, w, weights_at_dispatch=True)[3]).astype(np.float32)
    np.testing.assert_allclose(at_dispatch, at_combine, rtol=1e-2, atol=1e-2 * np.abs(at_combine).max())

    def other_weights(x, idx, w, other):
        d = comm.dispatch(x, idx, topk_weights=w)
        return d.expert_x, None, d.expert_counts, comm.combine(expert_fn(d.expert_x, d.expert_counts, comm), other, d)

    check_roundtrip(comm, n, x, idx, other, None, run(comm, other_weights, x, idx, w, other))


class _Recording(XlaBackend):
    """The reference backend, recording what the API tells it about the weights."""

    def __init__(self, comm):
        super().__init__(comm)
        self.seen: list[tuple[str, bool]] = []

    def dispatch_send(self, x, x_scale, topk_idx, topk_weights=None):
        self.seen.append(("dispatch_send", topk_weights is not None))
        return super().dispatch_send(x, x_scale, topk_idx, topk_weights)

    def combine_send(self, expert_y, route, topk_idx, reduced=False):
        self.seen.append(("combine_send", reduced))
        return super().combine_send(expert_y, route, topk_idx, reduced)


@pytest.mark.parametrize("how, want", [
    ("dispatch", [("dispatch_send", True), ("combine_send", True)]),
    ("dispatch, same at combine", [("dispatch_send", True), ("combine_send", True)]),
    ("dispatch, halves", [("dispatch_send", True), ("combine_send", True)]),
    ("dispatch, other at combine", [("dispatch_send", True), ("combine_send", False)]),
    ("combine", [("dispatch_send", False), ("combine_send", False)]),
    ("combine, halves", [("dispatch_send", False), ("combine_send", False)]),
])
def test_backend_is_told_when_rows_may_be_summed(rng, how, want):
    """reduced=True reaches combine_send exactly when the weights combine_recv applies are the dispatched ones."""
    n, e, r, hidden, t = 2, 8, 2, 128, 3
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh_of(n), "ep", backend="xla")
    comm.backend = spy = _Recording(comm)
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = random_routing(rng, n, t, r, e)
    w, other = rng.random((2, n * t, r)).astype(np.float32)

    def body(x, idx, w, other):
        at_dispatch = how.startswith("dispatch")
        if how.endswith("halves"):
            d = comm.dispatch_recv(comm.dispatch_send(x, idx, topk_weights=w if at_dispatch else None))
            return comm.combine_recv(comm.combine_send(d.expert_x, d), None if at_dispatch else w)
        d = comm.dispatch(x, idx, topk_weights=w if at_dispatch else None)
        given = {"dispatch": None, "dispatch, same at combine": w, "dispatch, other at combine": other}.get(how, w)
        return comm.combine(d.expert_x, given, d)

    run(comm, body, x, idx, w, other)
    assert spy.seen == want


def test_dispatch_transpose_is_not_reduced(rng):
    """The backward of dispatch is a combine with unit weights, never the dispatched ones."""
    n, e, r, hidden, t = 2, 8, 2, 128, 3
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh_of(n), "ep", backend="xla")
    comm.backend = spy = _Recording(comm)
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = random_routing(rng, n, t, r, e)
    w = rng.random((n * t, r)).astype(np.float32)

    def loss(x, idx, w):
        d = comm.dispatch(x, idx, topk_weights=w)
        return jax.lax.psum(jnp.sum(comm.combine(d.expert_x, None, d).astype(jnp.float32)), "ep")

    f = jax.shard_map(loss, mesh=comm.mesh, in_specs=(P("ep"),) * 3, out_specs=P())
    jax.jit(jax.grad(f, argnums=(0, 2)))(*shard(comm.mesh, x, idx, w))
    assert spy.seen.count(("combine_send", True)) == 1  # the forward's only
    assert ("combine_send", False) in spy.seen  # dispatch's transpose


def test_out_of_range_ids_are_masked(rng):
    """Ids outside [0, E) never move data; the reference treats them as masked."""
    n, e, r, hidden, t = 2, 8, 3, 128, 6
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh_of(n), "ep", backend="xla")
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = random_routing(rng, n, t, r, e, mask=0.0)
    bad = idx.copy()
    bad[0, 0], bad[3, 1], bad[n * t - 1, 2] = e, 1 << 30, -7
    clean = np.where((bad >= 0) & (bad < e), bad, -1).astype(np.int32)
    w = rng.random((n * t, r)).astype(np.float32)
    got, want = roundtrip(comm, x, bad, w), roundtrip(comm, x, clean, w)
    for a, b in zip(got, want):
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("backend", ["cpu"])  # "cuda" reports it at the next receive: tests/gpu/test_cuda.py
@pytest.mark.parametrize("bad", [1000, 8, -2])
def test_out_of_range_id_is_an_error(rng, backend, bad):
    """Native backends report an id outside [0, E) other than -1 as INVALID_ARGUMENT naming it and the rank, on
    every rank and every later call (one code, whichever rank reports first), and write nothing."""
    n, e, r, hidden, t = 4, 8, 2, 128, 3
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh_of(n), "ep", backend=backend, timeout_s=20)
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = random_routing(rng, n, t, r, e, mask=0.0)
    idx[t + 1, 1] = bad  # rank 1, token 1
    w = rng.random((n * t, r)).astype(np.float32)
    messages = []
    for _ in range(2):
        with pytest.raises(jax.errors.JaxRuntimeError, match=rf"INVALID_ARGUMENT.*rank 1 .*expert id {bad}") as err:
            jax.block_until_ready(roundtrip(comm, x, idx, w))
        messages.append(str(err.value))
    # The later call says what to do: the Communicator is done.
    assert "build a new Communicator" in messages[1], messages[1][-1000:]


def test_tuple_axis_name(rng):
    """axis_name may be a tuple of mesh axes: ranks are numbered over them, row-major."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    e, r, hidden, t = 8, 2, 128, 4
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh, ("a", "b"), backend="xla")
    assert comm.num_ranks == 4
    x, _ = random_tokens(rng, 4 * t, hidden, False)
    idx = random_routing(rng, 4, t, r, e)
    w = rng.random((4 * t, r)).astype(np.float32)
    check_roundtrip(comm, 4, x, idx, w, None, roundtrip(comm, x, idx, w))


def check_two_layers(rng, c1, c2, n: int, hidden: int, t: int) -> None:
    """Two Communicators (configs E=8/R=2 and E=16/R=3) back to back in one program equal the two run apart."""
    x, _ = random_tokens(rng, n * t, hidden, False)
    i1, i2 = random_routing(rng, n, t, 2, 8), random_routing(rng, n, t, 3, 16)
    w1, w2 = rng.random((n * t, 2)).astype(np.float32), rng.random((n * t, 3)).astype(np.float32)

    def body(x, i1, w1, i2, w2):
        d1 = c1.dispatch(x, i1)
        h = c1.combine(expert_fn(d1.expert_x, d1.expert_counts, c1), w1, d1)
        d2 = c2.dispatch(h, i2)
        return c2.combine(expert_fn(d2.expert_x, d2.expert_counts, c2), w2, d2)

    got = np.asarray(run(c1, body, x, i1, w1, i2, w2)).astype(np.float32)
    h = np.asarray(roundtrip(c1, x, i1, w1)[3])
    want = np.asarray(roundtrip(c2, h, i2, w2)[3]).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_layers_in_one_jit(rng, backend):
    n, hidden, t = ranks_for(backend, 4), 128, 5
    mesh = backend_mesh(backend, n)
    c1 = jax_moe.Communicator(jax_moe.MoEConfig(8, 2, hidden, t), mesh, "ep", backend=backend)
    c2 = jax_moe.Communicator(jax_moe.MoEConfig(16, 3, hidden, t), mesh, "ep", backend=backend)
    check_two_layers(rng, c1, c2, n, hidden, t)


def test_quantize_fp8_roundtrip(rng):
    x = jnp.asarray(rng.standard_normal((8, 512)).astype(np.float32) * 10)
    q, s = jax_moe.quantize_fp8(x)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (8, 4) and s.dtype == jnp.float32
    back = jax_moe.dequantize_fp8(q, s)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=0.07, atol=1e-3)
    amax = np.abs(np.asarray(x)).reshape(8, 4, 128).max(-1)
    np.testing.assert_allclose(np.asarray(s), amax / 448.0, rtol=1e-6)
