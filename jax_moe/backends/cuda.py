"""Backend "cuda": dispatch/combine kernels as XLA FFI custom calls, tokens pushed over NVLink inside a node.

Every Communicator gets, on each of its GPUs, one buffer sized for the worst case (see `buffer_bytes`): per sender
max_tokens token records (each token crosses NVLink once per destination rank), per sender and local expert the list
of its (t, k) entries, the counts and epoch flags, plus the combine area of max_tokens * R rows. Ranks map each
other's buffers (peer access when one process drives several GPUs, CUDA IPC handles exchanged through
jax.distributed (jax_moe.backends.bootstrap) when each GPU has its own process) and synchronise with epoch flags in
peer memory: no host round trip per call. Rows land bit-exactly in the layout of the reference backend "xla".

Ranks on other nodes (other hosts, or other blocks of `ranks_per_node`) are reached through the host proxy: the send
kernels pack their regions into pinned host memory mapped into the GPU and ring a bell; a proxy thread per GPU (the
TransferEngine's progress thread) posts them with immediates, counts the arrivals and raises the flag the receive
kernels wait on (src/cuda/device_fabric.h). One group may mix both kinds of peer.
docs/cuda.md has the protocol; src/kernels holds the kernels and src/ffi/cuda the handlers.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends import bootstrap
from jax_moe.backends.native import NativeBackend
from jax_moe.contract import poison_padding, valid_entries

_PEER_SELF, _PEER_LOCAL, _PEER_IPC, _PEER_REMOTE = 0, 1, 2, 3  # peer kinds of _core.cuda.connect
# How combine_send returns rows (kernels/moe_layout.h CombineMode): one per (t, k) entry; or per (token, rank), summed
# at the expert rank with the weights dispatch carried, or with unit weights (dispatch's transpose).
_PER_ENTRY, _WEIGHTED, _UNIT = 0, 1, 2
_PAD_LEAVE, _PAD_ZERO, _PAD_POISON = 0, 1, 2  # what dispatch_recv writes into expert_x's padding rows (Padding)


def command_buffers() -> bool:
    """JAX_MOE_CUDA_COMMAND_BUFFERS=1: call the handlers marked command-buffer compatible, so XLA may capture them
    into CUDA graphs with their neighbours (fewer launch gaps). Their device errors (a peer timed out, an expert id
    out of range) are then not raised by the next call: read them with `comm.errors()`."""
    return os.environ.get("JAX_MOE_CUDA_COMMAND_BUFFERS", "0") == "1"


def fuse_one_shot() -> bool:
    """`comm.dispatch` / `comm.combine` run both halves from one custom call (their kernels back to back on the stream,
    without the ~4 us XLA leaves between two calls). JAX_MOE_CUDA_FUSE_ONE_SHOT=0 (read at trace time) calls the
    halves one after the other instead (for comparisons)."""
    return os.environ.get("JAX_MOE_CUDA_FUSE_ONE_SHOT", "1") != "0"


def buffer_bytes(cfg: Any, num_ranks: int) -> int:
    """Bytes of the buffer the cuda backend allocates on each GPU of a Communicator with this config."""
    mod = CudaBackend.module()
    l = cfg.num_experts // num_ranks
    return int(mod.buffer_bytes(num_ranks, l, cfg.experts_per_token, cfg.max_tokens, cfg.hidden,
                                np.dtype(cfg.dispatch_dtype).itemsize, cfg.num_scales,
                                np.dtype(cfg.combine_dtype).itemsize))


def timestamp(a: jax.Array, dep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(a, t): `a` passed through (aliased, no copy) and the device time in ns once all work before it has finished.

    Feed the returned `a` to the next operation so that it runs after the stamp; `dep` orders the stamp after its
    producer. GPU only; used by the benchmark.
    """
    return CudaBackend.stamp(a, dep, jax.ShapeDtypeStruct((1,), jnp.uint64))


class CudaDispatchHandle(NamedTuple):
    ticket: Optional[jax.Array]  # int32 [4], written by the send kernel; orders dispatch_recv after it. None: a
    # deferred one-shot dispatch (defer_dispatch): dispatch_recv runs both halves as one call
    x: jax.Array  # the send's inputs: dispatch_recv reads this rank's own tokens from them (they are not copied)
    x_scale: jax.Array
    topk_weights: Optional[jax.Array]  # float32 [T, R] when given to dispatch_send (they travel with the tokens)
    topk_idx: Optional[jax.Array] = None  # int32 [T, R]: a deferred dispatch's routing


