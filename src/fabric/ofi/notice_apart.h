// Writes whose arrival notice (remote CQ data) travels apart from their bytes: the bytes as a write without CQ
// data, then, once the provider reports them complete, a zero-byte write that carries the notice.
//
// Why (libfabric's shm provider, 1.17 and 2.x): a write with CQ data is copied on the *receiver's* progress
// (smr_progress_iov, process_vm_readv), i.e. by the receiving proxy thread, which meanwhile can neither copy nor post
// its own round: the two directions of an all-to-all run one after the other. A write without CQ data is copied by
// the sender inside fi_writemsg ("fast RMA": FI_MR_VIRT_ADDR and no RMA ordering, which our hints leave), so each
// proxy copies its own direction and both move at once.
//
// Order: the notice is posted only after the bytes' own completion, not on trust in the fast path. On every shm
// protocol that completion means the receiver will see the bytes before any later command: fast RMA, CMA and SAR
// complete once the bytes are in place, and inline/inject bytes ride in a command of the receiver's queue, which it
// handles in order, before the notice's command behind it.
#pragma once
#include <rdma/fi_rma.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "fabric/backend.h"

namespace jax_moe::fabric::ofi {

class NoticeApart {
 public:
  // Posts `w`'s bytes alone (w.has_imm, w.length > 0); its notice follows from OnBytes. False on -FI_EAGAIN (nothing
  // posted); throws on any other error. `data` is the notice's CQ data, already encoded.
  bool PostBytes(fid_ep* ep, const WriteRequest& w, uint64_t data);
  // Whether `context` (a completion's op_context) is the bytes of one of our writes.
  bool Owns(const void* context) const;
  // The bytes of `context` completed: their notice is queued (posted by PostNotices). On failure the write's own
  // context is returned, to be reported as failed; else null.
  void* OnBytes(void* context, bool ok);
  // Posts queued notices in order until the provider's queue is full. A notice that cannot be posted at all is
  // appended to `failed` as a kError completion of its write.
  void PostNotices(fid_ep* ep, std::vector<Completion>* failed);
  size_t queued() const { return notices_.size(); }
  // An error completion without a context (`why`): libfabric 2.x's shm reports a failed sender-side copy (the peer's
  // process is gone) that way and answers the post with -FI_EAGAIN, so the write would be retried and fail pass after
  // pass. It is taken as the failure of the destination last refused, whose writes then throw kPeerFailed instead.
  // Returns whether it was so taken.
  bool OnStrayError(const std::string& why);

 private:
  struct Bytes {
    OpContextStorage storage;  // first: the provider's fi_context2
    void* context = nullptr;   // the write's own context, completed by its notice
    uint64_t dest = 0, remote_addr = 0, rkey = 0, data = 0;
  };
  Bytes* Take();
  void Give(Bytes* b);

  std::vector<std::unique_ptr<Bytes>> all_;
  std::vector<Bytes*> free_;
  std::unordered_set<const void*> out_;  // bytes posted, not yet complete
  static constexpr uint64_t kNoDest = ~uint64_t{0};
  uint64_t refused_ = kNoDest;            // the destination whose last bytes were refused (-FI_EAGAIN)
  std::unordered_map<uint64_t, std::string> dead_;  // destinations a copy into failed, and how
  std::deque<Bytes*> notices_;           // bytes complete, notice not yet posted (oldest first)
};

}  // namespace jax_moe::fabric::ofi
