"""Backend "cpu": the real dispatch/combine protocol on host memory, as XLA FFI custom calls for platform "cpu".

Ranks of one process exchange rows through shared memory; ranks of other processes through the TransferEngine
(libfabric tcp/shm). The C++ side (src/cpu, src/proxy) holds one CpuComm per Communicator and process; the set-up
exchanges engine addresses and buffer descriptors through jax.distributed (jax_moe.backends.bootstrap).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_moe.backends import bootstrap
from jax_moe.backends.native import NativeBackend

COMM_ID_BITS = 15  # the immediate carries the Communicator id in 15 bits (src/proxy/imm.h)


def timestamp(a: jax.Array, dep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(a, t): `a` passed through (aliased) and the host clock in ns as uint32 [low, high], taken once `a` and `dep`
    are ready. Feed the returned `a` to the next operation so that it runs after the stamp. Used by the benchmark."""
    return CpuBackend.stamp(a, dep, jax.ShapeDtypeStruct((2,), jnp.uint32))


class CpuBackend(NativeBackend):
    """Handles: (ticket int32 [2], position int32 [T*R]); route: (position, dest int32 [max_recv_rows])."""

    name = "cpu"
    native = "cpu"
    platforms = ("cpu",)
    ffi_platform = "cpu"
    uses_fabric = True
    rounds_in_flight = 4  # the receive lanes of src/cpu (CommOptions::lanes)
    id_limit = 1 << COMM_ID_BITS

    # --- set-up ---------------------------------------------------------------------------------------------------
    def _create(self) -> None:
        rows = [(e.device_id, e.process, e.group, e.rank) for e in self.table.entries]
        self._mod.create(self.native_id, self.options.shape(), rows, jax.process_index(), self.options.timeout_s,
                         self.options.fabric_provider)

    def _record(self) -> Any:
        return [[g, r, a.hex(), d.hex(), c.hex()] for g, r, a, d, c in self._mod.endpoints(self.native_id)]

    def _connect(self, peers: bootstrap.Peers) -> None:
        if peers.records:
            remote = [(g, r, bytes.fromhex(a), bytes.fromhex(d), bytes.fromhex(c))
                      for p in sorted(peers.records) for g, r, a, d, c in peers.records[p]]
            self._mod.connect(self.native_id, remote)
            bootstrap.barrier(self.options, "connected")
        self._mod.set_hosts(self.native_id, peers.hosts)

    @classmethod
    def _free(cls, native_id: int) -> None:
        cls.module().release(native_id)

    @property
    def bytes_allocated(self) -> int:
        """Host bytes of this process's receive and staging buffers."""
        return int(self._mod.bytes_allocated(self.native_id))

    # --- the four halves ------------------------------------------------------------------------------------------
    def _send(self, rows, x_scale, topk_idx, per_entry: bool):
        t, r = topk_idx.shape
        # No scales: one unread column (a zero-sized operand crashed Shardy on jax 0.11.2; see src/ffi/cpu_handlers.cc).
        scale = x_scale if x_scale is not None else jnp.zeros((rows.shape[0], 1), jnp.float32)
        position, ticket = self._call("dispatch_send", (jax.ShapeDtypeStruct((t * r,), jnp.int32),
                                                        jax.ShapeDtypeStruct((2,), jnp.int32)), rows, scale, topk_idx,
                                      per_entry=per_entry)
        return ticket, position

    def _recv(self, handle, topk_weights, topk_idx, reduce: bool):
        ticket, position = handle
        t, r = topk_idx.shape
        rows = t if reduce else t * r
        return self._call("combine_recv", jax.ShapeDtypeStruct((rows, self.cfg.hidden), self.cfg.combine_dtype),
                          ticket, topk_weights.astype(jnp.float32), position, reduce=reduce)

    # topk_weights and reduced are accepted and ignored: src/cpu moves one row per (token, k) and sums at the owner.
    def dispatch_send(self, x, x_scale, topk_idx, topk_weights=None):
        return self._send(x, x_scale, topk_idx, per_entry=False)

    def dispatch_recv(self, handle):
        ticket, position = handle
        cfg, m = self.cfg, self.comm.max_recv_rows
        expert_x, expert_x_scale, counts, dest = self._call(
            "dispatch_recv",
            (jax.ShapeDtypeStruct((m, cfg.hidden), cfg.dispatch_dtype),
             jax.ShapeDtypeStruct((m, max(1, cfg.num_scales)), jnp.float32),  # one unread column without scales
             jax.ShapeDtypeStruct((self.comm.num_local_experts,), jnp.int32),
             jax.ShapeDtypeStruct((m,), jnp.int32)), ticket)
        return expert_x, (expert_x_scale if cfg.is_fp8 else None), counts, (position, dest)

    def combine_send(self, expert_y, route, topk_idx, reduced: bool = False):
        position, dest = route
        ticket = self._call("combine_send", jax.ShapeDtypeStruct((2,), jnp.int32), expert_y, dest)
        return ticket, position

    def combine_recv(self, handle, topk_weights, topk_idx):
        return self._recv(handle, topk_weights, topk_idx, reduce=True)

    # --- per-entry variants (gradients) through the same protocol, so no XLA collective runs between our calls ---
    def dispatch_entries(self, rows, route, topk_idx):
        if self.cfg.dispatch_dtype != rows.dtype:  # fp8 configs: the wire format differs, use the reference
            return super().dispatch_entries(rows, route, topk_idx)
        t, r, h = rows.shape
        handle = self._send(rows.reshape(t * r, h), None, topk_idx, per_entry=True)
        return self.dispatch_recv(handle)[0]

    def combine_entries(self, expert_y, route, topk_idx):
        t, r = topk_idx.shape
        handle = self.combine_send(expert_y, route, topk_idx)
        ones = jnp.ones((t, r), jnp.float32)
        return self._recv(handle, ones, topk_idx, reduce=False).reshape(t, r, -1)


__all__ = ["CpuBackend", "timestamp"]
