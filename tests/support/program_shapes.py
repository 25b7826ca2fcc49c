"""Programs that run many rounds of one Communicator, and their checks against the NumPy oracle.

Shared by tests/test_program_shapes.py (one process) and tests/support/mp_worker.py (several processes, "cpu" and "cuda").
Each round has its own random tokens and routing, so a round delivered into the wrong program slot shows up.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from support.grads import dense_loss, local_expert_of_rows
from support.helpers import check_roundtrip, expert_fn, random_routing, random_tokens, received


def rounds_problem(rng, rounds: int, n: int, t: int, r: int, e: int, hidden: int, fp8: bool):
    """Stacked per-round inputs: x [rounds, n*t, hidden], scale or None, idx [rounds, n*t, r], w [rounds, n*t, r]."""
    xs, scales = zip(*(random_tokens(rng, n * t, hidden, fp8) for _ in range(rounds)))
    idx = np.stack([random_routing(rng, n, t, r, e, mask=0.2, skew=i % 3 == 2) for i in range(rounds)])
    w = rng.random((rounds, n * t, r)).astype(np.float32)
    return np.stack(xs), (np.stack(scales) if fp8 else None), idx, w


def rounds_program(comm: jax_moe.Communicator, rounds: int, split: bool, fp8: bool, in_flight: int = 1):
    """jit(shard_map) of a Python loop over `rounds` dispatch -> experts -> combine rounds of one Communicator; split:
    the four halves with independent work between them, else dispatch / combine. in_flight > 1 (split only): rounds go
    in groups of that many, each group's sends before its receives (micro-batches in flight: a round read from
    another's buffer shows, since every round has its own tokens and routing). Returns every round's results."""
    axis = comm.axis_name

    def body(x, scale, idx, w):
        outs = []
        step = in_flight if split else 1
        for g in range(0, rounds, step):
            group = range(g, min(rounds, g + step))
            ds = []
            if split:
                hs = [comm.dispatch_send(x[i], idx[i], x_scale=None if scale is None else scale[i]) for i in group]
                busy = jnp.tanh(x[g].astype(jnp.float32)).sum()  # work between the halves
                ds = [comm.dispatch_recv(h) for h in hs]
                cs = [comm.combine_send(expert_fn(d.expert_x, d.expert_counts, comm), d) for d in ds]
                group_out = [comm.combine_recv(c, w[i] + 0 * busy) for i, c in zip(group, cs)]
            else:
                (i,) = group
                d = comm.dispatch(x[i], idx[i], x_scale=None if scale is None else scale[i])
                ds, group_out = [d], [comm.combine(expert_fn(d.expert_x, d.expert_counts, comm), w[i], d)]
            for d, out in zip(ds, group_out):
                xs = jnp.zeros((d.expert_x.shape[0], 0), jnp.float32) if d.expert_x_scale is None else d.expert_x_scale
                outs.append((d.expert_x, xs, d.expert_counts, out))
        return tuple(jnp.stack(o) for o in zip(*outs))

    spec = P(None, axis)
    return jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(spec, None if not fp8 else spec, spec, spec),
                                 out_specs=spec))


def check_rounds(comm, n: int, problem, got) -> None:
    x, scale, idx, w = problem
    expert_x, expert_scale, counts, out = got
    for i in range(x.shape[0]):
        check_roundtrip(comm, n, x[i], idx[i], w[i], None if scale is None else scale[i],
                        (expert_x[i], None if scale is None else expert_scale[i], counts[i], out[i]))


def place(mesh, *arrays, axis: int = 1):
    """Arrays split over the mesh's first axis along `axis` (micro-batch / round stacks keep axis 0 whole)."""
    spec = P(*([None] * axis), mesh.axis_names[0])
    sh = NamedSharding(mesh, spec)
    return [None if a is None else jax.make_array_from_callback(a.shape, sh, lambda i, a=a: a[i]) for a in arrays]


