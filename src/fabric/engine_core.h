// Internals of TransferEngine: the engine's shared state and methods. Not a public header.
// The methods live in one file per concern:
//   engine_core.cc       lifecycle: open, close, running a call on the progress thread; peers and stats
//   engine_register.cc   memory registration
//   engine_handshake.cc  peer table, handshake, descriptor checks with their owners, peer failure
//   engine_post.cc       peer sets, Scatter/Write validation, posting the backlog
//   engine_progress.cc   progress thread: submissions, completions, and the waits on them
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/format.h"
#include "fabric/backend.h"
#include "fabric/imm_counter.h"
#include "fabric/pass_profile.h"
#include "fabric/peer_set.h"
#include "fabric/transfer_engine.h"
#include "fabric/wire.h"

namespace jax_moe::fabric {

// The engine whose progress thread this is (null elsewhere): what its hooks submit goes straight into its backlog,
// with no lock and no hand-off.
inline thread_local const class EngineCore* progress_owner = nullptr;

// Completion state of a call run on the progress thread (RunOnProgress).
struct CallState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

inline std::string FormatSeconds(double s) { return Format("%.3g s", s); }

// Per-operation context handed to the provider; recycled through a free list on the progress thread.
struct OpContext {
  OpContextStorage storage;  // must stay first: providers write into it
  enum Kind { kWrite, kSend, kRecv } kind = kWrite;
  uint32_t peer = 0;
  int nic = 0;
  std::string buffer;  // message bytes for kSend / kRecv
  std::shared_ptr<std::atomic<int64_t>> set_in_flight;  // kWrite through a peer set: that set's count
};

struct PeerState {
  uint32_t id = 0;
  uint64_t nonce = 0;
  std::string address;  // serialized EngineAddress
  std::string label;
  std::vector<uint64_t> dest;   // handle per local NIC
  int nic = 0;                  // local NIC used for this peer's writes
  int remote_nic = 0;           // the peer's NIC those writes land on
  int remote_num_nics = 1;
  uint32_t remote_peer_id = 0;  // what the peer calls us (stamped into immediates)
  bool ready = false;           // handshake done
  std::atomic<bool> failed{false};
  std::string failure;          // guarded by EngineCore::mu_
  std::atomic<int64_t> in_flight{0};
};

class EngineCore : public std::enable_shared_from_this<EngineCore> {
 public:
  explicit EngineCore(const EngineOptions& options);
  ~EngineCore();
  void Start();
  void Close();
  void CheckOpen() const;  // throws kClosed
  void CheckImm(uint64_t imm) const;  // throws kInvalidArgument
  uint32_t max_imm() const { return caps_.max_imm; }

  const std::string& address() const { return address_; }
  Backend& backend() { return *backend_; }
  int num_nics() const { return num_nics_; }

  std::shared_ptr<MemoryRegion> Register(void* ptr, uint64_t nbytes, const MemorySpec& mem);
  bool supports_device_memory() const { return caps_.device_memory; }
  void Deregister(uint64_t id);
  uint32_t Connect(const std::string& address, double timeout_s);
  uint32_t CreatePeerSet(const std::vector<uint32_t>& peers, const std::vector<RegionDescriptor>& regions);
  size_t PeerSetSize(uint32_t set) const;
  void DestroyPeerSet(uint32_t set);
  uint64_t SendsInFlight(uint32_t set) const;
  // src == nullptr with zero_byte: a barrier.
  void Scatter(uint32_t set, const MemoryRegion* src, const uint64_t* src_offsets, const uint64_t* lengths,
               const uint64_t* dst_offsets, size_t n, std::optional<uint32_t> imm, bool zero_byte);
  void Write(uint32_t peer, const MemoryRegion& src, uint64_t src_offset, uint64_t length,
             const RegionDescriptor& dst, uint64_t dst_offset, std::optional<uint32_t> imm,
             std::optional<uint32_t> counted_in = std::nullopt);
  void WaitImm(uint32_t imm, uint64_t count, double timeout_s);
  void WaitImmFrom(uint32_t imm, const std::vector<uint32_t>& peers, double timeout_s);
  void WaitSends(double timeout_s);
  bool TryConsumeImm(uint32_t imm, uint64_t count) {
    CheckOpen();
    CheckImm(imm);
    return imms_.TryConsume(imm, count);
  }
  uint64_t BankedImm(uint32_t imm) const { return imms_.Banked(imm); }
  uint64_t DiscardImms(uint32_t mask, uint32_t value) { return imms_.Discard(mask, value); }
  std::vector<PeerInfo> Peers() const;
  EngineStats Stats() const;
  uint64_t AddProgressHook(std::function<bool()> hook);
  void RemoveProgressHook(uint64_t id);

 private:
  struct RegionEntry {
    std::unique_ptr<BackendRegion> region;
    RegionDescriptor descriptor;
  };
  struct VerifyRequest {
    uint32_t peer = 0;
    bool done = false;
    std::string rejection;  // empty when the owner confirmed the descriptor
  };
  struct PendingWrite {
    WriteRequest req;  // req.context is attached on the progress thread just before posting
    int nic;
    uint32_t peer;
    std::shared_ptr<std::atomic<int64_t>> set_in_flight;  // through a peer set: its count
    std::shared_ptr<std::atomic<bool>> set_gone;           // and whether it was destroyed since
  };
  struct PendingCall {
    std::function<void()> fn;
    std::shared_ptr<CallState> state;
  };
  struct PendingSend {
    int nic;
    uint64_t dest;
    OpContext* op;
    bool bootstrap;  // hello/ack
  };

