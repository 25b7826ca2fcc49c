"""dispatch / combine and their send/recv halves, differentiable through jax.custom_vjp.

Gradients (bf16 dispatch): dispatch's backward is a combine with unit weights; combine's backward is a per-entry
dispatch of the weighted output gradient (for expert_y) and a per-entry combine of expert_y dotted with the output
gradient (for topk_weights). The custom_vjp sits on the recv halves; the send halves pass their differentiable input
through the handle (stop_gradient on what they move), so the split halves are differentiable too.

Router weights given to dispatch travel with the tokens, so that combine_send may weight and sum a token's rows on each
expert rank (one row per (token, rank) comes back instead of one per (token, k)). The custom_vjp still takes those
weights as its differentiable input (the user's array, through the handles), so their gradient is the same.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_moe import rounds, validate
from jax_moe.contract import valid_entries, varying
from jax_moe.types import CombineHandle, Dispatched, DispatchHandle
from jax_moe.backends.base import CommView


# The checkpoint names of what dispatch and combine return (jax.checkpoint_policies.save_only_these_names).
DISPATCH_NAME = "jax_moe.dispatch"
COMBINE_NAME = "jax_moe.combine"


def _per_rank(comm: CommView, x: jax.Array) -> jax.Array:
    """Cotangents of per-rank inputs must vary over the Communicator's axes, like the inputs themselves."""
    return varying(x, frozenset(comm.axes))


# --- dispatch ---------------------------------------------------------------------------------------------------------
def dispatch_send(comm: CommView, x: jax.Array, topk_idx: jax.Array, x_scale: Optional[jax.Array] = None,
                  topk_weights: Optional[jax.Array] = None) -> DispatchHandle:
    """Start sending every token to the ranks of its experts; returns a handle for dispatch_recv.

    Per rank, inside jax.shard_map over the Communicator's axis:
      x [T, hidden] in dispatch_dtype (T <= max_tokens); x_scale [T, hidden // 128] float32 with fp8 dispatch
      (jax_moe.quantize_fp8 makes both); topk_idx [T, R] int32, -1 = masked;
      topk_weights [T, R] floating, optional: the router weights, sent along so that the expert ranks may sum a
      token's rows before sending them back (combine then needs no weights).
    Independent work placed between this and dispatch_recv overlaps the transfer."""
    return _dispatch_send(comm, x, topk_idx, x_scale, topk_weights, one_shot=False)[0]


def _dispatch_send(comm: CommView, x: jax.Array, topk_idx: jax.Array, x_scale: Optional[jax.Array],
                   topk_weights: Optional[jax.Array], one_shot: bool) -> tuple[DispatchHandle, bool]:
    """(handle, deferred). one_shot (`dispatch`): the backend may defer the send, so that its receive runs both halves
    as one call (no gap between two custom calls); a deferred round is never open between two calls."""
    call = "dispatch" if one_shot else "dispatch_send"  # errors name the call the user made
    validate.check_dispatch(comm, call, x, topk_idx, x_scale)
    if topk_weights is not None:
        validate.check_weights(comm, call, topk_weights, topk_idx)
    scale = None if x_scale is None else jax.lax.stop_gradient(x_scale)
    weights = None if topk_weights is None else jax.lax.stop_gradient(topk_weights)
    rounds.check_open(comm, "dispatch", call, one_shot=one_shot)
    args = (jax.lax.stop_gradient(x), scale, topk_idx)
    handle = comm.backend.defer_dispatch(*args, topk_weights=weights) if one_shot else None
    deferred = handle is not None
    if not deferred:
        handle = comm.backend.dispatch_send(*args, topk_weights=weights)
        rounds.opened(comm, "dispatch", handle, call)
    return DispatchHandle(x, x_scale, topk_idx, handle, comm.id, topk_weights), deferred


def dispatch_recv(comm: CommView, handle: DispatchHandle) -> Dispatched:
    """Finish the dispatch started by dispatch_send: returns a Dispatched (expert_x [max_recv_rows, hidden] grouped by
    local expert, then source rank, then token; expert_counts [L] rows per local expert; expert_x_scale with fp8).
    Rows past sum(expert_counts) are unspecified: mask them (jax.lax.ragged_dot does, or d.valid_rows())."""
    return _dispatch_receive(comm, handle, deferred=False)


