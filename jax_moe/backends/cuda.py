"""Backend "cuda": dispatch/combine kernels as XLA FFI custom calls, tokens pushed over NVLink inside a node.

Every Communicator gets, on each of its GPUs, one buffer sized for the worst case (see `buffer_bytes`): per sender
max_tokens token records (each token crosses NVLink once per destination rank), per sender and local expert the list
of its (t, k) slots, the counts and epoch flags, plus the combine area of max_tokens * R rows. Ranks map each
other's buffers (peer access when one process drives several GPUs, CUDA IPC through the jax.distributed key-value
store when each GPU has its own process) and synchronise with epoch flags in peer memory: no host round trip per
call. Rows land bit-exactly in the layout of the reference backend "xla". docs/cuda.md has the protocol;
src/kernels holds the kernels and src/ffi/cuda the handlers.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
import threading
import weakref
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.base import Backend
from jax_moe.backends.ffi_call import ffi_call, wait_for_programs

_registered = False
_lock = threading.Lock()
_PEER_SELF, _PEER_LOCAL, _PEER_IPC = 0, 1, 2


def _native():
    """(jax_moe._core.cuda, None) or (None, why not)."""
    try:
        from jax_moe import _core
    except ImportError as e:  # pragma: no cover - depends on the build
        return None, f"the native extension jax_moe._core is not built ({e})"
    mod = getattr(_core, "cuda", None)
    if mod is None:
        return None, "jax_moe._core was built without CUDA (no nvcc at build time)"
    return mod, None


def _register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        mod, why = _native()
        if mod is None:
            raise RuntimeError(why)
        for name, capsule in mod.handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        _registered = True


def command_buffers() -> bool:
    """JAX_MOE_CUDA_COMMAND_BUFFERS=1: call the handlers marked command-buffer compatible, so XLA may capture them
    into CUDA graphs with their neighbours (fewer launch gaps). Their device errors (a peer timed out, an expert id
    out of range) are then not raised by the next call: read them with `comm.backend.take_errors()`."""
    return os.environ.get("JAX_MOE_CUDA_COMMAND_BUFFERS", "0") == "1"


def _target(name: str) -> str:
    return f"jax_moe_cuda_{name}" + ("_graph" if command_buffers() else "")


def buffer_bytes(cfg, num_ranks: int) -> int:
    """Bytes of the buffer the cuda backend allocates on each GPU of a Communicator with this config."""
    mod, why = _native()
    if mod is None:
        raise RuntimeError(why)
    l = cfg.num_experts // num_ranks
    return int(mod.buffer_bytes(num_ranks, l, cfg.experts_per_token, cfg.max_tokens, cfg.hidden,
                                np.dtype(cfg.dispatch_dtype).itemsize, cfg.num_scales,
                                np.dtype(cfg.combine_dtype).itemsize))


def timestamp(a: jax.Array, dep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(a, t): `a` passed through (aliased, no copy) and the device time in ns once all work before it has finished.

    Feed the returned `a` to the next operation so that it runs after the stamp; `dep` orders the stamp after its
    producer. GPU only; used by the benchmark.
    """
    _register()
    return jax.ffi.ffi_call(_target("timestamp"),
                            (jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct((1,), jnp.uint64)),
                            has_side_effect=True, input_output_aliases={0: 0})(a, dep)


def _destroy(mod, group: int) -> None:
    """Frees a dropped Communicator's buffers once the programs already dispatched (asynchronously) have run: a
    handler called after destroy_comm would find no buffers."""
    wait_for_programs()
    mod.destroy_comm(group)


def _kv_client():
    try:
        from jax._src.distributed import global_state  # private: the only handle on the key-value store
    except ImportError:  # pragma: no cover
        return None
    return getattr(global_state, "client", None)


class SendState(NamedTuple):
    handle: jax.Array  # int32 [4], written by the send kernel; orders dispatch_recv after it
    x: jax.Array  # the send's inputs: dispatch_recv reads this rank's own tokens from them (they are not copied)
    x_scale: jax.Array


class Route(NamedTuple):
    route: jax.Array  # int32 [M + 1]: source rank * max_tokens * R + t * R + k of every expert_x row; [M] = rows


@functools.partial(jax.tree_util.register_dataclass, data_fields=["handle", "expert_y"], meta_fields=["channel"])
@dataclasses.dataclass(frozen=True)
class CombineState:
    handle: jax.Array
    expert_y: jax.Array  # combine_send's input: combine_recv reads this rank's own rows from it
    channel: int  # static (pytree metadata): 0 forward, 1 inside dispatch's gradient (see dispatch_transpose)


