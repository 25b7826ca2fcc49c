// TransferEngine: one-sided RDMA writes with 32-bit immediates between processes, over libfabric
// (efa, tcp, shm) or libibverbs. This is the API the host proxy and the Python binding use.
//
// Typical use (every process):
//   EngineOptions opt;
//   opt.provider = "tcp";
//   TransferEngine eng(opt);
//   auto mr = eng.Register(buf, nbytes);                 // host memory (device >= 0: CUDA memory)
//   publish(eng.Address(), mr->descriptor().Serialize()); // out of band (files, a store, MPI...)
//   PeerId p = eng.Connect(peer_address, /*timeout_s=*/30);   // blocking handshake
//   PeerSetId s = eng.CreatePeerSet({p, q}, {RegionDescriptor::Parse(dp), RegionDescriptor::Parse(dq)});
//   eng.Scatter(s, *mr, src_offsets, lengths, dst_offsets, /*n=*/2, /*imm=*/7);  // one write per member
//   eng.WaitImmFrom(7, {p, q}, /*timeout_s=*/5);         // p's and q's writes to *us* landed
//   eng.WaitSends(5);                                    // our own writes completed: buffer reusable
//
// Semantics
// - Immediates: the receiver of a write with imm v gets v counted once the data is in its memory.
//   v is any 32-bit value (max_imm(); only a provider with 4-byte CQ data and no FI_SOURCE limits it
//   to 20 bits, see imm.h). WaitImm(v, k) consumes k of them from anyone; surplus stays banked (a
//   fast peer's next round is not lost). WaitImmFrom(v, peers) needs one from each listed peer: use
//   it (or a different v per round) when the same peers send v every round.
// - Ordering: none between writes, even to the same peer. Use an immediate per write that matters.
// - Threads: all methods are thread-safe. Posting is asynchronous: the calling thread validates and
//   patches templates, then hands the batch to the engine's progress thread (a mutex-guarded vector
//   swap). Buffers must stay untouched until WaitSends() returns.
// - Safety: every write is bounds-checked against the local region and the remote descriptor before
//   it is posted (Error kInvalidArgument). A descriptor must come from the peer it is used with, and
//   that peer confirms it names a live registration (one round trip at its first use, then cached).
// - Failure: every wait takes a timeout and throws Error(kTimeout) naming the peers that did not
//   answer; a transfer error marks the peer failed and later operations on it throw kPeerFailed.
#pragma once
#include <cstdint>
#include <map>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fabric/descriptor.h"
#include "fabric/imm.h"
#include "fabric/memory.h"

namespace jax_moe::fabric {

using PeerId = uint32_t;
using PeerSetId = uint32_t;

struct EngineOptions {
  std::string provider = "auto";  // "auto" (efa, verbs, tcp, shm), "efa", "verbs", "tcp", "shm"
  int num_nics = 1;               // domains opened; a peer set's members are sharded over them
  int progress_cpu = -1;          // pin the progress thread to this core (-1: no pinning)
  std::vector<int> progress_cpus;  // else keep it on these cores (a NUMA node's), when not empty
  bool busy_poll = false;         // never nap when idle (lowest latency, burns a core)
  // Tests without a GPU: device-memory registrations are taken as host memory (Registration::kFakeDevice), so the
  // paths that carry device regions run on CPU. Never set for real CUDA memory.
  bool fake_device_memory = false;
  // Never ask the provider for FI_HMEM: only host memory will be registered. shm then keeps its single-copy path
  // between processes (CMA), which it turns off for every transfer once FI_HMEM is granted.
  bool host_memory_only = false;
  // PCI bus id of the GPU this engine serves ("0000:18:00.0", cudaDeviceGetPCIBusId's form): the NICs nearest it on
  // the PCIe tree are opened first, so each GPU of a node sends through its own NICs. Empty: enumeration order.
  std::string pci_bus_id;
};

class EngineCore;

// A registered buffer. Deregisters itself when the last reference goes; call WaitSends() first if
// writes from it may still be in flight.
class MemoryRegion {
 public:
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  void* data() const { return ptr_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }
  Registration registration() const { return how_; }
  // What peers need to write into this region (send Serialize() to them).
  const RegionDescriptor& descriptor() const { return descriptor_; }

