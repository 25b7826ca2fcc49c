"""Set-up shared by the native backends ("cpu", "cuda"): what they are built with, who runs which rank, and one
exchange between processes through jax.distributed's key-value store.

Every process publishes one record per Communicator: its config fingerprint, its host name and what the backend
needs its peers to know (engine addresses, buffer descriptors, CUDA IPC handles). A peer built with another config
fails at once with an error naming both configs, instead of waiting for keys it will never find; every wait is
bounded by the Communicator's timeout_s.
"""
from __future__ import annotations

import dataclasses
import json
import socket
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np
from jax_moe.backends.base import CommView

try:
    from jax._src import distributed as _distributed  # private: the only handle on the key-value store
except ImportError:  # pragma: no cover - a jax without it: one process only
    _distributed = None



@dataclasses.dataclass(frozen=True)
class NativeOptions:
    """What a native backend is built with. All fields but comm_id and timeout_s must agree on every process."""

    backend: str
    comm_id: int
    axes: tuple[str, ...]
    num_ranks: int
    num_experts: int
    local_experts: int
    experts_per_token: int
    hidden: int
    max_tokens: int
    x_itemsize: int  # bytes per dispatched channel (2 bf16, 1 fp8)
    num_scales: int  # float32 scales per dispatched row (0 for bf16)
    y_itemsize: int  # bytes per combined channel
    timeout_s: float
    fabric_provider: Optional[str]  # the TransferEngine's provider; None where the backend does not use it
    ranks_per_node: Optional[int] = None  # forced node size ("cuda"); None: one node per host
    fabric_memory: str = "auto"  # where "cuda"'s areas for remote ranks live: "auto", "device", "host", "staged"

    @classmethod
    def of(cls, comm: CommView, backend: str, uses_fabric: bool) -> "NativeOptions":
        cfg = comm.cfg
        return cls(backend=backend, comm_id=int(comm.id), axes=tuple(comm.axes), num_ranks=comm.num_ranks,
                   num_experts=cfg.num_experts, local_experts=comm.num_local_experts,
                   experts_per_token=cfg.experts_per_token, hidden=cfg.hidden, max_tokens=cfg.max_tokens,
                   x_itemsize=np.dtype(cfg.dispatch_dtype).itemsize, num_scales=cfg.num_scales,
                   y_itemsize=np.dtype(cfg.combine_dtype).itemsize, timeout_s=float(comm.timeout_s),
                   fabric_provider=comm.fabric_provider if uses_fabric else None,
                   ranks_per_node=getattr(comm, "ranks_per_node", None),
                   fabric_memory=getattr(comm, "fabric_memory", "auto"))

    @property
    def timeout_ms(self) -> int:
        return int(self.timeout_s * 1000)

    def shape(self) -> dict[str, int]:
        """The shape fields, as the native side's set-up reads them."""
        return dict(num_ranks=self.num_ranks, num_experts=self.num_experts, local_experts=self.local_experts,
                    experts_per_token=self.experts_per_token, hidden=self.hidden, max_tokens=self.max_tokens,
                    x_itemsize=self.x_itemsize, num_scales=self.num_scales)

    def fingerprint(self) -> str:
        """What every process must agree on, as text (compared, and printed when it differs)."""
        fields = dataclasses.asdict(self)
        for local in ("comm_id", "timeout_s"):
            del fields[local]
        return json.dumps(fields, sort_keys=True)


class RankEntry(NamedTuple):
    """One device of the mesh."""

    device_id: int
    process: int
    local_id: Optional[int]  # the device's local hardware id (GPU ordinal); None where the platform has none
    group: int               # the EP group: position on the mesh axes other than the EP axes
    rank: int                # position on the EP axes (row-major in the order of axis_name)


