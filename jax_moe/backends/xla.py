"""Backend "xla": the pure-JAX reference, and the oracle for every other backend.

Each rank packs its (token, k) rows into a capacity-padded send buffer, one block of C rows per peer, sorted by
(local expert, token); one `all_to_all` moves the blocks and a second one the per-expert counts; the receiver then
places every row at its contract position (expert, source rank, source token). Combine runs the same maps backwards.
C = max_tokens * min(R, L) is the most rows one rank can send to one peer (a token's experts are distinct), so
N * C = max_recv_rows and nothing is ever dropped. Runs on every platform (XLA:CPU has no ragged_all_to_all).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_moe import payload
from jax_moe.backends.base import Backend
from jax_moe.contract import poison_padding, sanitize_topk


class XlaRoute(NamedTuple):
    # position[t*R + k]: the send-buffer row of (t, k), peer * C + the row of the peer's block it goes to; N*C if masked
    position: jax.Array  # [T*R] int32
    dest: jax.Array      # [N*C] int32: expert_x row of each received row; N*C when the row is empty


class XlaDispatchHandle(NamedTuple):
    recv: jax.Array         # [N*C, row_bytes] uint8, block s from source rank s
    recv_counts: jax.Array  # [N, L] int32, rows per (source rank, local expert)
    position: jax.Array     # [T*R] int32


class XlaCombineHandle(NamedTuple):
    ret: jax.Array       # [N*C, hidden] combine-dtype bits, back in this rank's send-buffer order
    position: jax.Array  # [T*R] int32


class XlaBackend(Backend):
    name = "xla"

    @property
    def _n(self) -> int:
        return self.comm.num_ranks

    @property
    def _l(self) -> int:
        return self.comm.num_local_experts

    @property
    def _c(self) -> int:
        return self.comm.rows_per_peer

    def _a2a(self, a: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(a, self.comm.axis_name, 0, 0, tiled=True)

    # --- routing --------------------------------------------------------------------------------------------------
    def _send_plan(self, topk_idx: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(position [T*R], send_counts [N, L]) for this rank's routing."""
        n, l, c = self._n, self._l, self._c
        e = n * l
        flat = sanitize_topk(topk_idx, e).reshape(-1)
        key = jnp.where(flat >= 0, flat, e)
        order = jnp.argsort(key, stable=True)  # by (peer, local expert), then token
        counts = jnp.bincount(key, length=e + 1).astype(jnp.int32)
        send_counts = counts[:e].reshape(n, l)
        peer_count = send_counts.sum(axis=1)
        peer_start = jnp.concatenate([jnp.cumsum(peer_count) - peer_count, jnp.sum(peer_count, keepdims=True)])
        sorted_key = key[order]
        peer = sorted_key // l  # == n for masked rows
        pos = jnp.arange(flat.shape[0], dtype=jnp.int32) - peer_start[peer]
        position_sorted = jnp.where(sorted_key < e, peer * c + pos, n * c).astype(jnp.int32)
        position = jnp.zeros_like(position_sorted).at[order].set(position_sorted)
        return position, send_counts

    def _dest(self, recv_counts: jax.Array) -> jax.Array:
        """[N*C] expert_x row of every received row (N*C for empty rows), from the counts every sender sent."""
        n, l, c = self._n, self._l, self._c
        block_end = jnp.cumsum(recv_counts, axis=1)             # [N, L] end of expert e in block s
        block_start = block_end - recv_counts
        j = jnp.arange(c, dtype=jnp.int32)
        expert = jax.vmap(lambda ends: jnp.searchsorted(ends, j, side="right"))(block_end)  # [N, C]
        valid = j[None, :] < block_end[:, -1:]
        expert = jnp.minimum(expert, l - 1)
        per_expert = recv_counts.sum(axis=0)
        expert_start = jnp.cumsum(per_expert) - per_expert       # [L]
        source_start = jnp.cumsum(recv_counts, axis=0) - recv_counts  # [N, L]
        s = jnp.arange(n)[:, None]
        dest = expert_start[expert] + source_start[s, expert] + j[None, :] - block_start[s, expert]
        return jnp.where(valid, dest, n * c).astype(jnp.int32).reshape(-1)

    def _route(self, topk_idx: jax.Array) -> XlaRoute:
        position, send_counts = self._send_plan(topk_idx)
        recv_counts = self._a2a(send_counts.reshape(-1)).reshape(self._n, self._l)
        return XlaRoute(position, self._dest(recv_counts))

    # --- moving rows ----------------------------------------------------------------------------------------------
    def _scatter_send(self, rows: jax.Array, position: jax.Array) -> jax.Array:
        """rows [T*R, B] -> received rows [N*C, B] (block s from source s)."""
        send = jnp.zeros((self._n * self._c, rows.shape[-1]), rows.dtype).at[position].set(rows, mode="drop")
        return self._a2a(send)

    def _place(self, recv: jax.Array, dest: jax.Array) -> jax.Array:
        m = self._n * self._c
        return jnp.zeros((m, recv.shape[-1]), recv.dtype).at[dest].set(recv, mode="drop", unique_indices=True)

    def _returned_rows(self, handle: XlaCombineHandle) -> jax.Array:
        """[T*R, H] combine-dtype bits: row (t, k) = the expert output sent back for it, or 0 when masked."""
        return jnp.take(handle.ret, handle.position, axis=0, mode="fill", fill_value=0)

    # --- the four halves ------------------------------------------------------------------------------------------
    # topk_weights and reduced are accepted and ignored: this backend always moves one row per (token, k).
    def dispatch_send(self, x, x_scale, topk_idx, topk_weights=None) -> XlaDispatchHandle:
        position, send_counts = self._send_plan(topk_idx)
        rows = jnp.repeat(payload.pack_rows(x, x_scale), topk_idx.shape[1], axis=0)  # row f = token f // R
        recv = self._scatter_send(rows, position)
        recv_counts = self._a2a(send_counts.reshape(-1)).reshape(self._n, self._l)
        return XlaDispatchHandle(recv, recv_counts, position)

    def dispatch_recv(self, handle: XlaDispatchHandle):
        dest = self._dest(handle.recv_counts)
        placed = self._place(handle.recv, dest)
        x, scale = payload.unpack_rows(placed, self.cfg.dispatch_dtype, self.cfg.hidden, self.cfg.num_scales)
        counts = handle.recv_counts.sum(axis=0)
        if poison_padding() and not self.cfg.zero_padding:  # padding is unspecified: tests fill it with NaN
            pad = (jnp.arange(x.shape[0]) >= jnp.sum(counts))[:, None]
            x = jnp.where(pad, jnp.asarray(jnp.nan, x.dtype), x)
            scale = None if scale is None else jnp.where(pad, jnp.nan, scale)
        return x, scale, counts, XlaRoute(handle.position, dest)

    def combine_send(self, expert_y, route: XlaRoute, topk_idx, reduced: bool = False) -> XlaCombineHandle:
        bits = jax.lax.bitcast_convert_type(expert_y, jnp.uint16)
        return XlaCombineHandle(self._a2a(jnp.take(bits, route.dest, axis=0, mode="fill", fill_value=0)),
                                route.position)

    def combine_recv(self, handle: XlaCombineHandle, topk_weights, topk_idx):
        t, r = topk_idx.shape
        bits = self._returned_rows(handle)
        y = jax.lax.bitcast_convert_type(bits, self.cfg.combine_dtype).astype(jnp.float32).reshape(t, r, -1)
        valid = (handle.position < self._n * self._c).reshape(topk_idx.shape)
        w = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
        return jnp.einsum("trh,tr->th", y, w, precision=jax.lax.Precision.HIGHEST).astype(self.cfg.combine_dtype)

    # --- per-entry variants (gradients); `route` may come from another backend, so recompute when it does ----------
    def dispatch_entries(self, rows, route: Optional[XlaRoute], topk_idx):
        route = route if isinstance(route, XlaRoute) else self._route(topk_idx)
        flat = payload.to_bytes(rows.reshape(-1, rows.shape[-1]))
        placed = self._place(self._scatter_send(flat, route.position), route.dest)
        return payload.from_bytes(placed, rows.dtype, rows.shape[-1])

    def combine_entries(self, expert_y, route: Optional[XlaRoute], topk_idx):
        route = route if isinstance(route, XlaRoute) else self._route(topk_idx)
        bits = self._returned_rows(self.combine_send(expert_y, route, topk_idx))
        return jax.lax.bitcast_convert_type(bits, expert_y.dtype).reshape(*topk_idx.shape, -1)