  // engine_core.cc
  // Runs `fn` on the progress thread and waits for it (registration, AV inserts). Rethrows its error.
  void RunOnProgress(std::function<void()> fn);
  const PeerSet& PeerSetLocked(uint32_t set) const;  // throws kInvalidArgument for an unknown or destroyed set

  // engine_handshake.cc
  PeerState& FindOrAddPeerLocked(const EngineAddress& addr, const std::string& raw);  // progress thread
  void SendHandshake(PeerState& peer, Handshake::Type type);
  void SendControl(uint32_t peer, Handshake::Type type, uint32_t id, const std::string& blob);  // progress thread
  void ResendHellos();
  void OnMessage(int nic, const std::string& bytes);
  // Asks each descriptor's owner to confirm it names a live region (cached per peer). Throws
  // kInvalidArgument naming the descriptor the owner rejected, kTimeout naming owners that did not answer.
  void VerifyDescriptors(const std::vector<uint32_t>& peers, const std::vector<RegionDescriptor>& regions);
  std::string CheckOwnDescriptor(const std::string& bytes) const;  // "" when valid; takes mu_
  void FailPeer(uint32_t peer, const std::string& why);
  std::string PeerLabel(uint32_t peer) const;  // takes mu_
  std::string PeerListLocked(const std::vector<uint32_t>& peers) const;

  // engine_post.cc
  void Submit(std::vector<PendingWrite>&& writes);
  bool PostPending();  // progress thread

  // engine_progress.cc (progress thread)
  void ProgressLoop();
  bool DrainSubmissions();
  bool PollAll();
  void OnCompletion(int nic, const Completion& c);
  OpContext* NewOp(OpContext::Kind kind, uint32_t peer, int nic);
  void FreeOp(OpContext* op);
  void PostRecvBuffer(int nic, OpContext* op);
  void WriteDone(OpContext* op, bool ok);

  EngineOptions options_;
  std::unique_ptr<Backend> backend_;  // released by Close(): user threads read caps_ instead
  struct {
    std::string provider;
    uint32_t max_imm = 0;
    uint64_t max_write_bytes = 0;
    bool remote_virt_addr = false;
    bool device_memory = false;
  } caps_;
  int num_nics_ = 1;
  uint64_t nonce_ = 0;
  std::string address_;

  mutable std::mutex mu_;  // peers_, peer_sets_, regions_
  std::condition_variable peers_cv_;
  std::vector<std::unique_ptr<PeerState>> peers_;
  std::unordered_map<uint64_t, uint32_t> peer_by_nonce_;
  std::vector<std::unique_ptr<PeerSet>> peer_sets_;
  std::unordered_map<uint64_t, RegionEntry> regions_;
  uint64_t next_region_id_ = 1;
  uint64_t next_key_ = 1;
  std::unordered_map<uint32_t, VerifyRequest> verify_requests_;
  uint32_t next_verify_id_ = 1;
  std::set<std::pair<uint32_t, std::string>> verified_;  // (peer, serialized descriptor)

  // Submission queue: callers append under sq_mu_, the progress thread swaps the vectors out.
  std::mutex sq_mu_;
  std::condition_variable sq_cv_;
  std::vector<PendingWrite> sq_writes_;
  std::vector<PendingCall> sq_calls_;
  std::atomic<bool> sq_nonempty_{false};

  // Progress-thread-only state.
  std::deque<PendingWrite> backlog_;
  std::deque<PendingSend> pending_sends_;
  // Hellos are resent until answered: the verbs backend carries them over unreliable UD.
  std::vector<std::pair<uint32_t, std::chrono::steady_clock::time_point>> hello_resend_;
  std::vector<std::unique_ptr<OpContext>> all_ops_;
  std::vector<OpContext*> free_ops_;
  std::vector<Completion> completions_;
  std::vector<ImmCounter::Arrival> arrivals_;

  ImmCounter imms_;
  std::atomic<uint64_t> writes_posted_{0};
  std::atomic<uint64_t> notices_apart_{0};  // the backend's count, copied by the progress thread after posting
  std::atomic<uint64_t> writes_completed_{0};
  std::atomic<uint64_t> write_errors_{0};
  std::vector<std::atomic<uint64_t>> imms_per_nic_;
  std::mutex sends_mu_;
  std::condition_variable sends_cv_;

  std::atomic<int> active_waiters_{0};  // threads in Connect/WaitSends: keep the progress thread hot
  uint64_t errors_reported_ = 0;        // guarded by sends_mu_
  std::atomic<bool> stop_{false};
  std::mutex hook_mu_;  // held while the hooks run, so that removing one waits for a running call
  std::map<uint64_t, std::function<bool()>> hooks_;
  uint64_t next_hook_id_ = 1;
  std::atomic<bool> closed_{false};
  PassProfile profile_;  // the progress thread's time per phase (EngineStats)
  std::atomic<uint64_t> pass_seq_{0};  // odd while the progress thread is inside a pass (DestroyPeerSet waits it out)
  std::thread thread_;
};

}  // namespace jax_moe::fabric
