"""Backend "cpu": the real dispatch/combine protocol on host memory, as XLA FFI custom calls for platform "cpu".

Ranks of one process exchange rows through shared memory; ranks of other processes through the TransferEngine
(libfabric tcp/shm). The C++ side (src/cpu, src/proxy) holds one CpuComm per Communicator and process; this module
sets it up (the bootstrap exchanges engine addresses and buffer descriptors through jax.distributed's key-value
store) and calls its four halves with jax.ffi.ffi_call.
"""
from __future__ import annotations

import json
import socket
import threading
import weakref
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.base import Backend
from jax_moe.backends.ffi_call import ffi_call, wait_for_programs

if TYPE_CHECKING:
    from jax_moe.communicator import Communicator

_TARGET = "jax_moe_cpu_{}"
_registered = False
_lock = threading.Lock()
SLOT_BITS = 15  # the immediate carries the Communicator slot in 15 bits (src/proxy/imm.h)


def _core():
    from jax_moe import _core

    return _core


def _register_targets() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        jax.devices()  # the CPU client must exist before CPU FFI targets are registered
        for name, capsule in _core().cpu.handlers().items():
            jax.ffi.register_ffi_target(_TARGET.format(name), capsule, platform="cpu")
        _registered = True


def _release(slot: int) -> None:
    """Frees a dropped Communicator's CpuComm once the programs already dispatched (asynchronously) have run: they
    may still call into it."""
    wait_for_programs()
    _core().cpu.release(slot)


