// Write templates of a peer set: everything about a member's write that does not change between
// calls (NIC, peer handle, remote key, remote base, immediate's sender peer id) is resolved once when
// the set is created; PatchWrite() fills in the per-call fields. Pure logic, no transport calls.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "fabric/backend.h"
#include "fabric/descriptor.h"

namespace jax_moe::fabric {

struct WriteTemplate {
  uint32_t peer = 0;
  int nic = 0;
  WriteRequest req;          // dest, rkey, remote_addr (region base or 0) prefilled
  uint32_t imm_peer_id = 0;  // the peer id the receiver knows us by
  uint64_t remote_size = 0;
};

// Fills the per-call fields of `t` into `out`; bounds are checked by the caller.
inline void PatchWrite(const WriteTemplate& t, const void* src_base, void* local_desc, uint64_t src_offset,
                       uint64_t length, uint64_t dst_offset, std::optional<uint32_t> imm, void* context,
                       WriteRequest* out) {
  *out = t.req;
  out->local = static_cast<const char*>(src_base) + src_offset;
  out->length = length;
  out->local_desc = local_desc;
  out->remote_addr = t.req.remote_addr + dst_offset;
  out->has_imm = imm.has_value();
  out->imm = imm ? *imm : 0;
  out->sender_peer_id = t.imm_peer_id;
  out->context = context;
}

// A prebuilt ordered set of peers, one remote region and one write template per member.
struct PeerSet {
  std::vector<uint32_t> members;
  std::vector<RegionDescriptor> regions;
  std::vector<WriteTemplate> templates;
  // Writes posted through this set and not yet completed: shared with their operation contexts, so a set destroyed
  // while its writes are out is still counted down safely. Its user (a proxy channel) waits on its own writes only,
  // not on those of every other user of the engine.
  std::shared_ptr<std::atomic<int64_t>> in_flight = std::make_shared<std::atomic<int64_t>>(0);
  // Set when the set is destroyed: its writes not yet posted are dropped, not posted (their memory may be gone).
  std::shared_ptr<std::atomic<bool>> gone = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace jax_moe::fabric