@dataclasses.dataclass(frozen=True)
class RankTable:
    """Every device of the mesh with its process, EP group and rank, in mesh order."""

    entries: tuple[RankEntry, ...]

    @classmethod
    def of(cls, mesh: Any, axes: tuple[str, ...]) -> "RankTable":
        names = tuple(mesh.axis_names)
        others = [a for a in names if a not in axes]
        devices = np.asarray(mesh.devices)
        entries = []
        for index in np.ndindex(devices.shape):
            coord = dict(zip(names, index))
            rank = int(np.ravel_multi_index([coord[a] for a in axes], [mesh.shape[a] for a in axes]))
            group = (int(np.ravel_multi_index([coord[a] for a in others], [mesh.shape[a] for a in others]))
                     if others else 0)
            d = devices[index]
            local_id = getattr(d, "local_hardware_id", None)
            entries.append(RankEntry(int(d.id), int(d.process_index), None if local_id is None else int(local_id),
                                     group, rank))
        return cls(tuple(entries))

    @property
    def processes(self) -> tuple[int, ...]:
        return tuple(sorted({e.process for e in self.entries}))

    def groups(self) -> list[list[RankEntry]]:
        """[group][rank]: the devices of each EP group in rank order."""
        out: dict[int, list[RankEntry]] = {}
        for e in sorted(self.entries, key=lambda e: (e.group, e.rank)):
            out.setdefault(e.group, []).append(e)
        return [out[g] for g in sorted(out)]

    def local(self, process: int) -> list[RankEntry]:
        """The devices of `process`, by group then rank."""
        return [e for group in self.groups() for e in group if e.process == process]


@dataclasses.dataclass(frozen=True)
class Peers:
    """What the other processes of the mesh published."""

    hosts: list[str]          # host name per process index ("" for processes outside the mesh)
    records: dict[int, Any]   # process -> its backend record; the other processes of the mesh only


def _client() -> Any:
    """jax.distributed's client (None before jax.distributed.initialize())."""
    return getattr(getattr(_distributed, "global_state", None), "client", None)


def _prefix(options: NativeOptions, stage: str = "") -> str:
    return f"jax_moe/{options.backend}/{options.comm_id}" + (f"/{stage}" if stage else "")


def nodes(group: list[RankEntry], hosts: list[str], ranks_per_node: Optional[int]) -> list[int]:
    """The node of each rank of an EP group (in rank order): consecutive blocks of `ranks_per_node` ranks when it is
    given, else one node per host (numbered in order of first appearance)."""
    if ranks_per_node is not None:
        return [e.rank // ranks_per_node for e in group]
    order: dict[str, int] = {}
    return [order.setdefault(hosts[e.process] if e.process < len(hosts) else "", len(order)) for e in group]


def _differences(theirs: str, mine: str) -> str:
    """The fields two fingerprints disagree on, for the error."""
    try:
        a, b = json.loads(theirs), json.loads(mine)
    except ValueError:
        return "unreadable"
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} here" for k in keys) or "format"


def exchange(options: NativeOptions, table: RankTable, record: Callable[[], Any], stage: str = "") -> Peers:
    """Publishes this process's record (`record()`, JSON-able; only called when the mesh spans processes) and reads
    every other process's. Raises at once if a peer built the Communicator with another config. `stage` names a
    later exchange of the same Communicator (every process of the mesh takes part in each)."""
    me = jax.process_index()
    host = socket.gethostname()
    hosts = [""] * (max(table.processes + (me,)) + 1)
    hosts[me] = host
    others = [p for p in table.processes if p != me]
    if not others:
        return Peers(hosts, {})
    client = _client()
    if client is None:
        raise RuntimeError(f"backend {options.backend!r} over several processes needs jax.distributed.initialize()")
    prefix, mine = _prefix(options, stage), options.fingerprint()
    client.key_value_set_bytes(f"{prefix}/{me}", json.dumps({"config": mine, "host": host,
                                                             "record": record()}).encode())
    records = {}
    for p in others:
        blob = json.loads(client.blocking_key_value_get_bytes(f"{prefix}/{p}", options.timeout_ms))
        if blob["config"] != mine:
            raise ValueError(f"backend {options.backend!r}, Communicator {options.comm_id}: process {p} built it "
                             f"with another config ({_differences(blob['config'], mine)}):\n"
                             f"  process {p}: {blob['config']}\n  process {me}: {mine}")
        hosts[p] = str(blob.get("host", ""))
        records[p] = blob["record"]
    return Peers(hosts, records)


def barrier(options: NativeOptions, name: str) -> None:
    """Waits (bounded by timeout_s) until every process has reached barrier `name` of this Communicator."""
    client = _client()
    if client is None:
        raise RuntimeError(f"backend {options.backend!r} over several processes needs jax.distributed.initialize()")
    client.wait_at_barrier(f"{_prefix(options)}/{name}", options.timeout_ms)