def accumulation_problem(rng, micro: int, n: int, t: int, r: int, e: int, hidden: int):
    """Gradient accumulation: micro-batches of tokens through one shared layer (experts a, b)."""
    x = rng.standard_normal((micro, n * t, hidden)).astype(jnp.bfloat16)
    idx = np.stack([random_routing(rng, n, t, r, e, mask=0.2) for _ in range(micro)])
    w = rng.random((micro, n * t, r)).astype(np.float32)
    a = (1 + 0.5 * rng.standard_normal((e, hidden))).astype(np.float32)
    b = (0.1 * rng.standard_normal((e, hidden))).astype(np.float32)
    g = rng.standard_normal((micro, n * t, hidden)).astype(np.float32)
    return x, idx, w, a, b, g


def accumulation_program(comm: jax_moe.Communicator, micro: int):
    """d loss / d (x, w, a, b) with loss = sum over micro-batches, each its own shard_map call (its own traced body)
    sharing one Communicator and layer: forward rounds of all micro-batches, then their backward rounds."""
    axis = comm.axis_name

    def one(x, idx, w, a, b, g):
        d = comm.dispatch(x, idx)
        l = comm.num_local_experts
        e = local_expert_of_rows(d.expert_counts, d.expert_x.shape[0]) + jax.lax.axis_index(axis) * l
        xe = received(d)[0].astype(jnp.float32)  # padding is unspecified: masked at the expert's input
        y = (xe * a[e] + b[e]).astype(jnp.bfloat16)
        return jax.lax.psum(jnp.sum(comm.combine(y, w, d).astype(jnp.float32) * g), axis)

    rank = jax.shard_map(one, mesh=comm.mesh, in_specs=(P(axis), P(axis), P(axis), P(), P(), P(axis)),
                         out_specs=P())

    def loss(x, idx, w, a, b, g):
        return sum(rank(x[i], idx[i], w[i], a, b, g[i]) for i in range(micro))

    return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))


def check_accumulation(problem, got, num_experts: int) -> None:
    x, idx, w, a, b, g = problem

    def dense(x, w, a, b):
        return sum(dense_loss(x[i], idx[i], w[i], a, b, g[i], num_experts) for i in range(x.shape[0]))

    want = jax.grad(dense, argnums=(0, 1, 2, 3))(jnp.asarray(x), w, a, b)
    for name, gv, wv in zip(("x", "topk_weights", "a", "b"), got, want):
        gv, wv = np.asarray(gv, np.float32), np.asarray(wv, np.float32)
        assert gv.shape == wv.shape, name
        np.testing.assert_allclose(gv, wv, rtol=2e-2, atol=2e-2 * (np.abs(wv).max() + 1e-6),
                                   err_msg=f"d loss / d {name}")


def run_all(comm: jax_moe.Communicator, rng, rounds: int, fp8: bool, gather=np.asarray,
            micro: Optional[int] = None) -> None:
    """The checks of one Communicator: `rounds` rounds one-shot, split, and split with as many rounds in flight as
    the backend holds (up to 4; 2 where it has no limit), then (bf16) `micro` micro-batches."""
    n, cfg = comm.num_ranks, comm.cfg
    t = cfg.max_tokens
    in_flight = min(4, comm.backend.rounds_in_flight or 2, rounds)
    for split, group in ((False, 1), (True, 1)) + (((True, in_flight),) if in_flight > 1 else ()):
        problem = rounds_problem(rng, rounds, n, t, cfg.experts_per_token, cfg.num_experts, cfg.hidden, fp8)
        got = rounds_program(comm, rounds, split, fp8, group)(*place(comm.mesh, *problem))
        check_rounds(comm, n, problem, [gather(v) for v in got])
    if micro and not fp8:
        problem = accumulation_problem(rng, micro, n, t, cfg.experts_per_token, cfg.num_experts, cfg.hidden)
        x, idx, w, a, b, g = problem
        whole = NamedSharding(comm.mesh, P())
        args = (place(comm.mesh, x, idx, w) + [jax.make_array_from_callback(v.shape, whole, lambda i, v=v: v[i])
                                                for v in (a, b)] + place(comm.mesh, g))
        got = accumulation_program(comm, micro)(*args)
        check_accumulation(problem, [gather(v) for v in got], cfg.num_experts)
