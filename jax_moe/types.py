"""The pytrees that dispatch/combine hand back: Dispatched and the send-half handles.

Public fields are documented; fields starting with `_` are what the next half consumes (`_handle`: the backend's own
handle from its send half).
`comm_id` is static metadata so that a handle is never fed to another Communicator by mistake.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.tree_util import register_pytree_node_class


@register_pytree_node_class
class Dispatched:
    """Tokens as the experts of this rank see them.

    expert_x: [max_recv_rows, hidden] in dispatch_dtype. Rows are grouped by local expert (expert order), inside an
      expert by source rank, then source token index. Rows at or after sum(expert_counts) are padding, unspecified
      (possibly NaN) unless MoEConfig.zero_padding: mask by expert_counts (jax.lax.ragged_dot does; `valid_rows()`).
    expert_x_scale: [max_recv_rows, hidden // scale_block] float32 for fp8 dispatch, else None.
    expert_counts: [num_local_experts] int32.
    """

    def __init__(self, expert_x: jax.Array, expert_x_scale: Optional[jax.Array], expert_counts: jax.Array,
                 topk_idx: jax.Array, route: Any, comm_id: int, topk_weights: Optional[jax.Array] = None):
        self.expert_x = expert_x
        self.expert_x_scale = expert_x_scale
        self.expert_counts = expert_counts
        self._topk_idx = topk_idx  # the sender's routing, kept for combine and the gradients
        self._route = route        # backend-specific: where every row came from
        self._comm_id = comm_id
        # The weights given to dispatch (None: none): combine uses them, and gradients flow back to them through here.
        self._topk_weights = topk_weights

    def tree_flatten(self):
        return ((self.expert_x, self.expert_x_scale, self.expert_counts, self._topk_idx, self._route,
                 self._topk_weights), self._comm_id)

    @classmethod
    def tree_unflatten(cls, comm_id, children):
        *rest, topk_weights = children
        return cls(*rest, comm_id, topk_weights)

    def valid_rows(self) -> jax.Array:
        """[max_recv_rows] bool: the rows received (the others are padding). For experts that read every row: mask
        their input with it (`jnp.where(d.valid_rows()[:, None], d.expert_x, 0)`) so no padding value reaches a sum."""
        return jnp.arange(self.expert_x.shape[0]) < jnp.sum(self.expert_counts)

    def __repr__(self) -> str:
        return (f"Dispatched(expert_x={_shape(self.expert_x)}, expert_x_scale={_shape(self.expert_x_scale)}, "
                f"expert_counts={_shape(self.expert_counts)})")


@register_pytree_node_class
class DispatchHandle:
    """What dispatch_send returns and dispatch_recv consumes (the data dependency orders the halves)."""

    def __init__(self, x: jax.Array, x_scale: Optional[jax.Array], topk_idx: jax.Array, handle: Any, comm_id: int,
                 topk_weights: Optional[jax.Array] = None):
        self._x = x                # the input itself, so that gradients flow from dispatch_recv to x
        self._x_scale = x_scale
        self._topk_idx = topk_idx
        self._handle = handle      # the backend's dispatch_send handle
        self._comm_id = comm_id
        self._topk_weights = topk_weights  # the weights given to dispatch_send (the user's array), or None

    def tree_flatten(self):
        return (self._x, self._x_scale, self._topk_idx, self._handle, self._topk_weights), self._comm_id

    @classmethod
    def tree_unflatten(cls, comm_id, children):
        *rest, topk_weights = children
        return cls(*rest, comm_id, topk_weights)


@register_pytree_node_class
class CombineHandle:
    """What combine_send returns and combine_recv consumes.

    reduced: the backend was told it may weight and sum a token's rows at the expert ranks, with the weights that
    travelled with dispatch (dispatched._topk_weights); combine_recv then takes no other weights.
    """

    def __init__(self, expert_y: jax.Array, dispatched: Dispatched, handle: Any, comm_id: int, reduced: bool):
        self._expert_y = expert_y
        self._dispatched = dispatched
        self._handle = handle      # the backend's combine_send handle
        self._comm_id = comm_id
        self._reduced = reduced

    def tree_flatten(self):
        return (self._expert_y, self._dispatched, self._handle), (self._comm_id, self._reduced)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def _shape(a: Any) -> str:
    if a is None:
        return "None"
    return f"{a.dtype}{list(a.shape)}"