class CudaBackend(Backend):
    name = "cuda"
    rounds_in_flight = 1  # one buffer per direction and channel: a send waits (on the stream) for the last receive
    # The combine inside dispatch's gradient: "cuda" (channel 1 of the kernels) or "reference" (the "xla" backend's
    # per-slot path). JAX_MOE_CUDA_BACKWARD_COMBINE overrides.
    backward_combine = os.environ.get("JAX_MOE_CUDA_BACKWARD_COMBINE", "cuda")

    @staticmethod
    def unavailable_reason() -> Optional[str]:
        mod, why = _native()
        if mod is None:
            return why
        try:
            if not jax.devices("gpu"):
                return "JAX sees no GPU"
        except RuntimeError:
            return "JAX has no GPU backend on this machine"
        return None

    def __init__(self, comm):
        super().__init__(comm)
        cfg = self.cfg
        if comm.platform not in ("gpu", "cuda"):
            raise ValueError(f"backend 'cuda' needs a mesh of GPUs, this mesh is on {comm.platform!r}")
        x_bytes = cfg.hidden * np.dtype(cfg.dispatch_dtype).itemsize
        if x_bytes % 16 or (cfg.hidden * 2) % 16:
            raise ValueError(f"backend 'cuda' needs hidden * itemsize to be a multiple of 16 bytes "
                             f"(hidden={cfg.hidden}); use hidden divisible by 16")
        if cfg.experts_per_token > 32:
            raise ValueError(f"backend 'cuda' handles at most 32 experts per token, got {cfg.experts_per_token}")
        if comm.num_ranks > 128:
            raise ValueError(f"backend 'cuda' handles at most 128 ranks, got {comm.num_ranks}")
        _register()
        self._mod, _ = _native()
        self._n = comm.num_ranks
        self._l = comm.num_local_experts
        self._group = int(comm.id)
        self.bytes_per_device = buffer_bytes(cfg, self._n)
        # Registered before connecting, so a failed connect (an unsupported peer, say) still frees the buffers.
        finalizer = weakref.finalize(self, _destroy, self._mod, self._group)
        finalizer.atexit = False  # at exit the process goes away with its CUDA context
        self._connect()

    # --- set-up -------------------------------------------------------------------------------------------------
    def _rank_table(self) -> np.ndarray:
        """[groups, N] devices: row = one EP group (the other mesh axes fixed), column = rank on the comm's axis."""
        mesh = self.comm.mesh
        names = list(mesh.axis_names)
        axes = [self.comm.axis_name] if isinstance(self.comm.axis_name, str) else list(self.comm.axis_name)
        src = [names.index(a) for a in axes]
        devs = np.moveaxis(np.asarray(mesh.devices), src, list(range(len(names) - len(axes), len(names))))
        return devs.reshape(-1, self._n)

    def _connect(self) -> None:
        cfg, mod, gid = self.cfg, self._mod, self._group
        me = jax.process_index()
        table = self._rank_table()
        local = [(int(d.local_hardware_id), r) for row in table for r, d in enumerate(row) if d.process_index == me]
        mod.create_comm(gid, self._n, self._l, cfg.experts_per_token, cfg.max_tokens, cfg.hidden,
                         np.dtype(cfg.dispatch_dtype).itemsize, cfg.num_scales, np.dtype(cfg.combine_dtype).itemsize,
                         local, self.comm.timeout_s)
        remote = any(d.process_index != me for row in table for d in row)
        host = socket.gethostname()
        kv = _kv_client() if remote else None
        if remote and kv is None:
            raise RuntimeError("backend 'cuda': ranks in other processes need jax.distributed.initialize()")
        prefix = f"jax_moe/cuda/{gid}/{cfg.describe()}/{self._n}"
        if remote:
            for row in table:
                for d in row:
                    if d.process_index == me:
                        blob = host.encode() + b"\0" + mod.export_buffer(gid, int(d.local_hardware_id))
                        kv.key_value_set_bytes(f"{prefix}/{d.id}", blob, allow_overwrite=True)
        wait_ms = int(max(self.comm.timeout_s, 10) * 1000)
        for row in table:
            for r, d in enumerate(row):
                if d.process_index != me:
                    continue
                peers = []
                for q, p in enumerate(row):
                    where = f"process {p.process_index} on host {host}, GPU {p.local_hardware_id}"  # for errors
                    if p is d or p.id == d.id:
                        peers.append((q, _PEER_SELF, -1, b"", where))
                    elif p.process_index == me:
                        peers.append((q, _PEER_LOCAL, int(p.local_hardware_id), b"", where))
                    else:
                        blob = kv.blocking_key_value_get_bytes(f"{prefix}/{p.id}", wait_ms)
                        peer_host, handle = blob.split(b"\0", 1)
                        if peer_host.decode() != host:
                            raise NotImplementedError(
                                f"backend 'cuda': rank {q} is on host {peer_host.decode()!r}, not {host!r}; ranks on "
                                "other nodes (through the host proxy) are not supported yet")
                        peers.append((q, _PEER_IPC, -1, handle, where))
                mod.connect(gid, int(d.local_hardware_id), peers)

    def take_errors(self) -> list[str]:
        """Reads and clears the error words of this process's devices (call after the results are ready). A timeout
        is not cleared: it is returned again by every later read, since the Communicator is unusable after one."""
        me = jax.process_index()
        return [e for row in self._rank_table() for d in row if d.process_index == me
                for e in [self._mod.take_error(self._group, int(d.local_hardware_id))] if e]

    # --- the four halves ------------------------------------------------------------------------------------------
    def _call(self, name, results, *args, **attrs):
        return ffi_call(name, results, *args, axes=self.comm.axes, comm_id=np.int64(self._group), **attrs)

    def dispatch_send(self, x, x_scale, topk_idx) -> SendState:
        scale = x_scale if x_scale is not None else jnp.zeros((1, 1), jnp.float32)
        handle = self._call(_target("dispatch_send"), jax.ShapeDtypeStruct((4,), jnp.int32), x, scale,
                            topk_idx.astype(jnp.int32), has_scale=x_scale is not None)
        return SendState(handle, x, scale)

    def dispatch_recv(self, state: SendState):
        cfg, m = self.cfg, self.comm.max_recv_rows
        fp8 = cfg.num_scales > 0
        results = (jax.ShapeDtypeStruct((m, cfg.hidden), cfg.dispatch_dtype),
                   jax.ShapeDtypeStruct((m, cfg.num_scales) if fp8 else (1, 1), jnp.float32),
                   jax.ShapeDtypeStruct((self._l,), jnp.int32),
                   jax.ShapeDtypeStruct((m + 1,), jnp.int32))
        x, scale, counts, route = self._call(_target("dispatch_recv"), results, state.handle, state.x, state.x_scale,
                                             has_scale=fp8)
        return x, (scale if fp8 else None), counts, Route(route)

    def combine_send(self, expert_y, route, topk_idx, channel: int = 0):
        if not isinstance(route, Route):
            raise TypeError("backend 'cuda': combine_send needs the Dispatched of this backend's dispatch")
        expert_y = expert_y.astype(self.cfg.combine_dtype)
        handle = self._call(_target("combine_send"), jax.ShapeDtypeStruct((4,), jnp.int32), expert_y, route.route,
                            channel=np.int64(channel))
        return CombineState(handle, expert_y, channel)

    def combine_recv(self, state, topk_weights, topk_idx):
        out = jax.ShapeDtypeStruct((topk_idx.shape[0], self.cfg.hidden), self.cfg.combine_dtype)
        return self._call(_target("combine_recv"), out, state.handle, topk_weights.astype(jnp.float32),
                          topk_idx.astype(jnp.int32), state.expert_y, channel=np.int64(state.channel))

    def dispatch_transpose(self, g_expert_x, route, topk_idx):
        # Channel 1: its own area, flags and epochs. XLA may run the forward combine_recv (whose output only feeds
        # the loss) after this combine_send; on a shared channel that would deadlock.
        ones = jnp.ones(topk_idx.shape, jnp.float32)
        if self.backward_combine == "reference":  # XLA's per-slot path instead of the kernels (for diagnosis)
            from jax_moe.backends.xla import sanitize_topk

            w = jnp.where(sanitize_topk(topk_idx, self.cfg.num_experts) >= 0, ones, 0.0)
            y = self.comm._reference.combine_slots(g_expert_x, None, topk_idx).astype(jnp.float32)
            return jnp.einsum("trh,tr->th", y, w, precision=jax.lax.Precision.HIGHEST).astype(self.cfg.combine_dtype)
        return self.combine_recv(self.combine_send(g_expert_x, route, topk_idx, channel=1), ones, topk_idx)

    # --- diagnostics ----------------------------------------------------------------------------------------------
    def read_trace(self) -> dict[int, np.ndarray]:
        """Device-side trace per local device ordinal: [64 epochs, halves, (start, waited, work, end)] %globaltimer ns.

        Zeros unless JAX_MOE_CUDA_TRACE=1 was set when the Communicator was made. Halves: dispatch send, dispatch
        recv, combine send, combine recv (channel 0), then combine send/recv of channel 1. Synchronous."""
        me = jax.process_index()
        shape = self._mod.trace_shape()
        return {int(d.local_hardware_id): np.asarray(self._mod.read_trace(self._group, int(d.local_hardware_id)),
                                                     np.uint64).reshape(shape)
                for row in self._rank_table() for d in row if d.process_index == me}
