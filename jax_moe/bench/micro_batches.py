"""Two micro-batches in one MoE layer (issue 26): micro-batch B's dispatch moves while A's experts run, and A's combine
while B's experts run (DualPipe's overlap, pplx-garden's one context per micro-batch), against the same work one
micro-batch after the other. Part of `python -m jax_moe.bench overlap --micro-batches`.

Each rank's tokens are split into micro-batches A and B. Per rank, three programs, timed by stamps inside them (the
slowest rank per iteration, p50):
- comm:       dispatch then combine of A and of B, no expert work;
- sequential: A then B, each dispatch -> expert (two GEMMs over the received rows) -> combine;
- two:        dispatch A; send B's dispatch; A's expert; receive B; send A's combine; B's expert; receive A's
              combine; combine B. Each direction has one round open at a time, so any backend runs it;
- both open:  send A's and B's dispatch; receive A; A's expert; send A's combine; receive B; B's expert; send B's
              combine; receive A's combine, then B's. Two rounds of each direction open at once (DualPipe's shape):
              where the backend holds two (`rounds_in_flight`: "cuda", "cpu", and "xla", which holds no buffers).
Hidden fraction = (sequential - two, or - both open) / (what could hide: B's dispatch and A's combine, half of comm).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.types import CombineHandle, DispatchHandle


def _with_first_leaf(handle, fn: Callable):
    """The backend handle with its first leaf (what the send wrote: its ticket) replaced by fn(leaf)."""
    leaves, tree = jax.tree_util.tree_flatten(handle)
    leaves[0] = fn(leaves[0])
    return jax.tree_util.tree_unflatten(tree, leaves)


def bodies(comm, stamp, width: int):
    """The per-rank bodies (comm, sequential, two, both open): each returns (its start and end stamps, x as its start
    stamp passed x on: the next round's x, see overlap.rounds). width: the experts' inner width F (two GEMMs
    [rows, hidden] x [hidden, F] x [F, hidden])."""

    def after(h, dep: jax.Array):
        """Send handle `h` (a DispatchHandle or CombineHandle) whose receive waits for `dep`: a stamp orders them (XLA
        drops optimization barriers before it schedules)."""
        inner = _with_first_leaf(h._handle, lambda v: stamp(v, dep)[0])
        if isinstance(h, DispatchHandle):
            return DispatchHandle(h._x, h._x_scale, h._topk_idx, inner, h._comm_id, h._topk_weights)
        return CombineHandle(h._expert_y, h._dispatched, inner, h._comm_id, h._reduced)

    def expert(rows: jax.Array, dep: jax.Array) -> jax.Array:
        h = rows.astype(jnp.bfloat16)
        w1 = jnp.full((h.shape[1], width), 0.01, jnp.bfloat16) * dep.reshape(-1)[:1].astype(jnp.bfloat16)
        w2 = jnp.full((width, h.shape[1]), 0.01, jnp.bfloat16)
        g = jnp.dot(h, w1, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return jnp.dot(g, w2, preferred_element_type=jnp.float32).astype(comm.cfg.combine_dtype)

    def halves(x, xs, idx, w):
        t = x.shape[0] // 2
        cut = lambda a, i: None if a is None else a[i * t:(i + 1) * t]  # noqa: E731
        return [(cut(x, i), cut(xs, i), cut(idx, i), cut(w, i)) for i in (0, 1)]

    def one_after_other(work: Callable) -> Callable:
        """A then B, each dispatch -> work(rows, its tokens) -> combine."""

        def body(x, xs, idx, w):
            x, t0 = stamp(x, idx)  # not (x, x): XLA would copy x to stamp it (programs.py)
            outs = []
            for mx, ms, mi, mw in halves(x, xs, idx, w):
                d = comm.dispatch(mx, mi, x_scale=ms, topk_weights=mw)
                outs.append(comm.combine(work(d.expert_x, mx), None, d))
            out, t1 = stamp(outs[1], outs[0])
            return jnp.stack([t0, t1])[None], x

        return body

    comm_body = one_after_other(lambda rows, _: rows.astype(comm.cfg.combine_dtype))
    sequential_body = one_after_other(expert)

    def two_body(x, xs, idx, w):
        x, t0 = stamp(x, idx)
        (ax, as_, ai, aw), (bx, bs, bi, bw) = halves(x, xs, idx, w)
        da = comm.dispatch(ax, ai, x_scale=as_, topk_weights=aw)
        hb = comm.dispatch_send(bx, bi, x_scale=bs, topk_weights=bw)
        # A's expert starts once B's send is out, and B's receive waits for it (stamps order them).
        rows_a, _ = stamp(da.expert_x, jax.tree_util.tree_leaves(hb._handle)[0])
        ya = expert(rows_a, ax)
        db = comm.dispatch_recv(after(hb, ya))
        ca = comm.combine_send(ya, da)
        rows_b, _ = stamp(db.expert_x, jax.tree_util.tree_leaves(ca._handle)[0])
        yb = expert(rows_b, bx)
        oa = comm.combine_recv(after(ca, yb))
        ob = comm.combine(yb, None, db)
        out, t1 = stamp(ob, oa)
        return jnp.stack([t0, t1])[None], x

    def both_open_body(x, xs, idx, w):
        x, t0 = stamp(x, idx)
        (ax, as_, ai, aw), (bx, bs, bi, bw) = halves(x, xs, idx, w)
        ha = comm.dispatch_send(ax, ai, x_scale=as_, topk_weights=aw)
        hb = comm.dispatch_send(bx, bi, x_scale=bs, topk_weights=bw)
        da = comm.dispatch_recv(ha)
        ya = expert(da.expert_x, ax)  # B's rows travel meanwhile
        ca = comm.combine_send(ya, da)
        db = comm.dispatch_recv(after(hb, ya))  # B's receive waits for A's expert
        yb = expert(db.expert_x, bx)  # A's combined rows travel meanwhile
        cb = comm.combine_send(yb, db)
        oa = comm.combine_recv(after(ca, yb))  # A's combine receive waits for B's expert
        ob = comm.combine_recv(cb)
        out, t1 = stamp(ob, oa)
        return jnp.stack([t0, t1])[None], x

    return comm_body, sequential_body, two_body, both_open_body


def measure(comm, mesh, inputs, iters: int, warmup: int, gpu: bool, run: Callable, stamp: Callable) -> dict:
    """The programs' p50s and their hidden fractions; the experts' width makes one micro-batch's expert about as
    long as its share of the communication (what it has to hide)."""
    comm_body = bodies(comm, stamp, 128)[0]
    t_comm = float(np.median(run(comm_body, mesh, inputs, iters, warmup, gpu)[:, 0]))
    probe = 1024
    seq_probe = float(np.median(run(bodies(comm, stamp, probe)[1], mesh, inputs, max(5, iters // 4), warmup,
                                    gpu)[:, 0]))
    expert_probe = max(seq_probe - t_comm, 1e-3) / 2  # one micro-batch's expert at the probe width
    width = int(np.clip(round(probe * (t_comm / 4) / expert_probe / 128) * 128, 128, 1 << 16))
    _, sequential_body, two_body, both_open_body = bodies(comm, stamp, width)
    t_seq = float(np.median(run(sequential_body, mesh, inputs, iters, warmup, gpu)[:, 0]))
    t_two = float(np.median(run(two_body, mesh, inputs, iters, warmup, gpu)[:, 0]))
    t_both = None
    held = comm.backend.rounds_in_flight
    if held is None or held >= 2:  # None: the backend holds no per-round buffers (xla)
        t_both = float(np.median(run(both_open_body, mesh, inputs, iters, warmup, gpu)[:, 0]))
    hideable = t_comm / 2  # B's dispatch and A's combine

    def hidden(t):
        return None if t is None or hideable <= 0 else (t_seq - t) / hideable

    return {"comm_us": t_comm, "sequential_us": t_seq, "two_us": t_two, "both_open_us": t_both,
            "expert_width": width, "hidden_fraction": hidden(t_two), "both_open_hidden_fraction": hidden(t_both)}
