"""Communicator: one MoE layer's expert-parallel group and the backend that moves its rows."""
from __future__ import annotations

import itertools
import math
import os
from typing import Any, Optional, Sequence, Union

import jax

from jax_moe import api, backends
from jax_moe.config import MoEConfig
from jax_moe.contract import rows_per_peer
from jax_moe.types import CombineHandle, Dispatched, DispatchHandle

_ids = itertools.count(1)
FABRIC_PROVIDERS = ("auto", "tcp", "shm", "efa", "verbs")
FABRIC_MEMORIES = ("auto", "device", "host", "staged")


def _env_timeout() -> float:
    raw = os.environ.get("JAX_MOE_TIMEOUT_S")
    if raw is None:
        return 60.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"JAX_MOE_TIMEOUT_S={raw!r}: must be a positive number of seconds")
    return value


def _documented_by(fn: Any) -> Any:
    """Gives a Communicator method the docstring of the module function it calls."""
    def document(method: Any) -> Any:
        method.__doc__ = fn.__doc__
        return method
    return document


def _env_provider() -> str:
    raw = os.environ.get("JAX_MOE_FABRIC_PROVIDER", "auto")
    if raw not in FABRIC_PROVIDERS:
        raise ValueError(f"JAX_MOE_FABRIC_PROVIDER={raw!r}: must be one of {FABRIC_PROVIDERS}")
    return raw


def _env_ranks_per_node() -> Optional[int]:
    raw = os.environ.get("JAX_MOE_RANKS_PER_NODE")
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"JAX_MOE_RANKS_PER_NODE={raw!r}: must be a positive integer") from None


def _mesh_platform(mesh: Any) -> str:
    devices = getattr(mesh, "devices", None)
    try:
        return devices.flat[0].platform
    except (AttributeError, IndexError):
        return jax.default_backend()


