"""The base of the native backends ("cpu", "cuda"): the C++ side (jax_moe._core.<backend>) holds one state per
Communicator and process; this class sets it up (jax_moe.backends.bootstrap), registers the FFI targets, calls the
halves in program order (jax_moe.backends.ffi_call) and frees the state when the Communicator goes.

A subclass says which native module and FFI attribute it uses and implements the set-up steps (`_create`,
`_record`, `_connect`, `_free`) and the four halves with `_call`.
"""
from __future__ import annotations

import gc
import threading
import types
import weakref
from functools import partial
from typing import Any, Callable, ClassVar, Optional

import jax
import numpy as np

from jax_moe.backends import bootstrap, deferred
from jax_moe.backends.base import Backend, CommView
from jax_moe.backends.ffi_call import ffi_call
from jax_moe.backends.xla import XlaBackend

try:
    from jax_moe import _core
    _CORE_ERROR: Optional[str] = None
except ImportError as e:  # pragma: no cover - depends on the build
    _core = None
    _CORE_ERROR = str(e)

_lock = threading.Lock()
_ABSENT = {"cuda": "jax_moe._core was built without CUDA (no nvcc at build time)"}


def native_module(name: str) -> tuple[Optional[types.ModuleType], Optional[str]]:
    """(jax_moe._core.<name>, None), or (None, why this build has none)."""
    if _core is None:
        return None, f"the native extension jax_moe._core is not built ({_CORE_ERROR})"
    mod = getattr(_core, name, None)
    if mod is None:
        return None, _ABSENT.get(name, f"this build of jax_moe._core has no {name} backend")
    return mod, None


# (native module, native id) -> the finalizer of the Communicator that holds it and that Communicator's id. A native
# id can be reused (backend "cpu" carries ids modulo 2**COMM_ID_BITS on the wire): only once its holder is gone.
_holders: dict[tuple[str, int], tuple[weakref.finalize, int]] = {}


def _take_native_id(comm: CommView, native: str, native_id: int, id_limit: int) -> tuple[str, int]:
    """Claims `native_id` for `comm`; refuses it while another live Communicator holds it. A dropped holder that the
    cycle collector has not reached yet is collected first, so that its finalizer frees its state now and not, later,
    the state of the Communicator that reuses the id."""
    key = (native, native_id)
    held = _holders.get(key)
    if held is not None and held[0].alive:
        gc.collect()
        deferred.run_pending()  # the collected holder's state is freed before its id is taken again
    if held is not None and held[0].alive:
        raise RuntimeError(
            f"Communicator {comm.id} would reuse native id {native_id} of Communicator {held[1]}, which is still alive: "
            f"backend {native!r} tells Communicators apart by their id modulo {id_limit}, so at most {id_limit} "
            f"Communicators can be alive at once in a process. Drop the ones you no longer use (del, or let their "
            f"layers go) before making more.")
    return key


def _free_after_programs(free: Callable[[int], None], native_id: int) -> None:
    """Frees a dropped Communicator's native state once the programs already dispatched (asynchronously) have run:
    they may still call into it. Inside a collection: at the next safe point (jax_moe.backends.deferred)."""
    deferred.after_programs(partial(free, native_id))


