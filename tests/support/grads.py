"""Gradients of dispatch -> experts -> combine and their dense per-token reference (no communication): the problem,
the jitted MoE gradient and the check, shared by tests/test_grad.py, program_shapes.py and mp_worker.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from support.helpers import random_routing, received


def local_expert_of_rows(counts: jax.Array, rows: int) -> jax.Array:
    starts = jnp.cumsum(counts) - counts
    e = jnp.sum(jnp.arange(rows)[:, None] >= starts[None, :], axis=1) - 1
    return jnp.clip(e, 0, counts.shape[0] - 1)


def moe_layer(comm, split_halves: bool, weights_at_dispatch: bool = False):
    """layer(x, idx, w, a, b): dispatch -> per-expert affine map x * a[e] + b[e] -> combine, per rank.
    weights_at_dispatch: w goes to dispatch and combine gets None (its gradient flows back through d)."""

    def layer(x, idx, w, a, b):
        wd, wc = (w, None) if weights_at_dispatch else (None, w)
        if split_halves:
            d = comm.dispatch_recv(comm.dispatch_send(x, idx, topk_weights=wd))
        else:
            d = comm.dispatch(x, idx, topk_weights=wd)
        e = local_expert_of_rows(d.expert_counts, d.expert_x.shape[0])
        # Every row goes through the expert, so mask the padding (unspecified, possibly NaN) at the input: a NaN row
        # times its zero cotangent would reach the gradients of a and b.
        xe = received(d)[0].astype(jnp.float32)
        y = (xe * a[e] + b[e]).astype(jnp.bfloat16)
        return comm.combine_recv(comm.combine_send(y, d), wc) if split_halves else comm.combine(y, wc, d)

    return layer


def grad_program(comm, loss, in_specs, collective: bool):
    """jit(grad) over (x, topk_weights, a, b) of loss(x, idx, w, a, b, g) -> this rank's partial loss, summed over
    the ranks. collective=False: each rank's partial loss is pulled back on its own, with no all-reduce (for
    processes sharing a GPU, which NCCL refuses): the same gradients."""
    axis = comm.axis_name

    def body(*args):
        part = loss(*args)
        return jax.lax.psum(part, axis) if collective else part[None]

    f = jax.shard_map(body, mesh=comm.mesh, in_specs=in_specs, out_specs=P() if collective else P(axis))
    if collective:
        return jax.jit(jax.grad(f, argnums=(0, 2, 3, 4)))

    def pullback(x, idx, w, a, b, g):
        parts, vjp = jax.vjp(lambda x, w, a, b: f(x, idx, w, a, b, g), x, w, a, b)
        return vjp(jnp.ones_like(parts))

    return jax.jit(pullback)


def moe_loss_fn(comm, split_halves: bool, collective: bool = True, weights_at_dispatch: bool = False):
    """jit(grad) of the MoE loss over (x, topk_weights, a, b) (see grad_program for collective, moe_layer for
    weights_at_dispatch)."""
    layer = moe_layer(comm, split_halves, weights_at_dispatch)

    def loss(x, idx, w, a, b, g):
        return jnp.sum(layer(x, idx, w, a, b).astype(jnp.float32) * g)

    return grad_program(comm, loss, (P(comm.axis_name),) * 6, collective)


def dense_loss(x, idx, w, a, b, g, num_experts):
    valid = (idx >= 0) & (idx < num_experts)
    safe = jnp.where(valid, idx, 0)
    xf = x.astype(jnp.float32)[:, None, :]
    y = xf * a[safe] + b[safe]  # [T, R, H]
    out = jnp.sum(jnp.where(valid[..., None], w[..., None] * y, 0.0), axis=1)
    return jnp.sum(out * g)


def grad_problem(rng, n: int, t: int, r: int, e: int, hidden: int):
    """(x, topk_idx, topk_weights, a, b, g): the arguments of moe_loss_fn / dense_loss, some routing slots masked."""
    x = rng.standard_normal((n * t, hidden)).astype(jnp.bfloat16)
    idx = random_routing(rng, n, t, r, e, mask=0.2)
    w = rng.random((n * t, r)).astype(np.float32)
    a = (1 + 0.5 * rng.standard_normal((e, hidden))).astype(np.float32)
    b = (0.1 * rng.standard_normal((e, hidden))).astype(np.float32)
    g = rng.standard_normal((n * t, hidden)).astype(np.float32)
    return x, idx, w, a, b, g


def check_against(got, want, what: str, rtol: float = 2e-2) -> None:
    """Gradients (x, topk_weights, a, b) equal `want` within rtol (relative to each one's largest magnitude)."""
    for name, gv, wv in zip(("x", "topk_weights", "a", "b"), got, want):
        gv, wv = np.asarray(gv, np.float32), np.asarray(wv, np.float32)
        assert gv.shape == wv.shape, (what, name)
        scale = np.abs(wv).max() + 1e-6
        np.testing.assert_allclose(gv, wv, rtol=rtol, atol=rtol * scale, err_msg=f"{what}: d loss / d {name}")


def check_grads(got, problem, num_experts: int) -> None:
    """Gradients (x, topk_weights, a, b) of the MoE loss equal the dense reference; masked slots get no weight
    gradient."""
    x, idx, w, a, b, g = problem
    want = jax.grad(dense_loss, argnums=(0, 2, 3, 4))(jnp.asarray(x), idx, w, a, b, g, num_experts)
    check_against(got, want, "dense reference")
    assert np.all(np.asarray(got[1])[idx < 0] == 0)