class Communicator:
    """Dispatch/combine for `cfg` over the mesh axis (or tuple of axes) `axis_name`.

    Rank r of the N ranks on the axis owns experts [r*L, (r+1)*L), L = num_experts / N. The methods run per rank,
    inside jax.shard_map over `axis_name`.

    timeout_s: how long a native backend ("cpu", "cuda") waits for a peer before failing (default
      $JAX_MOE_TIMEOUT_S, else 60 s).
    fabric_provider: TransferEngine provider between processes ("auto", "tcp", "shm", "efa", "verbs"; default
      $JAX_MOE_FABRIC_PROVIDER or "auto").
    fabric_memory: "cuda" only: where the areas that ranks on other nodes write into live: "device" (GPU memory
      that the NIC reads and writes: efa or verbs with a libfabric built with CUDA; shm with such a libfabric, which
      copies it with CUDA on the proxy thread and so needs CUDA_MODULE_LOADING=EAGER; refused, saying why,
      elsewhere, see docs/cuda.md), "host" (pinned host memory
      the kernels read and write over PCIe), "staged" (pinned host memory on the wire, HBM for the kernels, a copy
      engine between them; needs CUDA_MODULE_LOADING=EAGER set before the process first uses CUDA, and says so
      otherwise), "auto" ("staged" where the process loads CUDA modules eagerly and command buffers are off, else
      "host"). Default $JAX_MOE_FABRIC_MEMORY, else "auto". `comm.backend.fabric_info()` says which was used and,
      for "auto", why ("fallback").
    ranks_per_node: "cuda" only: treat consecutive groups of this many ranks as one node (default
      $JAX_MOE_RANKS_PER_NODE, else one node per host). Ranks of one node reach each other over NVLink; ranks of
      other nodes through the host proxy and the TransferEngine (fabric_provider). For tests on one host, and for
      hosts whose GPUs are not NVLink-joined. It must divide the number of ranks.
    """

    def __init__(self, cfg: MoEConfig, mesh: Any, axis_name: Union[str, Sequence[str]] = "ep",
                 backend: str = "auto", *, timeout_s: Optional[float] = None,
                 fabric_provider: Optional[str] = None, ranks_per_node: Optional[int] = None,
                 fabric_memory: Optional[str] = None):
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"Communicator: cfg must be a jax_moe.MoEConfig, got {type(cfg).__name__}")
        names = getattr(mesh, "axis_names", None)
        shape = getattr(mesh, "shape", None)
        if names is None or shape is None:
            raise TypeError(f"Communicator: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        axes = (axis_name,) if isinstance(axis_name, str) else (
            tuple(axis_name) if isinstance(axis_name, (tuple, list)) else None)
        if not axes or not all(isinstance(a, str) for a in axes):
            raise TypeError(f"Communicator: axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
        for a in axes:
            if a not in names:
                raise ValueError(f"Communicator: axis {a!r} is not in the mesh (axes: {tuple(names)})")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ValueError(f"Communicator: timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if fabric_provider is not None and fabric_provider not in FABRIC_PROVIDERS:
            raise ValueError(f"Communicator: fabric_provider must be one of {FABRIC_PROVIDERS}, "
                             f"got {fabric_provider!r}")
        if fabric_memory is None:
            fabric_memory = os.environ.get("JAX_MOE_FABRIC_MEMORY") or "auto"
        if fabric_memory not in FABRIC_MEMORIES:
            raise ValueError(f"Communicator: fabric_memory must be one of {FABRIC_MEMORIES}, got {fabric_memory!r}"
                             " (from $JAX_MOE_FABRIC_MEMORY where not given)")
        if ranks_per_node is None:
            ranks_per_node = _env_ranks_per_node()
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"Communicator: ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        # One bound for every wait of every backend; the environment gives the default.
        self.timeout_s: float = float(timeout_s) if timeout_s is not None else _env_timeout()
        self.fabric_provider: str = fabric_provider if fabric_provider is not None else _env_provider()
        self.fabric_memory: str = fabric_memory
        self.cfg = cfg
        self.mesh = mesh
        self.axis_name: Union[str, tuple[str, ...]] = axis_name if isinstance(axis_name, str) else axes
        self.axes: tuple[str, ...] = axes  # the EP axes, always a tuple
        self.num_ranks = math.prod(int(shape[a]) for a in axes)
        if cfg.num_experts % self.num_ranks:
            raise ValueError(f"Communicator: num_experts ({cfg.num_experts}) is not divisible by the "
                             f"{self.num_ranks} ranks of axis {self.axis_name!r}")
        if ranks_per_node is not None and self.num_ranks % ranks_per_node:
            raise ValueError(f"Communicator: ranks_per_node={ranks_per_node} does not divide the {self.num_ranks} "
                             f"ranks of axis {self.axis_name!r}")
        self.ranks_per_node: Optional[int] = ranks_per_node
        self.num_local_experts = cfg.num_experts // self.num_ranks
        # The most rows one rank can send to one peer: each token reaches at most min(R, L) experts of a peer.
        self.rows_per_peer = rows_per_peer(cfg.max_tokens, cfg.experts_per_token, self.num_local_experts)
        self.id = next(_ids)
        self.platform = _mesh_platform(mesh)
        self.backend = backends.resolve(backend, self.platform)(self)

    @property
    def max_recv_rows(self) -> int:
        """Static row count of the dispatched buffer on each rank: N * max_tokens * min(R, L)."""
        return self.num_ranks * self.rows_per_peer

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def bytes_allocated(self) -> int:
        """Bytes of native buffers this process holds for this Communicator ("cpu": host memory; "cuda": on its GPUs;
        "xla": 0)."""
        return self.backend.bytes_allocated

    def errors(self) -> list[str]:
        """Reads and clears the errors the backend could not raise from a call: device errors of "cuda" in
        command-buffer mode (JAX_MOE_CUDA_COMMAND_BUFFERS=1); [] for the others. Call it after the results are
        ready."""
        return self.backend.errors()

    def __repr__(self) -> str:
        return (f"Communicator({self.cfg.describe()}, axis={self.axis_name!r}, ranks={self.num_ranks}, "
                f"backend={self.backend_name!r}, max_recv_rows={self.max_recv_rows})")

    # --- the API, as methods (each has its module function's docstring: help(comm.dispatch)) ---------------------
    @_documented_by(api.dispatch)
    def dispatch(self, x: jax.Array, topk_idx: jax.Array, x_scale: Optional[jax.Array] = None,
                 topk_weights: Optional[jax.Array] = None) -> Dispatched:
        return api.dispatch(self, x, topk_idx, x_scale, topk_weights)

    @_documented_by(api.combine)
    def combine(self, expert_y: jax.Array, topk_weights: Optional[jax.Array] = None,
                d: Optional[Dispatched] = None) -> jax.Array:
        return api.combine(self, expert_y, topk_weights, d)

    @_documented_by(api.dispatch_send)
    def dispatch_send(self, x: jax.Array, topk_idx: jax.Array, x_scale: Optional[jax.Array] = None,
                      topk_weights: Optional[jax.Array] = None) -> DispatchHandle:
        return api.dispatch_send(self, x, topk_idx, x_scale, topk_weights)

    @_documented_by(api.dispatch_recv)
    def dispatch_recv(self, handle: DispatchHandle) -> Dispatched:
        return api.dispatch_recv(self, handle)

    @_documented_by(api.combine_send)
    def combine_send(self, expert_y: jax.Array, d: Dispatched) -> CombineHandle:
        return api.combine_send(self, expert_y, d)

    @_documented_by(api.combine_recv)
    def combine_recv(self, handle: CombineHandle, topk_weights: Optional[jax.Array] = None) -> jax.Array:
        return api.combine_recv(self, handle, topk_weights)