class NativeBackend(Backend):
    native: ClassVar[str]  # the jax_moe._core submodule ("cpu", "cuda"); FFI targets are jax_moe_<native>_<handler>
    platforms: ClassVar[tuple[str, ...]]  # mesh platforms it runs on
    ffi_platform: ClassVar[str]  # platform of its FFI targets
    uses_fabric: ClassVar[bool] = False  # reaches other processes through the TransferEngine (fabric_provider)
    _registered: ClassVar[bool] = False

    # --- availability and FFI targets -----------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return native_module(cls.native)[1]

    @classmethod
    def module(cls) -> Any:
        mod, why = native_module(cls.native)
        if mod is None:
            raise RuntimeError(why)
        return mod

    @classmethod
    def target(cls, name: str) -> str:
        """The FFI target of handler `name` ("dispatch_send", ..., "timestamp")."""
        return f"jax_moe_{cls.native}_{name}"

    @classmethod
    def register_targets(cls) -> None:
        with _lock:
            if cls.__dict__.get("_registered"):
                return
            jax.devices()  # the client must exist before its platform's FFI targets are registered
            prefix = f"jax_moe_{cls.native}_"
            for name, capsule in cls.module().handlers().items():
                full = name if name.startswith(prefix) else prefix + name
                jax.ffi.register_ffi_target(full, capsule, platform=cls.ffi_platform)
            cls._registered = True

    @classmethod
    def stamp(cls, a: jax.Array, dep: jax.Array, clock: jax.ShapeDtypeStruct) -> tuple[jax.Array, jax.Array]:
        """(a, t): `a` passed through (aliased) and the native clock, taken once `a` and `dep` are ready. Not in
        program order (it is no round): feed the returned `a` to what must run after it. For the benchmark."""
        cls.register_targets()
        return jax.ffi.ffi_call(cls.target("timestamp"), (jax.ShapeDtypeStruct(a.shape, a.dtype), clock),
                                has_side_effect=True, input_output_aliases={0: 0})(a, dep)

    # --- set-up ---------------------------------------------------------------------------------------------------
    def __init__(self, comm: CommView):
        super().__init__(comm)
        if comm.platform not in self.platforms:
            raise ValueError(f"backend {self.name!r} runs on {' / '.join(self.platforms)} devices, but the mesh holds "
                             f"{comm.platform} devices")
        self._check(comm)
        deferred.run_pending()  # the state of Communicators collected since: freed before more is allocated
        self.register_targets()
        self._mod = self.module()
        self.options = bootstrap.NativeOptions.of(comm, self.name, self.uses_fabric)
        self.table = bootstrap.RankTable.of(comm.mesh, comm.axes)
        self.native_id = self._native_id(int(comm.id))
        self.reference = XlaBackend(comm)  # the contract's layout from topk_idx alone (per-entry gradients)
        # Registered before anything is allocated, so a failed set-up still frees what it got. At exit the process
        # (and the native module's own exit hook) takes the state with it.
        key = _take_native_id(comm, self.native, self.native_id, self.id_limit) if self.id_limit else None
        done = weakref.finalize(comm, _free_after_programs, type(self)._free, self.native_id)
        done.atexit = False
        if key is not None:
            _holders[key] = (done, int(comm.id))
        self._create()
        self._connect(bootstrap.exchange(self.options, self.table, self._record))

    def _check(self, comm: CommView) -> None:
        """Refuses configs the native side cannot run (before anything is allocated)."""

    id_limit: ClassVar[Optional[int]] = None  # native ids are Communicator ids modulo this (None: not reduced)

    def _native_id(self, comm_id: int) -> int:
        """The number the native side knows this Communicator by."""
        return comm_id if self.id_limit is None else comm_id % self.id_limit

    def _create(self) -> None:
        """Allocates this process's native state."""
        raise NotImplementedError

    def _record(self) -> Any:
        """What the other processes need from this one (JSON-able); asked only when the mesh spans processes."""
        raise NotImplementedError

    def _connect(self, peers: bootstrap.Peers) -> None:
        """Connects to the other processes' ranks from what they published."""
        raise NotImplementedError

    @classmethod
    def _free(cls, native_id: int) -> None:
        """Frees the native state of `native_id` (called by the finalizer, which must not hold the backend)."""
        raise NotImplementedError

    # --- the halves -----------------------------------------------------------------------------------------------
    def _call(self, name: str, results: Any, *args: jax.Array, **attrs: Any) -> Any:
        """FFI handler `name` in program order, for this Communicator."""
        deferred.run_pending()
        attrs["comm_id"] = np.int64(self.native_id)  # the attribute every handler reads
        return ffi_call(self.target(name), results, *args, axes=self.comm.axes, **attrs)

    def dispatch_entries(self, rows: jax.Array, route: Any, topk_idx: jax.Array) -> jax.Array:
        return self.reference.dispatch_entries(rows, None, topk_idx)

    def combine_entries(self, expert_y: jax.Array, route: Any, topk_idx: jax.Array) -> jax.Array:
        return self.reference.combine_entries(expert_y, None, topk_idx)
