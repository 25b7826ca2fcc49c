#include "fabric/ofi/notice_apart.h"

#include <rdma/fi_errno.h>

#include "common/error.h"
#include "fabric/ofi/ofi_util.h"

namespace jax_moe::fabric::ofi {

NoticeApart::Bytes* NoticeApart::Take() {
  if (free_.empty()) {
    all_.push_back(std::make_unique<Bytes>());
    return all_.back().get();
  }
  Bytes* b = free_.back();
  free_.pop_back();
  return b;
}

void NoticeApart::Give(Bytes* b) {
  *b = Bytes{};
  free_.push_back(b);
}

bool NoticeApart::PostBytes(fid_ep* ep, const WriteRequest& w, uint64_t data) {
  if (auto it = dead_.find(w.dest); it != dead_.end()) {
    Throw(ErrorCode::kPeerFailed, "shm could not copy into the peer's memory (" + it->second +
                                      "): its process is probably gone");
  }
  Bytes* b = Take();
  b->context = w.context;
  b->dest = w.dest;
  b->remote_addr = w.remote_addr;  // the notice names the bytes' start, zero bytes long
  b->rkey = w.rkey;
  b->data = data;
  const ssize_t rc = WriteMsg(ep, w.local, w.length, w.local_desc, w.dest, w.remote_addr, w.rkey, 0, b, FI_COMPLETION);
  if (rc == 0) {
    out_.insert(b);
    if (refused_ == w.dest) refused_ = kNoDest;
    return true;
  }
  Give(b);
  if (rc == -FI_EAGAIN) {
    refused_ = w.dest;
    return false;
  }
  Check(rc, "fi_writemsg(bytes)");
  return false;
}

bool NoticeApart::Owns(const void* context) const { return context != nullptr && out_.count(context) != 0; }

void* NoticeApart::OnBytes(void* context, bool ok) {
  Bytes* b = static_cast<Bytes*>(context);
  out_.erase(b);
  if (ok) {
    notices_.push_back(b);
    return nullptr;
  }
  void* own = b->context;
  Give(b);
  return own;
}

bool NoticeApart::OnStrayError(const std::string& why) {
  if (refused_ == kNoDest) return false;
  dead_.emplace(refused_, why);
  refused_ = kNoDest;
  return true;
}

void NoticeApart::PostNotices(fid_ep* ep, std::vector<Completion>* failed) {
  while (!notices_.empty()) {
    Bytes* b = notices_.front();
    const ssize_t rc = WriteMsg(ep, nullptr, 0, nullptr, b->dest, b->remote_addr, b->rkey, b->data, b->context,
                                FI_COMPLETION | FI_REMOTE_CQ_DATA);
    if (rc == -FI_EAGAIN) return;
    notices_.pop_front();
    if (rc != 0) {
      Completion c;
      c.kind = Completion::kError;
      c.context = b->context;
      c.error = std::string("posting the arrival notice of a write: fi_writemsg: ") + fi_strerror(static_cast<int>(-rc));
      failed->push_back(std::move(c));
    }
    Give(b);
  }
}

}  // namespace jax_moe::fabric::ofi
