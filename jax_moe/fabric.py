"""TransferEngine: one-sided RDMA writes with 32-bit immediates between processes.

Backed by libfabric (providers ``efa``, ``tcp``, ``shm``) or libibverbs, implemented in C++
(``src/fabric``, design in ``docs/fabric.md``). Every process::

    from jax_moe import fabric
    eng = fabric.TransferEngine(provider="tcp")
    buf = np.zeros(1 << 20, np.uint8)
    mr = eng.register(buf)
    # exchange eng.address() and mr.descriptor() out of band, then
    peer = eng.connect(other_address)
    ps = eng.peer_set([peer], [other_descriptor])
    eng.scatter(ps, mr, src_offsets, lengths, dst_offsets, imm=1)   # int64 arrays, one entry per peer
    eng.wait_imm(1, count=1, timeout_s=10)   # the peer's write into *our* buffer landed
    eng.wait_sends(timeout_s=10)             # our writes completed; buf may be reused

Immediates are 32-bit user values (`TransferEngine.max_imm`; only a provider with 4-byte CQ data and
no FI_SOURCE limits them to 20 bits).
Errors: ValueError for bad input (nothing posted), TimeoutError when a wait expires (the message
names the peers that did not answer), ConnectionError when a peer failed, RuntimeError otherwise.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jax_moe import _core

_f = _core.fabric

MAX_IMM: int = int(_f.MAX_IMM)
MAX_PEERS: int = int(_f.MAX_PEERS)

__all__ = ["TransferEngine", "MemoryRegion", "MAX_IMM", "MAX_PEERS"]


class MemoryRegion:
    """A registered buffer. Keeps the registered object alive while the region is in use."""

    def __init__(self, region, owner, engine: "TransferEngine"):
        self._region = region
        self._owner = owner  # the numpy array (or None for raw pointers)
        self._engine = engine

    def descriptor(self) -> bytes:
        """Bytes a peer passes to peer_set()/write() to write into this region."""
        return self._region.descriptor()

    @property
    def nbytes(self) -> int:
        return int(self._region.nbytes)

    @property
    def ptr(self) -> int:
        return int(self._region.ptr)

    @property
    def device(self) -> int:
        return int(self._region.device)

    @property
    def registration(self) -> str:
        """How the engine registered the memory (host, or GPU memory through a dmabuf or the provider's own path)."""
        return str(self._region.registration)

    def __repr__(self) -> str:
        return f"MemoryRegion(ptr=0x{self.ptr:x}, nbytes={self.nbytes}, device={self.device})"


def _offsets(name: str, values, n: Optional[int] = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim == 0:
        raise ValueError(f"{name} must be a 1-D array of integers, got a scalar")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers (int64), got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries but the peer set has {n} members")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name} holds a negative value ({int(arr.min())})")
    return arr


def _imm(imm, allow_none: bool, max_imm: int = MAX_IMM) -> Optional[int]:
    if imm is None:
        if allow_none:
            return None
        raise ValueError("imm is required")
    if isinstance(imm, (bool, np.bool_)) or not isinstance(imm, (int, np.integer)):
        raise ValueError(f"imm must be an int, got {type(imm).__name__}")
    imm = int(imm)
    if not 0 <= imm <= max_imm:
        raise ValueError(f"imm must be in [0, {max_imm}], got {imm}")
    return imm


def _timeout(timeout_s) -> float:
    t = float(timeout_s)
    if not t >= 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
    return t


class TransferEngine:
    """RDMA engine: register memory, connect peers, write/scatter/barrier with immediates.

    provider: "auto" (efa, then verbs, then tcp, then shm), "efa", "verbs", "tcp" or "shm".
    num_nics: domains to open; a peer set's members are sharded over them.
    fake_device_memory: tests without a GPU: register_ptr(..., device=k) takes host memory and carries it as a
      device region (its `registration` says so), so that the paths for device regions run on CPU.
    host_memory_only: never ask the provider for GPU memory (FI_HMEM): shm then keeps its single-copy path between
      processes, which it turns off for every transfer once FI_HMEM is granted; device memory is refused.
    """

    def __init__(self, provider: str = "auto", num_nics: int = 1, *, progress_cpu: int = -1,
                 busy_poll: bool = False, fake_device_memory: bool = False, host_memory_only: bool = False):
        if not isinstance(provider, str):
            raise ValueError("provider must be a string")
        if int(num_nics) < 1:
            raise ValueError(f"num_nics must be >= 1, got {num_nics}")
        self._eng = _f.Engine(provider, int(num_nics), int(progress_cpu), bool(busy_poll), bool(fake_device_memory),
                              bool(host_memory_only))
        self._peer_sets: dict[int, int] = {}  # peer set id -> member count
        self._max_imm = int(self._eng.max_imm)
        self._closed = False

    # -- identity ---------------------------------------------------------------------------------
    def address(self) -> bytes:
        """This engine's address (bytes); peers pass it to connect()."""
        return self._eng.address()

    @property
    def provider(self) -> str:
        return self._eng.provider

    @property
    def num_nics(self) -> int:
        return int(self._eng.num_nics)

    @property
    def supports_device_memory(self) -> bool:
        """Whether the provider granted FI_HMEM (or this engine fakes device memory); a registration of CUDA memory
        can still be refused (a libfabric built without CUDA), with a RuntimeError saying so."""
        return bool(self._eng.supports_device_memory)

    @property
    def max_imm(self) -> int:
        """Largest immediate value this engine's provider carries (2**32 - 1 except packed mode)."""
        return self._max_imm

    # -- memory -----------------------------------------------------------------------------------
    def register(self, array) -> MemoryRegion:
        """Register a writable, C-contiguous numpy array (host memory)."""
        if not isinstance(array, np.ndarray):
            raise ValueError(f"register() takes a numpy.ndarray, got {type(array).__name__}"
                             " (use register_ptr() for raw or device memory)")
        if not array.flags.c_contiguous:
            raise ValueError("register(): array must be C-contiguous")
        if not array.flags.writeable:
            raise ValueError("register(): array is read-only (peers write into registered memory)")
        if array.nbytes == 0:
            raise ValueError("register(): array is empty")
        region = self._eng.register_ptr(int(array.ctypes.data), int(array.nbytes), -1)
        return MemoryRegion(region, array, self)

    def register_ptr(self, ptr: int, nbytes: int, device: int = -1, dmabuf_fd: int = -1,
                     dmabuf_offset: int = 0) -> MemoryRegion:
        """Register raw memory: a host pointer (device=-1) or CUDA device memory (device >= 0), optionally through a
        dmabuf of it (`dmabuf_fd` >= 0, `ptr` at `dmabuf_offset` in it) where the provider takes one."""
        ptr, nbytes, device, dmabuf_fd, dmabuf_offset = int(ptr), int(nbytes), int(device), int(dmabuf_fd), \
            int(dmabuf_offset)
        if ptr <= 0:
            raise ValueError("register_ptr(): null pointer")
        if nbytes <= 0:
            raise ValueError("register_ptr(): nbytes must be > 0")
        if dmabuf_fd >= 0 and device < 0:
            raise ValueError("register_ptr(): a dmabuf_fd is for device memory (device >= 0)")
        if dmabuf_offset < 0:
            raise ValueError(f"register_ptr(): dmabuf_offset is negative ({dmabuf_offset})")
        return MemoryRegion(self._eng.register_ptr(ptr, nbytes, device, dmabuf_fd, dmabuf_offset), None, self)

    # -- peers ------------------------------------------------------------------------------------
    def connect(self, address: bytes, timeout_s: float = 30.0) -> int:
        """Handshake with the engine at `address`; returns its peer id (idempotent)."""
        if not isinstance(address, (bytes, bytearray, memoryview)):
            raise ValueError("connect(): address must be bytes (from TransferEngine.address())")
        return int(self._eng.connect(bytes(address), _timeout(timeout_s)))

    def peer_set(self, peers: Sequence[int], descriptors: Sequence[bytes]) -> int:
        """An ordered set of peers with one remote region descriptor each; returns a peer set id."""
        peers = [int(p) for p in peers]
        descriptors = list(descriptors)
        if len(peers) != len(descriptors):
            raise ValueError(f"peer_set(): {len(peers)} peers but {len(descriptors)} descriptors")
        for i, d in enumerate(descriptors):
            if not isinstance(d, (bytes, bytearray, memoryview)):
                raise ValueError(f"peer_set(): descriptor {i} must be bytes")
        ps = int(self._eng.peer_set(peers, [bytes(d) for d in descriptors]))
        self._peer_sets[ps] = len(peers)
        return ps

    def destroy_peer_set(self, ps: int) -> None:
        """Forgets peer set `ps` (its id is never reused); its writes still in flight complete as usual."""
        self._set_size(ps)
        self._eng.destroy_peer_set(int(ps))
        del self._peer_sets[int(ps)]

    # -- transfers --------------------------------------------------------------------------------
    def _region(self, mr) -> object:
        if not isinstance(mr, MemoryRegion) or mr._engine is not self:
            raise ValueError("expected a MemoryRegion registered with this engine")
        return mr._region

    def _set_size(self, ps) -> int:
        if int(ps) not in self._peer_sets:
            raise ValueError(f"unknown peer set {ps}")
        return self._peer_sets[int(ps)]

    def scatter(self, ps: int, mr: MemoryRegion, src_offsets, lengths, dst_offsets, imm) -> None:
        """One write per member i of peer set `ps`: mr[src_offsets[i] : +lengths[i]] -> member i at dst_offsets[i].

        Every member's write carries `imm` (also when its length is 0).
        """
        n = self._set_size(ps)
        region = self._region(mr)
        src = _offsets("src_offsets", src_offsets, n)
        ln = _offsets("lengths", lengths, n)
        dst = _offsets("dst_offsets", dst_offsets, n)
        self._eng.scatter(int(ps), region, src, ln, dst, _imm(imm, True, self._max_imm))

    def barrier(self, ps: int, imm: int) -> None:
        """A zero-byte write with immediate `imm` to every member of peer set `ps`."""
        self._set_size(ps)
        self._eng.barrier(int(ps), _imm(imm, False, self._max_imm))

    def write(self, peer: int, mr: MemoryRegion, src_offset: int, length: int, descriptor: bytes,
              dst_offset: int, imm: Optional[int] = None) -> None:
        """One write of mr[src_offset : +length] to the peer's region `descriptor` at dst_offset."""
        region = self._region(mr)
        for name, v in (("src_offset", src_offset), ("length", length), ("dst_offset", dst_offset)):
            if int(v) < 0:
                raise ValueError(f"write(): {name} is negative ({v})")
        if not isinstance(descriptor, (bytes, bytearray, memoryview)):
            raise ValueError("write(): descriptor must be bytes")
        self._eng.write(int(peer), region, int(src_offset), int(length), bytes(descriptor), int(dst_offset),
                        _imm(imm, True, self._max_imm))

    # -- waits ------------------------------------------------------------------------------------
    def wait_imm(self, imm: int, count: int, timeout_s: float = 30.0) -> None:
        """Wait until `count` immediates `imm` arrived and consume them.

        Surplus immediates (e.g. a fast peer's next round) stay counted for the next wait.
        Raises TimeoutError naming the peers that sent none.
        """
        if int(count) < 0:
            raise ValueError("wait_imm(): count must be >= 0")
        self._eng.wait_imm(_imm(imm, False, self._max_imm), int(count), _timeout(timeout_s))

    def wait_imm_from(self, imm: int, peers: Sequence[int], timeout_s: float = 30.0) -> None:
        """Wait for one immediate `imm` from each of `peers` (exact per-peer accounting)."""
        self._eng.wait_imm_from(_imm(imm, False, self._max_imm), [int(p) for p in peers], _timeout(timeout_s))

    def wait_sends(self, timeout_s: float = 30.0) -> None:
        """Wait until every write this engine posted has completed (source buffers reusable)."""
        self._eng.wait_sends(_timeout(timeout_s))

    # -- misc -------------------------------------------------------------------------------------
    def sends_in_flight(self, peer_set: Optional[int] = None) -> int:
        """Writes posted and not yet completed: all of them, or those posted through `peer_set`."""
        if peer_set is not None:
            self._set_size(peer_set)
            return int(self._eng.sends_in_flight(int(peer_set)))
        return int(self._eng.sends_in_flight())

    def discard_imms(self, mask: int, value: int) -> int:
        """Drops every banked immediate v with v & mask == value; returns how many were dropped."""
        return int(self._eng.discard_imms(int(mask) & 0xFFFFFFFF, int(value) & 0xFFFFFFFF))

    def peers(self) -> list:
        return list(self._eng.peers())

    def stats(self) -> dict:
        return dict(self._eng.stats())

    def close(self) -> None:
        """Stop the progress thread and release all resources (idempotent)."""
        if not self._closed:
            self._closed = True
            self._eng.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
