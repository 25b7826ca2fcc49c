"""The timed programs of `python -m jax_moe.bench moe` (and of `bench overlap`): random inputs, one iteration per
backend (the jax_moe API, or MaxText's ragged all-to-all), stamped for device-side timing, and the runs that time
them (on GPUs by %globaltimer stamps, on CPUs by the host clock)."""
from __future__ import annotations

import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe import multihost, payload
from jax_moe.backends import cpu as cpu_backend
from jax_moe.backends import cuda as cuda_backend
from jax_moe.types import CombineHandle, DispatchHandle


def make_inputs(rng, n, t, hidden, e, r, fp8):
    idx = np.stack([rng.permutation(e)[:r] for _ in range(n * t)]).astype(np.int32)  # uniform top-k, none masked
    x = rng.standard_normal((n * t, hidden)).astype(np.float32)
    w = rng.random((n * t, r)).astype(np.float32)
    if fp8:
        q, s = jax_moe.quantize_fp8(jnp.asarray(x))
        return np.asarray(q), np.asarray(s), idx, w
    return np.asarray(x.astype(jnp.bfloat16)), None, idx, w


def count_remote_tokens(idx, n, t, l):
    """Mean over ranks of the (token, other rank) pairs: what a backend that moves each token once per rank sends."""
    per = idx.reshape(n, t, -1)
    out = []
    for s in range(n):
        ranks = np.where(per[s] >= 0, per[s] // l, -1)
        out.append(sum(len(set(row[(row >= 0) & (row != s)].tolist())) for row in ranks))
    return float(np.mean(out))


def count_remote_rows(idx, n, t, l):
    """Mean over ranks of the (token, k) rows each rank sends to other ranks."""
    per = idx.reshape(n, t, -1)
    return float(np.mean([np.sum((per[s] // l != s) & (per[s] >= 0)) for s in range(n)]))


# --- device-side stamps --------------------------------------------------------------------------------------------
# A stamp passes its first operand through in place and waits for both. Its second operand (`dep`) must not be the
# first: XLA cannot write a buffer in place while the same call reads it, so it copies it first, between the work and
# the stamp, that is inside the timed window (seen in the compiled programs; a few MB at decode). To wait only for
# `a`, pass an earlier stamp's time as `dep`.
def _stamp_tree(tree, stamp):
    """Stamps after the first leaf of `tree` (with its last leaf as dependency); returns (tree', t)."""
    leaves, tdef = jax.tree_util.tree_flatten(tree)
    leaves[0], t = stamp(leaves[0], leaves[-1])
    return jax.tree_util.tree_unflatten(tdef, leaves), t


def _api_iteration(comm, stamp, x, xs, idx, w, dep, split=True, weights_at_dispatch=True):
    """One dispatch + combine through the jax_moe API with 6 stamps: [start, send, recv, (expert), send, recv]:
    (output, stamps, x as the start stamp passed it on). Give the next iteration that x, not the program's own: the
    start stamp passes x on in place, and XLA copies a buffer that a later call still reads before it lets a call
    write it in place (a copy of x per iteration). The compiled GPU programs placed those copies between kept stamps,
    in the window from one iteration's last stamp to the next one's start stamp: one that window_copies flags, but
    that no operation's time includes (the EP1 floors did not move once the copies were gone).

    weights_at_dispatch: the router weights go with dispatch (the expert ranks may sum a token's rows), else to
    combine (rows per (t, k)).

    split=False calls the one-shot `comm.dispatch` and `comm.combine` with no stamps between the halves (their slots
    repeat the one before): the totals are what a caller of those sees ("cuda" runs each as one custom call)."""
    x, t0 = stamp(x, dep)
    wd, wc = (w, None) if weights_at_dispatch else (None, w)
    if not split:
        d = comm.dispatch(x, idx, x_scale=xs, topk_weights=wd)
        ex, t2 = stamp(d.expert_x, d.expert_counts)
        # the experts' stand-in: fp8 -> bf16, not timed. dep t2, not ex: with bf16 in, y is ex (programs.py on stamps)
        y, t3 = stamp(ex.astype(comm.cfg.combine_dtype), t2)
        out, t5 = stamp(comm.combine(y, wc, d), y)
        return out, jnp.concatenate([t0, t0, t2, t3, t3, t5]), x
    h = comm.dispatch_send(x, idx, x_scale=xs, topk_weights=wd)
    handle, t1 = _stamp_tree(h._handle, stamp)
    d = comm.dispatch_recv(DispatchHandle(h._x, h._x_scale, h._topk_idx, handle, h._comm_id, h._topk_weights))
    ex, t2 = stamp(d.expert_x, d.expert_counts)
    y = ex.astype(comm.cfg.combine_dtype)  # the experts' stand-in: fp8 -> bf16, not timed
    y, t3 = stamp(y, t2)
    c = comm.combine_send(y, d)
    chandle, t4 = _stamp_tree(c._handle, stamp)
    out = comm.combine_recv(CombineHandle(c._expert_y, c._dispatched, chandle, c._comm_id, c._reduced), wc)
    out, t5 = stamp(out, t4)
    return out, jnp.concatenate([t0, t1, t2, t3, t4, t5]), x


def _ragged_iteration(n, l, axis, stamp, x, xs, idx, w, dep):
    """MaxText's EP path (src/maxtext/layers/moe.py): sort by expert, ragged_all_to_all, local permute, and back.
    Returns as _api_iteration."""
    t, r = idx.shape
    e = n * l
    me = jax.lax.axis_index(axis)
    x, t0 = stamp(x, dep)
    rows = payload.pack_rows(x, xs)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_rows = jnp.take(rows, order // r, axis=0)
    group = jnp.bincount(flat, length=e).astype(jnp.int32)
    send_sizes = group.reshape(n, l).sum(1)
    all_sizes = jax.lax.all_gather(send_sizes, axis)                    # [src, dst]
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    output_offsets = (jnp.cumsum(all_sizes, axis=0) - all_sizes)[me]   # where my rows start on each receiver
    recv_sizes = all_sizes[:, me]
    m = n * t * r
    buf = jax.lax.ragged_all_to_all(sorted_rows, jnp.zeros((m, rows.shape[1]), rows.dtype), input_offsets,
                                    send_sizes, output_offsets, recv_sizes, axis_name=axis)
    all_groups = jax.lax.all_gather(group, axis).reshape(n, n, l)[:, me]  # [src, local expert]
    ids = jnp.repeat(jnp.tile(jnp.arange(l), n), all_groups.reshape(-1), total_repeat_length=m)
    valid = jnp.arange(m) < jnp.sum(recv_sizes)
    perm = jnp.argsort(jnp.where(valid, ids, l), stable=True)
    expert_rows = jnp.take(buf, perm, axis=0)
    ex, sc = payload.unpack_rows(expert_rows, x.dtype, x.shape[1], 0 if xs is None else xs.shape[1])
    ex, t2 = stamp(ex, t0 if sc is None else sc)
    y = ex.astype(jnp.bfloat16)
    y, t3 = stamp(y, t2)
    back = jnp.zeros_like(y).at[perm].set(y)
    back_sizes = recv_sizes
    back_in = jnp.cumsum(back_sizes) - back_sizes
    back_out = (jnp.cumsum(all_sizes, axis=1) - all_sizes)[:, me]       # where each source expects my rows
    ret = jax.lax.ragged_all_to_all(back, jnp.zeros((t * r, y.shape[1]), y.dtype), back_in, back_sizes,
                                    back_out, send_sizes, axis_name=axis)
    entries = jnp.zeros_like(ret).at[order].set(ret).reshape(t, r, -1).astype(jnp.float32)
    out = jnp.einsum("trh,tr->th", entries, w).astype(jnp.bfloat16)
    out, t5 = stamp(out, t3)
    return out, jnp.concatenate([t0, t0, t2, t3, t3, t5]), x


def busy(x):
    """~10 ms of matrix products that the first iteration waits for: the host enqueues the unrolled iterations
    meanwhile, so the stamps measure the GPU, not the rate at which XLA launches kernels."""
    a = jnp.full((8192, 8192), 1e-3, jnp.bfloat16) * x.reshape(-1)[0].astype(jnp.bfloat16)
    for _ in range(8):
        a = (a @ a) * jnp.bfloat16(1e-3)
    return jnp.sum(a[:1, :1]).astype(jnp.float32)


def program(body, mesh, inputs, out_specs=None, place=jax.device_put):
    """`body(x, xs, idx, w)` per rank, jitted over `mesh`'s axis and compiled for the inputs placed for it: (f, args),
    f(*args) runs it. Warns where XLA put a copy inside a timed window (window_copies)."""
    axis = mesh.axis_names[0]
    x, xs, idx, w = inputs
    specs = (P(axis), None if xs is None else P(axis), P(axis), P(axis))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(axis) if out_specs is None else out_specs,
                              check_vma=False))
    sh = NamedSharding(mesh, P(axis))
    args = [None if a is None else place(a, sh) for a in (x, xs, idx, w)]
    compiled = f.lower(*args).compile()
    copies = window_copies(compiled.as_text())
    if copies:
        print(f"[bench] warning: the compiled program copies {len(copies)} buffer(s) between its first and last stamp, "
              f"inside a timed window: {'; '.join(copies[:4])}", file=sys.stderr, flush=True)
    return compiled, args


def window_copies(hlo: str) -> list[str]:
    """The copies in a compiled program's entry computation (its schedule, in order) between two stamps
    (jax_moe_*_timestamp) whose times the program keeps, with no other stamp between them: each runs inside a timed
    window and adds its bytes' time to it. A stamp whose time is dropped (a tie between rounds, overlap.rounds) ends
    the window before it; a copy beside it is outside. Each as "<copy> (window k)": after the k-th kept stamp, from 1.
    Stamps per `bench moe` iteration: 6 on the split-API path (window 6j + 1 is iteration j's dispatch_send, ..., 6j + 6
    the stretch to the next iteration's start); 4 where there is no split (split=False, xla-ragged: start, after
    dispatch, after the experts' stand-in, after combine; window 4j + 4 the stretch to the next start).
    [] where there are none."""
    at = hlo.find("\nENTRY")
    if at < 0:
        return []
    entry = hlo[at + 1:]
    entry = entry[: entry.find("\n}") if "\n}" in entry else len(entry)]
    found, pending, open_, kept_count = [], [], False, 0
    for line in entry.splitlines():
        stamp = re.search(r'%(\S+) = .*custom_call_target="jax_moe_\w+_timestamp"', line)
        if stamp:
            kept = re.search(rf"get-tuple-element\(%{re.escape(stamp.group(1))}\), index=1", entry)
            if kept and open_:
                found += [f"{c} (window {kept_count})" for c in pending]
            pending, open_ = [], bool(kept)
            kept_count += bool(kept)
        elif open_ and re.search(r"\s(copy|copy-start)\(", line):
            pending.append(line.split(" copy")[0].strip())
    return found


def iterations(kind: str, comm_or_none, n: int, l: int, axis: str, stamp, x, xs, idx, w, dep, unroll: int,
               split: bool = True) -> list[jax.Array]:
    """`unroll` iterations of backend `kind`, each starting once the one before has ended (the first once `dep`
    exists); x passes from each start stamp to the next iteration (see _api_iteration). Returns their stamps. gpu_run's
    loop, here so that tests/test_bench.py compiles the same loop with the CPU stamp."""
    out, stamps = dep, []
    for _ in range(unroll):
        if kind == "xla-ragged":
            out, s, x = _ragged_iteration(n, l, axis, stamp, x, xs, idx, w, out)
        else:
            out, s, x = _api_iteration(comm_or_none, stamp, x, xs, idx, w, out, split,
                                       weights_at_dispatch=not kind.endswith("-entry"))
        stamps.append(s)
    return stamps


def gpu_run(kind, comm_or_none, mesh, n, l, inputs, iters, unroll, warmup, split=True):
    timestamp = cuda_backend.timestamp
    axis = mesh.axis_names[0]

    def body(x, xs, idx, w):
        return jnp.stack(iterations(kind, comm_or_none, n, l, axis, timestamp, x, xs, idx, w, busy(x), unroll,
                                    split))[None]

    f, args = program(body, mesh, inputs, place=multihost.place)
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    chunks = []
    for _ in range(max(1, math.ceil(iters / unroll))):
        chunks.append(f(*args))
    stamps = np.concatenate([multihost.gather(c).astype(np.int64) for c in chunks], axis=1)  # [n, iters, 6]
    d = np.diff(stamps, axis=-1) / 1e3  # us: send, recv, expert stand-in, send, recv
    per = {"dispatch_send": d[..., 0], "dispatch_recv": d[..., 1], "combine_send": d[..., 3],
           "combine_recv": d[..., 4]}
    per["dispatch"] = per["dispatch_send"] + per["dispatch_recv"]
    per["combine"] = per["combine_send"] + per["combine_recv"]
    if kind == "xla-ragged" or not split:  # no split into halves there
        for k in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
            per[k] = np.full_like(per[k], np.nan)
    # The slowest rank sets the pace of a collective step: take the max over ranks per iteration.
    out = {k: v.max(axis=0) for k, v in per.items()}
    out["per_rank_p50"] = {k: [float(np.nanmedian(v[q])) if np.isfinite(v[q]).any() else None for q in range(n)]
                           for k, v in per.items()}
    out["stamps"] = stamps  # [ranks, iters, 6] ns: diagnostics.stamp_gaps matches them with the device trace
    return out


def cpu_run(comm, mesh, inputs, iters, warmup, weights_at_dispatch=True):
    """Host-clock stamps between the halves (the same chain as on GPU, one iteration per program)."""
    timestamp = cpu_backend.timestamp
    axis = mesh.axis_names[0]

    def body(x, xs, idx, w):
        words = []

        def stamp32(a, dep):
            a, t = timestamp(a, dep)
            words.append(t)
            return a, jnp.zeros((1,), jnp.float32)

        out, _, _ = _api_iteration(comm, stamp32, x, xs, idx, w, x, weights_at_dispatch=weights_at_dispatch)
        return out, jnp.stack(words)[None]

    f, args = program(body, mesh, inputs, out_specs=(P(axis), P(axis)), place=multihost.place)
    for _ in range(warmup + 1):
        jax.block_until_ready(f(*args))
    runs = [f(*args)[1] for _ in range(iters)]
    runs = [multihost.gather(r) for r in runs]  # [iters][n, 6, 2] uint32, every process's ranks (--processes)
    ns = np.stack(runs, axis=1).astype(np.int64)
    ns = ns[..., 0] | (ns[..., 1] << 32)  # [n, iters, 6]
    d = np.diff(ns, axis=-1) / 1e3  # us: send, recv, expert stand-in, send, recv
    per = {"dispatch_send": d[..., 0], "dispatch_recv": d[..., 1], "combine_send": d[..., 3],
           "combine_recv": d[..., 4]}
    per["dispatch"] = per["dispatch_send"] + per["dispatch_recv"]
    per["combine"] = per["combine_send"] + per["combine_recv"]
    return {k: v.max(axis=0) for k, v in per.items()}  # the slowest rank sets the pace