def _dispatch_receive(comm: CommView, handle: DispatchHandle, deferred: bool,
                      call: str = "dispatch_recv") -> Dispatched:
    validate.check_axis(comm, call)
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"jax_moe.dispatch_recv: expected the handle from dispatch_send, got {type(handle).__name__}")
    validate.check_comm(comm, "dispatch_recv", handle._comm_id, "handle")
    if not deferred:
        rounds.closed(comm, "dispatch", handle._handle, "dispatch_recv")
    # x enters the custom_vjp per rank: an x the same on every rank (made inside the body) then gets the sum of the
    # ranks' cotangents from JAX's own transpose of the cast, where the bwd rule's per-rank cotangent would not type.
    expert_x, expert_x_scale, counts, route = _dispatch_recv(comm, _per_rank(comm, handle._x), handle._x_scale,
                                                             handle._topk_idx, handle._handle)
    # Names for remat policies (save_only_these_names(DISPATCH_NAME, COMBINE_NAME)).
    expert_x, expert_x_scale, counts = (None if v is None else checkpoint_name(v, DISPATCH_NAME)
                                        for v in (expert_x, expert_x_scale, counts))
    return Dispatched(expert_x, expert_x_scale, counts, handle._topk_idx, route, comm.id, handle._topk_weights)


def dispatch(comm: CommView, x: jax.Array, topk_idx: jax.Array, x_scale: Optional[jax.Array] = None,
             topk_weights: Optional[jax.Array] = None) -> Dispatched:
    """dispatch_send then dispatch_recv in one call (one custom call on the native backends): every token to the
    ranks of its experts. Arguments as dispatch_send, result as dispatch_recv."""
    handle, deferred = _dispatch_send(comm, x, topk_idx, x_scale, topk_weights, one_shot=True)
    return _dispatch_receive(comm, handle, deferred, "dispatch")


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_recv(comm, x, x_scale, topk_idx, handle):
    return comm.backend.dispatch_recv(handle)


def _dispatch_recv_fwd(comm, x, x_scale, topk_idx, handle):
    out = comm.backend.dispatch_recv(handle)
    return out, (topk_idx, out[3])


def _dispatch_recv_bwd(comm, residuals, cotangents):
    topk_idx, route = residuals
    g_expert_x = cotangents[0]
    if comm.cfg.is_fp8:
        raise NotImplementedError("jax_moe: gradients through dispatch need dispatch_dtype=bfloat16 "
                                  "(fp8 dispatch is inference-only)")
    g_x = comm.backend.dispatch_transpose(g_expert_x.astype(comm.cfg.combine_dtype), route, topk_idx)
    g_x = g_x.astype(comm.cfg.dispatch_dtype)
    return _per_rank(comm, g_x), None, None, None


_dispatch_recv.defvjp(_dispatch_recv_fwd, _dispatch_recv_bwd)


# --- combine ----------------------------------------------------------------------------------------------------------
def combine_send(comm: CommView, expert_y: jax.Array, d: Dispatched) -> CombineHandle:
    """Start returning expert outputs to the tokens' owners; returns a handle for combine_recv.

    expert_y [max_recv_rows, hidden] in combine_dtype, rows in d.expert_x's layout (the padding rows are ignored);
    d: the Dispatched of this round. If dispatch was given topk_weights, the expert ranks may sum a token's rows with
    them: combine_recv then uses those weights."""
    return _combine_send(comm, expert_y, d, reduced=_dispatched_weights(d) is not None, one_shot=False)[0]


def _dispatched_weights(d: Any) -> Optional[jax.Array]:
    """The weights given to d's dispatch (None: none, or d is no Dispatched: the send's checks refuse it)."""
    return getattr(d, "_topk_weights", None)


def _combine_send(comm: CommView, expert_y: jax.Array, d: Dispatched, reduced: bool,
                  one_shot: bool) -> tuple[CombineHandle, bool]:
    """(handle, deferred). reduced: the expert ranks may sum a token's rows with d's weights (False: one row per
    (token, k), the weights come to the receive). one_shot: the backend may defer the send to the receive, as
    _dispatch_send."""
    call = "combine" if one_shot else "combine_send"  # errors name the call the user made
    validate.check_expert_y(comm, call, expert_y, d)
    rounds.check_open(comm, "combine", call, one_shot=one_shot)
    args = (jax.lax.stop_gradient(expert_y), d._route, d._topk_idx)
    handle = comm.backend.defer_combine(*args, reduced=reduced) if one_shot else None
    deferred = handle is not None
    if not deferred:
        handle = comm.backend.combine_send(*args, reduced=reduced)
        rounds.opened(comm, "combine", handle, call)
    return CombineHandle(expert_y, d, handle, comm.id, reduced), deferred


