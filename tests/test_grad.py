"""Gradients of dispatch -> experts -> combine against a dense per-token reference (no communication)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from support.grads import check_against, check_grads, dense_loss, grad_problem, moe_layer, moe_loss_fn
from support.helpers import BACKENDS, backend_mesh, mesh_of, random_routing, ranks_for


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("split_halves", [False, True], ids=["one-shot", "halves"])
def test_gradients_match_dense_reference(rng, backend, n, split_halves):
    e, r, hidden, t = 8, 3, 64, 6
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), backend_mesh(backend, n), "ep", backend=backend)
    problem = grad_problem(rng, n, t, r, e, hidden)
    sh = NamedSharding(comm.mesh, P("ep"))
    got = moe_loss_fn(comm, split_halves)(*[jax.device_put(v, sh) for v in problem])
    check_grads(got, problem, e)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split_halves", [False, True], ids=["one-shot", "halves"])
def test_gradients_with_weights_at_dispatch(rng, backend, split_halves):
    """Weights given to dispatch get the gradient weights given to combine get (and x and the experts theirs)."""
    n, e, r, hidden, t = ranks_for(backend, 4), 8, 3, 64, 6
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), backend_mesh(backend, n), "ep", backend=backend)
    problem = grad_problem(rng, n, t, r, e, hidden)
    sh = NamedSharding(comm.mesh, P("ep"))
    args = [jax.device_put(v, sh) for v in problem]
    got = moe_loss_fn(comm, split_halves, weights_at_dispatch=True)(*args)
    check_grads(got, problem, e)
    want = moe_loss_fn(comm, split_halves)(*args)
    for name, gv, wv in zip(("x", "topk_weights", "a", "b"), got, want):
        gv, wv = np.asarray(gv, np.float32), np.asarray(wv, np.float32)
        np.testing.assert_allclose(gv, wv, rtol=1e-2, atol=1e-2 * (np.abs(wv).max() + 1e-6), err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_the_same_on_every_rank_get_the_sum_of_the_ranks_gradients(rng, backend):
    """Tokens and router weights that are the same on every rank (a replicated input, a constant made in the body) are
    valid: their gradient is the sum of the ranks' (JAX's rule for an invariant value used per rank). The halves'
    backward rules return per-rank cotangents, which did not type against such an input ("manual axis types do not
    match")."""
    n, e, r, hidden, t = ranks_for(backend, 2), 8, 3, 64, 6
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), backend_mesh(backend, n), "ep", backend=backend)
    _, idx, _, a, b, g = grad_problem(rng, n, t, r, e, hidden)
    # d loss / d s is one sum over every slot and feature. With signed terms it can cancel to a small total whose
    # bf16 rounding (expert rows, the output's cotangent) exceeds rtol of itself; positive terms keep it well-sized.
    a, b, g = np.abs(a), np.abs(b), np.abs(g)
    x0 = np.abs(rng.standard_normal((t, hidden))).astype(jnp.bfloat16)  # every rank's tokens
    s = np.float32(rng.random() + 0.5)  # every slot's weight
    layer = moe_layer(comm, split_halves=False)

    def body(x0, s, idx, a, b, g):
        out = layer(x0, idx, s * jnp.ones((t, r), jnp.float32), a, b)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * g), "ep")

    specs = (P(), P(), P("ep"), P("ep"), P("ep"), P("ep"))  # x0 and s replicated, the rest per rank
    f = jax.shard_map(body, mesh=comm.mesh, in_specs=specs, out_specs=P())
    args = [jax.device_put(v, NamedSharding(comm.mesh, p)) for v, p in zip((x0, s, idx, a, b, g), specs)]
    got = jax.jit(jax.grad(f, argnums=(0, 1, 3, 4)))(*args)

    def dense(x0, s, a, b):
        return dense_loss(jnp.tile(x0, (n, 1)), idx, s * jnp.ones((n * t, r), jnp.float32), a, b, g, e)

    check_against(got, jax.grad(dense, argnums=(0, 1, 2, 3))(jnp.asarray(x0), s, a, b), f"{backend} vs dense")