def timestamp(a: jax.Array, dep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(a, t): `a` passed through (aliased) and the host clock in ns as uint32 [low, high], taken once `a` and `dep`
    are ready. Feed the returned `a` to the next operation so that it runs after the stamp. Used by the benchmark."""
    _register_targets()
    return jax.ffi.ffi_call(_TARGET.format("timestamp"),
                            (jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct((2,), jnp.uint32)),
                            has_side_effect=True, input_output_aliases={0: 0})(a, dep)


def rank_table(mesh, axis_name) -> list[tuple[int, int, int, int]]:
    """(device id, process, group, rank) for every device of the mesh; rank = position on the EP axes."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    names = tuple(mesh.axis_names)
    others = [a for a in names if a not in axes]
    devices = np.asarray(mesh.devices)
    rows = []
    for index in np.ndindex(devices.shape):
        coord = dict(zip(names, index))
        rank = int(np.ravel_multi_index([coord[a] for a in axes], [mesh.shape[a] for a in axes]))
        group = int(np.ravel_multi_index([coord[a] for a in others], [mesh.shape[a] for a in others])) if others else 0
        d = devices[index]
        rows.append((int(d.id), int(d.process_index), group, rank))
    return rows


class CpuBackend(Backend):
    name = "cpu"
    rounds_in_flight = 4  # the receive lanes of src/cpu (CommOptions::lanes)

    @staticmethod
    def unavailable_reason() -> Optional[str]:
        try:
            core = _core()
        except ImportError as e:
            return f"the native extension jax_moe._core is not built ({e})"
        if not hasattr(core, "cpu"):
            return "this build of jax_moe._core has no cpu backend"
        return None

    def __init__(self, comm: "Communicator"):
        super().__init__(comm)
        if comm.platform != "cpu":
            raise ValueError(f"backend 'cpu' runs on CPU devices, but the mesh holds {comm.platform} devices")
        _register_targets()
        cfg = comm.cfg
        self.slot = comm.id % (1 << SLOT_BITS)
        self.timeout_s = comm.timeout_s
        self.provider = comm.fabric_provider
        self.shape = dict(num_ranks=comm.num_ranks, num_experts=cfg.num_experts, local_experts=comm.num_local_experts,
                          experts_per_token=cfg.experts_per_token, hidden=cfg.hidden, max_tokens=cfg.max_tokens,
                          x_itemsize=cfg.dispatch_dtype.itemsize, num_scales=cfg.num_scales)
        table = rank_table(comm.mesh, comm.axis_name)
        process = jax.process_index()
        core = _core()
        core.cpu.release(self.slot)  # a slot reused after 2**18 Communicators
        core.cpu.create(self.slot, self.shape, table, process, self.timeout_s, self.provider)
        # At exit the binding's own hook releases every CpuComm (after waiting for running programs).
        weakref.finalize(comm, _release, self.slot).atexit = False
        processes = sorted({row[1] for row in table})
        hosts = [""] * (max(processes + [process]) + 1)
        hosts[process] = socket.gethostname()
        if len(processes) > 1:
            hosts = self._connect(processes, process, hosts)
        core.cpu.set_hosts(self.slot, hosts)

    @property
    def bytes_allocated(self) -> int:
        """Host bytes of this process's receive and staging buffers."""
        return int(_core().cpu.bytes_allocated(self.slot))

    def _connect(self, processes: list[int], process: int, hosts: list[str]) -> list[str]:
        """Exchanges endpoints with the other processes through the jax.distributed key-value store."""
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("backend 'cpu' over several processes needs jax.distributed.initialize()")
        core = _core()
        prefix = f"jax_moe/cpu/{self.comm.id}"
        fingerprint = json.dumps({"shape": self.shape, "axis": str(self.comm.axis_name), "provider": self.provider})
        mine = [[g, r, a.hex(), d.hex(), c.hex()] for g, r, a, d, c in core.cpu.endpoints(self.slot)]
        client.key_value_set_bytes(f"{prefix}/{process}", json.dumps({"config": fingerprint, "endpoints": mine,
                                                                       "host": hosts[process]}).encode())
        timeout_ms = int(self.timeout_s * 1000)
        remote = []
        for p in processes:
            if p == process:
                continue
            blob = json.loads(client.blocking_key_value_get_bytes(f"{prefix}/{p}", timeout_ms))
            if blob["config"] != fingerprint:
                raise ValueError(f"Communicator {self.comm.id}: process {p} built it with another config:\n"
                                 f"  process {p}: {blob['config']}\n  process {process}: {fingerprint}")
            remote += [(g, r, bytes.fromhex(a), bytes.fromhex(d), bytes.fromhex(c)) for g, r, a, d, c in
                       blob["endpoints"]]
            hosts[p] = str(blob.get("host", ""))
        core.cpu.connect(self.slot, remote)
        client.wait_at_barrier(f"{prefix}/connected", timeout_ms)
        return hosts

    # --- the four halves ------------------------------------------------------------------------------------------
    def _call(self, half: str, results, *args, **attrs):
        return ffi_call(_TARGET.format(half), results, *args, axes=self.comm.axes, comm_id=np.int64(self.slot), **attrs)

    def _send(self, rows, x_scale, topk_idx, per_slot: bool):
        t, r = topk_idx.shape
        scale = x_scale if x_scale is not None else jnp.zeros((rows.shape[0], 0), jnp.float32)
        slot, ticket = self._call("dispatch_send", (jax.ShapeDtypeStruct((t * r,), jnp.int32),
                                                    jax.ShapeDtypeStruct((2,), jnp.int32)), rows, scale, topk_idx,
                                  per_entry=per_slot)
        return ticket, slot

    def _recv(self, state, topk_weights, topk_idx, reduce: bool):
        ticket, slot = state
        t, r = topk_idx.shape
        rows = t if reduce else t * r
        return self._call("combine_recv", jax.ShapeDtypeStruct((rows, self.cfg.hidden), self.cfg.combine_dtype),
                          ticket, topk_weights.astype(jnp.float32), slot, reduce=reduce)

    def dispatch_send(self, x, x_scale, topk_idx):
        return self._send(x, x_scale, topk_idx, per_slot=False)

    def dispatch_recv(self, state):
        ticket, slot = state
        cfg, m = self.cfg, self.comm.max_recv_rows
        expert_x, expert_x_scale, counts, dest = self._call(
            "dispatch_recv",
            (jax.ShapeDtypeStruct((m, cfg.hidden), cfg.dispatch_dtype),
             jax.ShapeDtypeStruct((m, cfg.num_scales), jnp.float32),
             jax.ShapeDtypeStruct((self.comm.num_local_experts,), jnp.int32),
             jax.ShapeDtypeStruct((m,), jnp.int32)), ticket)
        return expert_x, (expert_x_scale if cfg.is_fp8 else None), counts, (slot, dest)

    def combine_send(self, expert_y, route, topk_idx):
        slot, dest = route
        ticket = self._call("combine_send", jax.ShapeDtypeStruct((2,), jnp.int32), expert_y, dest)
        return ticket, slot

    def combine_recv(self, state, topk_weights, topk_idx):
        return self._recv(state, topk_weights, topk_idx, reduce=True)

    # --- per-slot variants (gradients) through the same protocol, so no XLA collective runs between our calls ----
    def dispatch_slots(self, rows, route, topk_idx):
        if self.cfg.dispatch_dtype != rows.dtype:  # fp8 configs: the wire format differs, use the reference
            return super().dispatch_slots(rows, route, topk_idx)
        t, r, h = rows.shape
        state = self._send(rows.reshape(t * r, h), None, topk_idx, per_slot=True)
        return self.dispatch_recv(state)[0]

    def combine_slots(self, expert_y, route, topk_idx):
        t, r = topk_idx.shape
        state = self.combine_send(expert_y, route, topk_idx)
        ones = jnp.ones((t, r), jnp.float32)
        return self._recv(state, ones, topk_idx, reduce=False).reshape(t, r, -1)


__all__ = ["CpuBackend", "rank_table"]
