#include "fabric/verbs/wr_template.h"

#include <arpa/inet.h>

#include <cstring>

namespace jax_moe::fabric::verbs {

WriteChain::WriteChain(uint32_t rkey, uint64_t remote_base, uint32_t lkey, uint64_t max_chunk)
    : rkey_(rkey), remote_base_(remote_base), lkey_(lkey), max_chunk_(max_chunk == 0 ? 1 : max_chunk) {
  std::memset(wrs_, 0, sizeof(wrs_));
  std::memset(sges_, 0, sizeof(sges_));
  for (size_t i = 0; i < kMaxChain; ++i) {
    wrs_[i].sg_list = &sges_[i];
    wrs_[i].num_sge = 1;
    wrs_[i].opcode = IBV_WR_RDMA_WRITE;
    wrs_[i].wr.rdma.rkey = rkey_;
    sges_[i].lkey = lkey_;
  }
}

ibv_send_wr* WriteChain::Patch(uint64_t local, uint64_t length, uint64_t remote_offset, std::optional<uint32_t> imm,
                               uint64_t wr_id, size_t* count, uint64_t* consumed) {
  size_t n = 0;
  uint64_t done = 0;
  do {
    const uint64_t chunk = std::min(length - done, max_chunk_);
    ibv_send_wr& w = wrs_[n];
    sges_[n].addr = local + done;
    sges_[n].length = static_cast<uint32_t>(chunk);
    w.wr.rdma.remote_addr = remote_base_ + remote_offset + done;
    w.opcode = IBV_WR_RDMA_WRITE;
    w.send_flags = 0;
    w.imm_data = 0;
    w.wr_id = 0;
    w.next = nullptr;
    // Zero-length writes post no scatter entry (some HCAs reject a zero-length SGE).
    w.num_sge = chunk == 0 ? 0 : 1;
    if (n > 0) wrs_[n - 1].next = &w;
    done += chunk;
    ++n;
  } while (done < length && n < kMaxChain);
  ibv_send_wr& last = wrs_[n - 1];
  const bool finished = done == length;
  if (finished) {  // one completion per write: only its final chunk is signaled
    last.wr_id = wr_id;
    last.send_flags = IBV_SEND_SIGNALED;
  }
  if (finished && imm) {
    last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    last.imm_data = htonl(*imm);
  }
  *count = n;
  *consumed = done;
  return &wrs_[0];
}

}  // namespace jax_moe::fabric::verbs