def test_fp8_dispatch_is_not_differentiable(rng):
    n, e, r, hidden, t = 2, 4, 2, 128, 4
    cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn)
    comm = jax_moe.Communicator(cfg, mesh_of(n), "ep", backend="xla")

    def body(x, idx):
        q, s = jax_moe.quantize_fp8(x)
        d = comm.dispatch(q.astype(jnp.float8_e4m3fn), idx, x_scale=s)
        return jax.lax.psum(jnp.sum(d.expert_x.astype(jnp.float32)), "ep")

    f = jax.shard_map(body, mesh=comm.mesh, in_specs=(P("ep"), P("ep")), out_specs=P())
    x = jax.device_put(rng.standard_normal((n * t, hidden)).astype(np.float32), NamedSharding(comm.mesh, P("ep")))
    idx = jax.device_put(random_routing(rng, n, t, r, e), NamedSharding(comm.mesh, P("ep")))
    with pytest.raises(NotImplementedError, match="bfloat16"):
        jax.jit(jax.grad(f))(x, idx)


POISONED = [b for b in BACKENDS if getattr(b, "values", (b,))[0] != "cpu"]  # "cpu" writes zeros whatever the flag


@pytest.mark.parametrize("backend", POISONED)
def test_padding_rows_never_reach_the_gradients(rng, backend, monkeypatch):
    """The padding rows of expert_x are unspecified; JAX_MOE_POISON_PADDING=1 makes them NaN. An expert that masks
    its input by the counts (support.grads, as ragged_dot does) gets the dense reference's gradients, and the same
    expert unmasked shows that the NaN really is there (a NaN times a zero cotangent is NaN)."""
    monkeypatch.setenv("JAX_MOE_POISON_PADDING", "1")
    n, e, r, hidden, t = ranks_for(backend, 4), 8, 3, 64, 6
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), backend_mesh(backend, n), "ep", backend=backend)
    problem = grad_problem(rng, n, t, r, e, hidden)
    sh = NamedSharding(comm.mesh, P("ep"))
    args = [jax.device_put(v, sh) for v in problem]
    got = moe_loss_fn(comm, split_halves=False, weights_at_dispatch=True)(*args)
    check_grads(got, problem, e)

    def unmasked(x, idx, w, a):
        d = comm.dispatch(x, idx)
        y = (d.expert_x.astype(jnp.float32) * a[0]).astype(jnp.bfloat16)
        return jax.lax.psum(jnp.sum(comm.combine(y, w, d).astype(jnp.float32)), "ep")

    f = jax.shard_map(unmasked, mesh=comm.mesh, in_specs=(P("ep"),) * 4, out_specs=P())
    g_a = jax.jit(jax.grad(f, argnums=3))(*args[:4])
    assert np.isnan(np.asarray(g_a)).any(), "the poisoned padding did not show: the test would not see a leak"


@pytest.mark.parametrize("backend", POISONED)
def test_zero_padding_writes_zeros(rng, backend, monkeypatch):
    """MoEConfig(zero_padding=True): the padding rows are zeros (for experts that read every row unmasked)."""
    monkeypatch.setenv("JAX_MOE_POISON_PADDING", "1")
    n, e, r, hidden, t = ranks_for(backend, 4), 8, 2, 128, 5
    for fp8 in (False, True):
        cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16,
                                zero_padding=True)
        comm = jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend)
        x = rng.standard_normal((n * t, hidden)).astype(np.float32)
        xq, scale = (jax_moe.quantize_fp8(jnp.asarray(x)) if fp8 else (x.astype(jnp.bfloat16), None))
        idx = random_routing(rng, n, t, r, e, mask=0.5)
        mesh = comm.mesh

        def body(x, idx, *scale):
            d = comm.dispatch(x, idx, x_scale=scale[0] if scale else None)
            s = d.expert_x_scale if d.expert_x_scale is not None else jnp.zeros((1, 1), jnp.float32)
            return d.expert_x.astype(jnp.float32), s, d.expert_counts

        args = (xq, idx) + ((scale,) if fp8 else ())
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * len(args), out_specs=P("ep")))
        ex, sc, counts = (np.asarray(v) for v in f(*[jax.device_put(np.asarray(a), NamedSharding(mesh, P("ep")))
                                                    for a in args]))
        m = comm.max_recv_rows
        for q in range(n):
            total = int(counts.reshape(n, -1)[q].sum())
            assert total < m
            assert (ex.reshape(n, m, -1)[q][total:] == 0).all(), f"padding of rank {q} (fp8={fp8})"
            if fp8:
                assert (sc.reshape(n, m, -1)[q][total:] == 0).all(), f"scales of rank {q}"
