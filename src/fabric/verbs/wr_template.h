// Work-request templates for RC writes: a chain of ibv_send_wr/ibv_sge filled once (opcode, flags,
// rkey, remote base, lkey) and patched per call (addresses, lengths, immediate). A write longer than
// `max_chunk` becomes a chain of chunks posted with one ibv_post_send; only the last chunk carries
// the immediate, which is correct on RC because a QP executes its work requests in order.
// Pure struct manipulation: no device calls, unit-tested without an RDMA NIC.
#pragma once
#include <infiniband/verbs.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace jax_moe::fabric::verbs {

class WriteChain {
 public:
  static constexpr size_t kMaxChain = 4;  // longer chains gain nothing and delay the doorbell

  // Fixed part of every write to one peer region.
  WriteChain(uint32_t rkey, uint64_t remote_base, uint32_t lkey, uint64_t max_chunk);

  // Fills the chain for [local, local+length) -> remote_base + remote_offset. Returns the head WR and
  // how many WRs are linked; writes needing more than kMaxChain chunks return the rest via `*consumed`
  // (call again with the remainder). `wr_id` and IBV_SEND_SIGNALED go to the write's final
  // chunk only, so a write completes exactly once.
  ibv_send_wr* Patch(uint64_t local, uint64_t length, uint64_t remote_offset, std::optional<uint32_t> imm,
                     uint64_t wr_id, size_t* count, uint64_t* consumed);

  const ibv_send_wr& wr(size_t i) const { return wrs_[i]; }
  const ibv_sge& sge(size_t i) const { return sges_[i]; }

 private:
  uint32_t rkey_;
  uint64_t remote_base_;
  uint32_t lkey_;
  uint64_t max_chunk_;
  ibv_send_wr wrs_[kMaxChain];
  ibv_sge sges_[kMaxChain];
};

}  // namespace jax_moe::fabric::verbs