def combine_recv(comm: CommView, handle: CombineHandle,
                 topk_weights: Optional[jax.Array] = None) -> jax.Array:
    """Finish the combine: returns out [T, hidden] in combine_dtype, out[t] = sum_k w[t, k] * y[row of (t, k)] over
    the unmasked k, summed in float32.

    topk_weights [T, R]: None to use the weights given to dispatch (or pass those same weights), else the weights to
    apply here (required when dispatch had none)."""
    return _combine_receive(comm, handle, topk_weights, deferred=False)


def _combine_receive(comm: CommView, handle: CombineHandle, topk_weights: Optional[jax.Array],
                     deferred: bool, call: str = "combine_recv") -> jax.Array:
    validate.check_axis(comm, call)
    if not isinstance(handle, CombineHandle):
        raise TypeError(f"jax_moe.combine_recv: expected the handle from combine_send, got {type(handle).__name__}")
    validate.check_comm(comm, "combine_recv", handle._comm_id, "handle")
    d = handle._dispatched
    validate.check_recv_weights(call, topk_weights, d, handle._reduced)
    # d's weights when reduced: the user's array, so that gradients reach what was given to dispatch.
    w = d._topk_weights if handle._reduced else topk_weights
    validate.check_weights(comm, call, w, d._topk_idx)
    if not deferred:
        rounds.closed(comm, "combine", handle._handle, "combine_recv")
    # Per rank, as dispatch's x: weights or outputs the same on every rank get the sum of the ranks' cotangents.
    return checkpoint_name(_combine_recv(comm, _per_rank(comm, handle._expert_y), _per_rank(comm, w), d._topk_idx,
                                         d._route, handle._handle), COMBINE_NAME)


def combine(comm: CommView, expert_y: jax.Array, topk_weights: Optional[jax.Array] = None,
            d: Optional[Dispatched] = None) -> jax.Array:
    """combine_send then combine_recv in one call: bring expert outputs back and sum them per token.

    expert_y as combine_send; topk_weights: None to use those given to dispatch, else the weights to apply (other
    weights than dispatch's are applied per (token, k) at the owner: correct, without the expert ranks' partial
    sums); d: the Dispatched of this round (required). Returns [T, hidden] in combine_dtype."""
    if d is None:
        raise TypeError("jax_moe.combine: d (the Dispatched returned by dispatch) is required")
    dispatched = _dispatched_weights(d)
    reduced = dispatched is not None and (topk_weights is None or topk_weights is dispatched)
    # Before anything is sent: a missing weight raises here, not after a send was traced.
    if isinstance(d, Dispatched):  # (anything else is refused by the send's checks, with its own message)
        validate.check_recv_weights("combine", topk_weights, d, reduced)
    handle, deferred = _combine_send(comm, expert_y, d, reduced=reduced, one_shot=True)
    return _combine_receive(comm, handle, topk_weights, deferred, "combine")


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_recv(comm, expert_y, topk_weights, topk_idx, route, handle):
    return comm.backend.combine_recv(handle, topk_weights, topk_idx)


def _combine_recv_fwd(comm, expert_y, topk_weights, topk_idx, route, handle):
    out = comm.backend.combine_recv(handle, topk_weights, topk_idx)
    return out, (expert_y, topk_weights, topk_idx, route)


def _combine_recv_bwd(comm, residuals, g_out):
    expert_y, topk_weights, topk_idx, route = residuals
    valid = valid_entries(topk_idx, comm.cfg.num_experts)
    g = g_out.astype(jnp.float32)
    w = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
    rows = (w[:, :, None] * g[:, None, :]).astype(comm.cfg.combine_dtype)
    g_y = comm.backend.dispatch_entries(rows, route, topk_idx).astype(expert_y.dtype)
    y = comm.backend.combine_entries(expert_y, route, topk_idx).astype(jnp.float32)
    g_w = jnp.einsum("trh,th->tr", y, g, precision=jax.lax.Precision.HIGHEST)
    g_w = jnp.where(valid, g_w, 0.0).astype(topk_weights.dtype)
    return _per_rank(comm, g_y), _per_rank(comm, g_w), None, None, None


_combine_recv.defvjp(_combine_recv_fwd, _combine_recv_bwd)