class CudaRoute(NamedTuple):
    # int32 [M + 2 + E + N + 2 * N * max_tokens * R]: source rank * max_tokens * R + t * R + k of every expert_x row
    # (t * R + k: the token's slot in the sender's region for a remote sender); [M] = rows; then the row offsets of the
    # (expert, sender) blocks; the tokens each sender dispatched; then per (sender, t, k) its row here (-1: none) and
    # its router weight (float32 bits), written for t below that sender's tokens (kernels/moe_layout.h)
    origin: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ticket", "expert_y", "route"],
                   meta_fields=["channel", "mode"])
@dataclasses.dataclass(frozen=True)
class CudaCombineHandle:
    ticket: Optional[jax.Array]  # None: a deferred one-shot combine (defer_combine), both halves from combine_recv
    expert_y: jax.Array  # combine_send's input: combine_recv reads this rank's own rows from it
    channel: int  # static (pytree metadata): 0 forward, 1 inside dispatch's gradient (see dispatch_transpose)
    mode: int = _PER_ENTRY  # static: how combine_send returned the rows (_PER_ENTRY, _WEIGHTED, _UNIT)
    route: Optional[jax.Array] = None  # a deferred combine's route (CudaRoute.origin)


class CudaBackend(NativeBackend):
    name = "cuda"
    native = "cuda"
    platforms = ("gpu", "cuda")
    ffi_platform = "CUDA"
    rounds_in_flight = 2  # two area slots per direction and channel (kRoundSlots): a send waits (on the stream)
    # for the receive of the round two before it
    receives_in_order = True  # a receive reads the slot of its own epoch, and its ack covers every earlier round
    uses_fabric = True  # ranks on other nodes
    # The combine inside dispatch's gradient: "cuda" (channel 1 of the kernels) or "reference" (the "xla" backend's
    # per-entry path). JAX_MOE_CUDA_BACKWARD_COMBINE overrides.
    backward_combine = os.environ.get("JAX_MOE_CUDA_BACKWARD_COMBINE", "cuda")

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        why = super().unavailable_reason()
        if why is not None:
            return why
        try:
            if not jax.devices("gpu"):
                return "JAX sees no GPU"
        except RuntimeError:
            return "JAX has no GPU backend on this machine"
        return None

    @classmethod
    def target(cls, name: str) -> str:
        return super().target(name) + ("_graph" if command_buffers() else "")

    # --- set-up ---------------------------------------------------------------------------------------------------
    def _check(self, comm) -> None:
        cfg = self.cfg
        x_bytes = cfg.hidden * np.dtype(cfg.dispatch_dtype).itemsize
        if x_bytes % 16 or (cfg.hidden * 2) % 16:
            raise ValueError(f"backend 'cuda' needs hidden * itemsize to be a multiple of 16 bytes "
                             f"(hidden={cfg.hidden}); use hidden divisible by 16")
        if cfg.experts_per_token > 32:
            raise ValueError(f"backend 'cuda' handles at most 32 experts per token, got {cfg.experts_per_token}")
        if comm.num_ranks > 128:
            raise ValueError(f"backend 'cuda' handles at most 128 ranks, got {comm.num_ranks}")

    def _local(self) -> list[bootstrap.RankEntry]:
        return self.table.local(jax.process_index())

    def _create(self) -> None:
        o = self.options
        self._mod.create_comm(self.native_id, o.num_ranks, o.local_experts, o.experts_per_token, o.max_tokens,
                               o.hidden, o.x_itemsize, o.num_scales, o.y_itemsize,
                               [(e.local_id, e.rank) for e in self._local()], o.timeout_s)

    def _record(self) -> Any:
        """The CUDA IPC handle of this process's buffer on each of its GPUs, by device id."""
        return {str(e.device_id): self._mod.export_buffer(self.native_id, e.local_id).hex() for e in self._local()}

    def _connect(self, peers: bootstrap.Peers) -> None:
        me, host = jax.process_index(), socket.gethostname()
        # local devices, their remote ranks, every rank's node
        fabric: list[tuple[bootstrap.RankEntry, list[bootstrap.RankEntry], list[int]]] = []
        any_remote = False
        for group in self.table.groups():
            nodes = bootstrap.nodes(group, peers.hosts, self.options.ranks_per_node)
            any_remote |= len(set(nodes)) > 1
            for d in group:
                if d.process != me:
                    continue
                specs, remote = [], []
                for q, p in enumerate(group):
                    peer_host = peers.hosts[p.process] or host
                    where = f"process {p.process} on host {peer_host}, GPU {p.local_id}"  # for errors
                    where += f", node {nodes[q]}" if len(set(nodes)) > 1 else ""
                    if nodes[q] != nodes[d.rank]:
                        specs.append((q, _PEER_REMOTE, -1, b"", where))
                        remote.append(p)
                    elif p.device_id == d.device_id:
                        specs.append((q, _PEER_SELF, -1, b"", where))
                    elif p.process == me:
                        specs.append((q, _PEER_LOCAL, p.local_id, b"", where))
                    else:
                        if peer_host != host:
                            raise ValueError(
                                f"backend 'cuda': ranks {d.rank} (host {host!r}) and {q} (host {peer_host!r}) are in "
                                f"one node (ranks_per_node={self.options.ranks_per_node}), but GPUs of different "
                                "hosts cannot map each other's memory: choose a ranks_per_node that keeps a node on "
                                "one host, or leave it unset")
                        ipc = bytes.fromhex(peers.records[p.process][str(p.device_id)])
                        specs.append((q, _PEER_IPC, -1, ipc, where))
                self._mod.connect(self.native_id, d.local_id, specs)
                if remote:
                    fabric.append((d, remote, nodes))
        if any_remote:  # every process takes part, with or without remote ranks of its own
            self._connect_fabric(fabric)

    def _connect_fabric(self, fabric: list[tuple[bootstrap.RankEntry, list[bootstrap.RankEntry], list[int]]]) -> None:
        """Opens the engine, areas and proxy of each local device with remote ranks, exchanges their endpoints and
        connects them. Each area holds regions for the ranks on other nodes only: the nodes say which, and where a
        sender's region is in each receiver's area."""
        mine: dict[str, Any] = {}
        held = not command_buffers()  # the plain handlers will launch the rounds: "auto" may stage (docs/cuda.md)
        for d, _, nodes in fabric:
            address, areas = self._mod.open_fabric(self.native_id, d.local_id, self.options.fabric_provider,
                                                   self.options.fabric_memory, held, nodes)
            mine[str(d.device_id)] = [address.hex(), [a.hex() for a in areas]]
        records = dict(bootstrap.exchange(self.options, self.table, lambda: mine, stage="fabric").records)
        records[jax.process_index()] = mine
        for d, remote, _ in fabric:
            endpoints = []
            for p in remote:
                address, areas = records[p.process][str(p.device_id)]
                endpoints.append((p.rank, bytes.fromhex(address), [bytes.fromhex(a) for a in areas]))
            self._mod.connect_fabric(self.native_id, d.local_id, endpoints)
        if len(self.table.processes) > 1:
            bootstrap.barrier(self.options, "fabric")  # no region is posted before every peer is connected
        self._auto_staged = self.options.fabric_memory == "auto" and any(i.get("staged")
                                                                          for i in self.fabric_info().values())

    def fabric_info(self) -> dict[int, dict[str, Any]]:
        """Per local GPU ordinal with ranks on other nodes: the provider ("provider"), where the areas live ("memory",
        "on_gpu", "staged", and "fallback": why not in GPU memory), their bytes ("bytes", host and HBM), how they are
        cut ("lanes", "regions_per_lane": one per rank on another node, "remote_ranks"; per stream "region_bytes"),
        how NIC writes become visible ("visibility"), and where the proxy runs ("proxy_cpu", "proxy_cpus",
        "numa_node", "areas_numa_node", "areas_numa_node_granted")."""
        return {d.local_id: dict(info) for d in self._local()
                for info in [self._mod.fabric_info(self.native_id, d.local_id)] if info}

    def launch_shapes(self, tokens: int) -> dict[str, Any]:
        """Blocks and threads per block of each half's NVLink kernel for `tokens` tokens (identical on every GPU of the
        group but for the SM count), and the GPU's SMs: what the halves occupy while their data is in flight."""
        shapes = self._mod.launch_shapes(self.native_id, self._local()[0].local_id, int(tokens))
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in shapes.items()}

    def fabric_trace(self, rounds: int, stream: int = 0) -> dict[int, list[tuple[int, int, int]]]:
        """Per local GPU ordinal: for the first `rounds` rounds of `stream` (0 dispatch, 1 combine), when its proxy
        saw the bell, posted, and flagged the arrival (steady-clock ns). For the benchmark's breakdown."""
        return {d.local_id: list(self._mod.fabric_trace(self.native_id, d.local_id, rounds, stream))
                for d in self._local()}

    @classmethod
    def _free(cls, native_id: int) -> None:
        cls.module().destroy_comm(native_id)

    @property
    def bytes_allocated(self) -> int:
        """Bytes of this Communicator's buffers on this process's GPUs (`buffer_bytes` per GPU), plus the pinned host
        areas of its ranks on other nodes."""
        areas = sum(int(info["bytes"]) for info in self.fabric_info().values())
        return buffer_bytes(self.cfg, self.options.num_ranks) * len(self._local()) + areas

    def errors(self) -> list[str]:
        """Reads and clears the error words of this process's devices (call after the results are ready). A timeout
        is not cleared: it is returned again by every later read, since the Communicator is unusable after one."""
        return [e for d in self._local() for e in [self._mod.take_error(self.native_id, d.local_id)] if e]

    def _call(self, name: str, results: Any, *args: jax.Array, **attrs: Any) -> Any:
        if command_buffers() and getattr(self, "_auto_staged", False):
            raise ValueError("backend 'cuda': JAX_MOE_CUDA_COMMAND_BUFFERS=1 was set after this Communicator was made, "
                             "and its fabric_memory \"auto\" chose staged areas then, which need the plain handlers "
                             "(they hold the host back; the command-buffer ones do not: docs/cuda.md): set the "
                             "variable before making the Communicator, or pass fabric_memory=\"host\"")
        return super()._call(name, results, *args, **attrs)

    # --- the four halves ------------------------------------------------------------------------------------------
    def dispatch_send(self, x, x_scale, topk_idx, topk_weights=None) -> CudaDispatchHandle:
        scale = x_scale if x_scale is not None else jnp.zeros((1, 1), jnp.float32)
        w = topk_weights.astype(jnp.float32) if topk_weights is not None else None
        ticket = self._call("dispatch_send", jax.ShapeDtypeStruct((4,), jnp.int32), x, scale,
                            w if w is not None else jnp.zeros((1, 1), jnp.float32), topk_idx.astype(jnp.int32),
                            has_scale=x_scale is not None, has_weights=w is not None)
        return CudaDispatchHandle(ticket, x, scale, w)

    def defer_dispatch(self, x, x_scale, topk_idx, topk_weights=None) -> Optional[CudaDispatchHandle]:
        if not fuse_one_shot():
            return None
        scale = x_scale if x_scale is not None else jnp.zeros((1, 1), jnp.float32)
        w = topk_weights.astype(jnp.float32) if topk_weights is not None else None
        return CudaDispatchHandle(None, x, scale, w, topk_idx.astype(jnp.int32))

    def dispatch_recv(self, handle: CudaDispatchHandle):
        cfg, m = self.cfg, self.comm.max_recv_rows
        fp8 = cfg.num_scales > 0
        table = self.comm.num_ranks * cfg.max_tokens * cfg.experts_per_token
        results = (jax.ShapeDtypeStruct((m, cfg.hidden), cfg.dispatch_dtype),
                   jax.ShapeDtypeStruct((m, cfg.num_scales) if fp8 else (1, 1), jnp.float32),
                   jax.ShapeDtypeStruct((self.comm.num_local_experts,), jnp.int32),
                   jax.ShapeDtypeStruct((m + 2 + cfg.num_experts + self.comm.num_ranks + 2 * table,), jnp.int32))
        w = handle.topk_weights
        w_arg = w if w is not None else jnp.zeros((1, 1), jnp.float32)
        attrs = dict(has_scale=fp8, has_weights=w is not None, padding=np.int64(self._padding()))
        if handle.ticket is None:  # deferred: both halves in one call
            _, x, scale, counts, origin = self._call("dispatch", (jax.ShapeDtypeStruct((4,), jnp.int32),) + results,
                                                     handle.x, handle.x_scale, w_arg, handle.topk_idx, **attrs)
        else:
            x, scale, counts, origin = self._call("dispatch_recv", results, handle.ticket, handle.x, handle.x_scale,
                                                  w_arg, **attrs)
        return x, (scale if fp8 else None), counts, CudaRoute(origin)

    def _padding(self) -> int:
        if self.cfg.zero_padding:
            return _PAD_ZERO
        return _PAD_POISON if poison_padding() else _PAD_LEAVE

    def combine_send(self, expert_y, route, topk_idx, reduced: bool = False, channel: int = 0,
                     mode: Optional[int] = None) -> CudaCombineHandle:
        """reduced: the weights of combine_recv are those dispatch_send carried, so the rows of a token held here
        go back as one weighted float32 sum per (token, rank) (bf16), not one row per (t, k)."""
        if not isinstance(route, CudaRoute):
            raise TypeError("backend 'cuda': combine_send needs the Dispatched of this backend's dispatch")
        if mode is None:
            mode = _WEIGHTED if reduced else _PER_ENTRY
        expert_y = expert_y.astype(self.cfg.combine_dtype)
        ticket = self._call("combine_send", jax.ShapeDtypeStruct((4,), jnp.int32), expert_y, route.origin,
                            channel=np.int64(channel), mode=np.int64(mode))
        return CudaCombineHandle(ticket, expert_y, channel, mode)

    def defer_combine(self, expert_y, route, topk_idx, reduced: bool = False) -> Optional[CudaCombineHandle]:
        if not fuse_one_shot():
            return None
        if not isinstance(route, CudaRoute):
            raise TypeError("backend 'cuda': combine needs the Dispatched of this backend's dispatch")
        return CudaCombineHandle(None, expert_y.astype(self.cfg.combine_dtype), 0, _WEIGHTED if reduced else _PER_ENTRY,
                                 route.origin)

    def combine_recv(self, handle: CudaCombineHandle, topk_weights, topk_idx):
        out = jax.ShapeDtypeStruct((topk_idx.shape[0], self.cfg.hidden), self.cfg.combine_dtype)
        w, idx = topk_weights.astype(jnp.float32), topk_idx.astype(jnp.int32)
        attrs = dict(channel=np.int64(handle.channel), mode=np.int64(handle.mode))
        if handle.ticket is None:  # deferred: both halves in one call
            return self._call("combine", (jax.ShapeDtypeStruct((4,), jnp.int32), out), handle.expert_y, handle.route,
                              w, idx, **attrs)[1]
        return self._call("combine_recv", out, handle.ticket, w, idx, handle.expert_y, **attrs)

    def dispatch_transpose(self, g_expert_x, route, topk_idx):
        # Channel 1: its own area, flags and epochs. XLA may run the forward combine_recv (whose output only feeds
        # the loss) after this combine_send; on a shared channel that would deadlock.
        ones = jnp.ones(topk_idx.shape, jnp.float32)
        if self.backward_combine == "reference":  # XLA's per-entry path instead of the kernels (for diagnosis)
            w = jnp.where(valid_entries(topk_idx, self.cfg.num_experts), ones, 0.0)
            y = self.reference.combine_entries(g_expert_x, None, topk_idx).astype(jnp.float32)
            return jnp.einsum("trh,tr->th", y, w, precision=jax.lax.Precision.HIGHEST).astype(self.cfg.combine_dtype)
        # Unit weights need nothing from dispatch: a token's rows are summed at the expert rank (one row per rank).
        if fuse_one_shot():  # both halves from one call
            handle = CudaCombineHandle(None, g_expert_x.astype(self.cfg.combine_dtype), 1, _UNIT, route.origin)
        else:
            handle = self.combine_send(g_expert_x, route, topk_idx, channel=1, mode=_UNIT)
        return self.combine_recv(handle, ones, topk_idx)

    # --- diagnostics ----------------------------------------------------------------------------------------------
    def read_trace(self) -> dict[int, np.ndarray]:
        """Device-side trace per local device ordinal: [64 epochs, halves, points] %globaltimer ns.

        Zeros unless JAX_MOE_CUDA_TRACE=1 was set when the Communicator was made. Halves: dispatch send, dispatch
        recv, combine send, combine recv (channel 0), then combine send/recv of channel 1. Points: start, waited, work,
        end, then the send halves' fabric phases (ranks on other nodes; bench.diagnostics names them), 0 where a
        half records none. Synchronous."""
        shape = self._mod.trace_shape()
        return {d.local_id: np.asarray(self._mod.read_trace(self.native_id, d.local_id), np.uint64).reshape(shape)
                for d in self._local()}
