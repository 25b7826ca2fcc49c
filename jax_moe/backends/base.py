"""The interface every backend implements: the four halves, per rank, inside shard_map.

The public API (jax_moe.api) validates inputs, wraps the halves in custom_vjp and builds the pytrees; a backend only
moves rows. A send half returns a *handle* (a pytree of arrays, the backend's own type) that its receive half
consumes. The two per-entry variants (one row per (token, k)) are used by the gradients.
"""
from __future__ import annotations

import abc
import weakref
from typing import Any, Optional, Protocol, Union

import jax
import jax.numpy as jnp

from jax_moe.config import MoEConfig


class CommView(Protocol):
    """What the API and the backends read of a Communicator (jax_moe.Communicator is one): its configuration, mesh and
    axes, rank counts, id and options. A type only, so that the layers below the Communicator never import it (data
    and imports flow one way: nn -> communicator -> api -> backends)."""

    cfg: MoEConfig
    mesh: Any
    axis_name: Union[str, tuple[str, ...]]
    axes: tuple[str, ...]
    num_ranks: int
    num_local_experts: int
    rows_per_peer: int
    id: int
    platform: str
    timeout_s: float
    fabric_provider: str
    fabric_memory: str
    ranks_per_node: Optional[int]
    backend: "Backend"

    @property
    def max_recv_rows(self) -> int: ...

    @property
    def backend_name(self) -> str: ...


class Backend(abc.ABC):
    name: str = "?"
    # Rounds of one direction that may be open (sent, not yet received) at once in program order; None: any number
    # (the backend holds no per-round buffers). jax_moe.rounds refuses programs that open more at trace time.
    rounds_in_flight: Optional[int] = None
    # Whether a receive takes the oldest open round of its direction (not the one its handle names): then
    # jax_moe.rounds refuses receives out of send order, and one-shot calls while a round is open.
    receives_in_order: bool = False

    def __init__(self, comm: CommView):
        # A proxy, not a reference: the Communicator owns its backend, and a cycle between them would keep the native
        # buffers alive until the cyclic garbage collector runs, instead of freeing them when the user drops it.
        self.comm = weakref.proxy(comm)
        self.cfg = comm.cfg

    # --- the four halves ------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def dispatch_send(self, x: jax.Array, x_scale: Optional[jax.Array], topk_idx: jax.Array,
                      topk_weights: Optional[jax.Array] = None) -> Any:
        """Start moving token rows to the experts' ranks; returns the handle dispatch_recv consumes. topk_weights
        [T, R] (or None): the router weights, for a backend that moves them with the rows (see combine_send)."""

    @abc.abstractmethod
    def dispatch_recv(self, handle: Any) -> tuple[jax.Array, Optional[jax.Array], jax.Array, Any]:
        """Finish the dispatch: (expert_x, expert_x_scale or None, expert_counts, route for combine)."""

    @abc.abstractmethod
    def combine_send(self, expert_y: jax.Array, route: Any, topk_idx: jax.Array, reduced: bool = False) -> Any:
        """Start moving expert output rows back to the tokens' owners; returns the handle combine_recv consumes.

        reduced: the weights combine_recv will get are the ones this round's dispatch_send got, so the backend may
        weight and sum a token's rows at the expert rank (one row per (token, rank) instead of per (token, k)).
        False: the weights are known only to combine_recv."""

    @abc.abstractmethod
    def combine_recv(self, handle: Any, topk_weights: jax.Array, topk_idx: jax.Array) -> jax.Array:
        """Finish the combine: [T, hidden] combine_dtype, the float32-accumulated weighted sum."""

    # --- one-shot calls ---------------------------------------------------------------------------------------------
    def defer_dispatch(self, x: jax.Array, x_scale: Optional[jax.Array], topk_idx: jax.Array,
                       topk_weights: Optional[jax.Array] = None) -> Any:
        """For `dispatch` (both halves at once): a handle that issues nothing yet, so that dispatch_recv runs both
        halves as one call; None (the default): the halves are called one after the other."""
        return None

    def defer_combine(self, expert_y: jax.Array, route: Any, topk_idx: jax.Array, reduced: bool = False) -> Any:
        """For `combine`: as defer_dispatch, for combine_recv."""
        return None

    # --- gradients ------------------------------------------------------------------------------------------------
    def dispatch_transpose(self, g_expert_x: jax.Array, route: Any, topk_idx: jax.Array) -> jax.Array:
        """The backward of dispatch: g_x[t] = sum over sent k of g_expert_x[row of (t, k)] ([T, hidden], float32 sum,
        combine_dtype). A combine with unit weights; backends whose forward and backward combines must not share
        state (XLA may interleave them) override this."""
        ones = jnp.ones(topk_idx.shape, jnp.float32)
        return self.combine_recv(self.combine_send(g_expert_x, route, topk_idx, reduced=False), ones, topk_idx)

    @abc.abstractmethod
    def dispatch_entries(self, rows: jax.Array, route: Any, topk_idx: jax.Array) -> jax.Array:
        """rows [T, R, hidden] (one row per (token, k)) -> [max_recv_rows, hidden] in the expert_x layout."""

    @abc.abstractmethod
    def combine_entries(self, expert_y: jax.Array, route: Any, topk_idx: jax.Array) -> jax.Array:
        """expert_y [max_recv_rows, hidden] -> [T, R, hidden], row (t, k) = expert_y[row of (t, k)], 0 if masked."""

    # --- what the Communicator reports ----------------------------------------------------------------------------
    def errors(self) -> list[str]:
        """Errors the backend could not raise from a call (read and cleared); none for a backend that raises them."""
        return []

    @property
    def bytes_allocated(self) -> int:
        """Bytes of native buffers this process holds for the Communicator (0: none)."""
        return 0