 private:
  friend class EngineCore;
  MemoryRegion() = default;
  std::weak_ptr<EngineCore> core_;
  uint64_t id_ = 0;
  void* ptr_ = nullptr;
  uint64_t size_ = 0;
  int device_ = -1;
  Registration how_ = Registration::kHost;
  RegionDescriptor descriptor_;
};

struct PeerInfo {
  PeerId id;
  std::string label;  // "peer 3 (tcp 10.0.0.2:41234)"
  int nic;            // local NIC carrying this peer's writes
  bool failed;
  std::string failure;
};

struct EngineStats {
  uint64_t writes_posted = 0;
  uint64_t writes_completed = 0;
  uint64_t write_errors = 0;
  std::vector<uint64_t> imms_per_nic;  // immediates received on each NIC
  uint64_t notices_apart = 0;          // writes posted as their bytes, then a zero-byte notice (ofi/notice_apart.h)
  // The progress thread: passes made, and ns spent in them (naps excluded), in all and per phase.
  uint64_t progress_passes = 0;
  double progress_ns = 0, poll_ns = 0, hooks_ns = 0, post_ns = 0;
  double longest_poll_ns = 0, longest_hooks_ns = 0, longest_post_ns = 0;  // the longest single phase of a pass
};

class TransferEngine {
 public:
  explicit TransferEngine(const EngineOptions& options = {});
  ~TransferEngine();  // Close()
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Serialized engine address (every NIC's endpoint); give it to peers for Connect().
  std::string Address() const;
  std::string provider() const;
  int num_nics() const;
  uint32_t max_imm() const;  // largest immediate value this provider carries

  std::shared_ptr<MemoryRegion> Register(void* ptr, uint64_t nbytes, int device = -1);
  // Device memory, optionally with a dmabuf of it (see MemorySpec). Throws kUnavailable when this provider cannot
  // register it (no FI_HMEM, or a libfabric built without CUDA); the message says which.
  std::shared_ptr<MemoryRegion> Register(void* ptr, uint64_t nbytes, const MemorySpec& mem);
  // Whether Register may be given device memory at all (it can still refuse a registration, see above).
  bool supports_device_memory() const;

  // Handshake with the engine at `address` (idempotent; a peer that connected to us first is
  // returned without a round trip). Throws kTimeout / kPeerFailed / kInvalidArgument.
  PeerId Connect(const std::string& address, double timeout_s = 30.0);

  // Fixes an ordered member list and one remote region per member; write templates are built here.
  // Member i writes through local NIC i % num_nics(). Verifies unseen descriptors with their owners
  // (30 s bound; kTimeout names silent owners, kInvalidArgument a rejected descriptor).
  PeerSetId CreatePeerSet(const std::vector<PeerId>& peers, const std::vector<RegionDescriptor>& regions);
  size_t PeerSetSize(PeerSetId set) const;
  // Forgets a peer set (its id is never reused); writes of it still in flight complete as usual.
  void DestroyPeerSet(PeerSetId set);

  // One write per member i: src[src_offsets[i], +lengths[i]) -> member i's region at dst_offsets[i].
  // Zero-length entries still carry the immediate (a "nothing for you" signal) when imm is set.
  void Scatter(PeerSetId set, const MemoryRegion& src, const uint64_t* src_offsets, const uint64_t* lengths,
               const uint64_t* dst_offsets, size_t n, std::optional<uint32_t> imm);
  // A zero-byte write with immediate `imm` to every member.
  void Barrier(PeerSetId set, uint32_t imm);
  // counted_in: also count the write in that peer set's writes in flight (SendsInFlight(set)), for a user that
  // writes to a member of its set one by one.
  void Write(PeerId peer, const MemoryRegion& src, uint64_t src_offset, uint64_t length,
             const RegionDescriptor& dst, uint64_t dst_offset, std::optional<uint32_t> imm,
             std::optional<PeerSetId> counted_in = std::nullopt);

  // Waits until `count` immediates `imm` arrived (from anyone) and consumes them.
  void WaitImm(uint32_t imm, uint64_t count, double timeout_s);
  // Waits until each peer in `peers` delivered one immediate `imm` and consumes one from each.
  void WaitImmFrom(uint32_t imm, const std::vector<PeerId>& peers, double timeout_s);
  // Waits until every write posted so far completed; throws naming peers whose writes failed or hang.
  void WaitSends(double timeout_s);

  // Non-blocking forms for a proxy loop that multiplexes several conditions:
  // consume `count` immediates `imm` if they are all banked (true), else leave everything (false).
  bool TryConsumeImm(uint32_t imm, uint64_t count);
  uint64_t BankedImm(uint32_t imm) const;  // immediates `imm` arrived and not yet consumed
  uint64_t SendsInFlight() const;          // writes posted and not yet completed
  uint64_t SendsInFlight(PeerSetId set) const;  // the same, of the writes posted through `set`
  // Drops every banked immediate v with (v & mask) == value; returns how many. For a user of a shared engine that
  // goes: what its peers still send it must not be counted by a later user of the same values.
  uint64_t DiscardImms(uint32_t mask, uint32_t value);
  // Runs `hook` on the progress thread at every pass (it returns whether it did work, which keeps the thread hot),
  // so that a proxy posts and polls on the engine's own thread: no hand-off between threads on its data path. Several
  // proxies may share one engine, each with its hook; they run in the order they were added. A hook may call Scatter
  // and Barrier on peer sets, Write to a peer set's already verified regions, TryConsumeImm and SendsInFlight: never
  // a call that waits, nor one that may verify a new descriptor (it would wait for this very thread), nor
  // Add/RemoveProgressHook. After RemoveProgressHook returns, that hook is not running and never runs again.
  uint64_t AddProgressHook(std::function<bool()> hook);
  void RemoveProgressHook(uint64_t id);

  std::vector<PeerInfo> Peers() const;
  EngineStats Stats() const;
  // Stops the progress thread and releases every resource; later calls throw kClosed. Idempotent.
  void Close();

 private:
  std::shared_ptr<EngineCore> core_;
};

}  // namespace jax_moe::fabric
