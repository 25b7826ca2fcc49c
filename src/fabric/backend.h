// What the engine needs from a transport (libfabric or ibverbs). Every method is called from the
// engine's progress thread only, so backends need no locking (FI_THREAD_DOMAIN / one PD per thread).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fabric/imm.h"
#include "fabric/memory.h"

namespace jax_moe::fabric {

// Storage the provider may use while an operation is in flight (fi_context2 / wr_id target). The
// engine embeds it as the first member of its per-operation context.
struct alignas(16) OpContextStorage {
  void* words[8];
};

// One registered region, per NIC: the key peers use and the local descriptor writes need.
struct BackendRegion {
  virtual ~BackendRegion() = default;
  std::vector<uint64_t> keys;   // remote keys, one per NIC
  std::vector<void*> descs;     // local descriptors (fi_mr_desc / lkey), one per NIC
  Registration how = Registration::kHost;
};

// A write ready to post. Built from a peer set's template and patched per call (see peer_set.h).
struct WriteRequest {
  void* context = nullptr;  // OpContextStorage* returned in the completion
  uint64_t dest = 0;        // peer handle from AddPeer on this NIC
  const void* local = nullptr;
  uint64_t length = 0;
  void* local_desc = nullptr;
  uint64_t remote_addr = 0;  // virtual address or offset, as remote_virt_addr() says
  uint64_t rkey = 0;
  bool has_imm = false;
  uint32_t imm = 0;             // user value
  uint32_t sender_peer_id = 0;  // the peer id the receiver knows us by (encoded as imm_mode() says)
  bool host_to_host = false;    // both ends are host memory (neither registered as GPU memory)
};

struct Completion {
  enum Kind { kWriteDone, kSendDone, kRecvDone, kImm, kError };
  Kind kind = kError;
  void* context = nullptr;  // WriteRequest::context / send / recv context; null for kImm
  uint64_t length = 0;      // bytes received (kRecvDone)
  uint32_t imm = 0;         // user value (kImm), already decoded
  uint32_t peer = 0;        // sender's engine peer id (kImm), kUnknownPeer if it cannot be told
  std::string error;        // kError: provider text
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string provider() const = 0;
  virtual int num_nics() const = 0;
  virtual std::string NicAddress(int nic) const = 0;
  // Human-readable form of a peer NIC address, for error messages.
  virtual std::string FormatAddress(int nic, const std::string& raw) const = 0;
  // Whether remote addresses are virtual addresses (FI_MR_VIRT_ADDR / verbs) or offsets into the region.
  virtual bool remote_virt_addr() const = 0;
  virtual uint64_t max_write_bytes() const = 0;
  // Whether the transport may take CUDA memory (FI_HMEM asked and granted / verbs). A registration can still be
  // refused (a libfabric built without CUDA): Register then throws kUnavailable.
  virtual bool supports_device_memory() const = 0;
  // How the sender is identified (imm.h); decides the largest user immediate.
  virtual ImmMode imm_mode() const = 0;
  uint32_t max_imm() const { return imm_mode() == ImmMode::kPacked ? kMaxPackedImm : kMaxWideImm; }
  // Writes posted as their bytes, then a zero-byte notice (ofi/notice_apart.h).
  virtual uint64_t notices_apart() const { return 0; }

  // Throws kUnavailable when the transport cannot register this kind of memory, naming why.
  virtual std::unique_ptr<BackendRegion> Register(void* ptr, uint64_t nbytes, const MemorySpec& mem) = 0;
  // Makes engine peer `peer`'s NIC address reachable from local NIC `nic`; returns the handle used in
  // WriteRequest::dest and PostSend.
  virtual uint64_t AddPeer(int nic, uint32_t peer, const std::string& raw_address) = 0;
  // Transport connection data exchanged in the handshake (verbs: RC QPs). Empty for libfabric RDM.
  virtual std::string LocalConnectBlob(uint32_t peer) { return {}; }
  virtual void AcceptConnectBlob(uint32_t peer, const std::string& blob) {}

  // Post writes in order; returns how many were accepted (the rest hit a full queue: retry later).
  virtual size_t PostWrites(int nic, const WriteRequest* writes, size_t n) = 0;
  // Small control message to a peer handle; false when the queue is full. `bootstrap` marks hello/ack,
  // which must not depend on the connection they set up (verbs sends them over UD, the rest over RC).
  virtual bool PostSend(int nic, uint64_t dest, const void* buf, size_t len, void* context, bool bootstrap) = 0;
  virtual void PostRecv(int nic, void* buf, size_t len, void* context) = 0;
  // Appends up to `max` completions of NIC `nic`; returns how many it handled (appended, and any the backend
  // consumed itself: nonzero means progress).
  virtual size_t Poll(int nic, std::vector<Completion>* out, size_t max) = 0;
};

// Opens the backend named by `provider` ("auto", "efa", "verbs", "tcp", "shm", "ibverbs") with `num_nics`
// domains. With `pci_bus_id` (the GPU the engine serves) the NICs nearest that GPU on the PCIe tree are opened first
// (nic_topology.h); empty: enumeration order. Throws Error(kUnavailable) when it cannot.
std::unique_ptr<Backend> OpenBackend(const std::string& provider, int num_nics, const std::string& pci_bus_id = "",
                                     bool host_memory_only = false);

}  // namespace jax_moe::fabric
