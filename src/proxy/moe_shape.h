// Static sizes of one Communicator's transfers, computed alike on every rank: one type for the host protocol
// (src/proxy, src/cpu), the GPU host runtime (src/cuda) and the kernels (src/kernels), hence host/device callable.
//
// Receive buffers are split into one private region per sender. A region holds a header (the sender's per-expert
// counts travel with its rows) and up to C rows, C = max_tokens * min(R, L): the most rows one rank can send to one
// peer. N regions of C rows equal the worst case N * C = max_recv_rows, so the counts and all rows of a sender go in a
// single write and no count exchange has to precede the data.
//
// Dimensions are int32 (kernels index with 32-bit math); products that can exceed it are int64.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define JAX_MOE_HD __host__ __device__
#else
#define JAX_MOE_HD
#endif

namespace jax_moe::proxy {

JAX_MOE_HD constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

struct MoeShape {
  int32_t num_ranks = 1;          // N
  int32_t num_experts = 1;        // E
  int32_t local_experts = 1;      // L = E / N
  int32_t experts_per_token = 1;  // R
  int32_t hidden = 0;             // H
  int32_t max_tokens = 1;
  int32_t x_itemsize = 2;  // 2 (bf16) or 1 (fp8)
  int32_t num_scales = 0;  // float32 scales per row (0 for bf16)
  int32_t y_itemsize = 2;  // combine rows are bf16

  // C: the most rows one rank sends one peer (each token reaches at most min(R, L) experts of a peer).
  JAX_MOE_HD int64_t rows_per_peer() const {
    return int64_t(max_tokens) * (experts_per_token < local_experts ? experts_per_token : local_experts);
  }
  JAX_MOE_HD int64_t max_recv_rows() const { return int64_t(num_ranks) * rows_per_peer(); }
  // (token, k) entries of a rank: max_tokens * R.
  JAX_MOE_HD int64_t entries() const { return int64_t(max_tokens) * experts_per_token; }
  JAX_MOE_HD int x_bytes() const { return hidden * x_itemsize; }
  JAX_MOE_HD int scale_bytes() const { return num_scales * 4; }
  // Dispatch rows carry payload then scales, 16-byte aligned so copies can use wide moves.
  JAX_MOE_HD int dispatch_row_bytes() const { return int(AlignUp(uint64_t(x_bytes() + scale_bytes()), 16)); }
  JAX_MOE_HD int combine_row_bytes() const { return int(AlignUp(uint64_t(hidden) * y_itemsize, 16)); }

  // Empty when the shape is consistent; else what is wrong (host only: callers raise it).
  const char* Problem() const {
    if (num_ranks <= 0 || num_experts <= 0 || num_experts % num_ranks != 0 || local_experts != num_experts / num_ranks)
      return "MoeShape: num_experts must be a positive multiple of num_ranks";
    if (experts_per_token <= 0 || experts_per_token > num_experts) return "MoeShape: bad experts_per_token";
    if (hidden <= 0 || max_tokens <= 0) return "MoeShape: hidden and max_tokens must be positive";
    if (x_itemsize != 1 && x_itemsize != 2) return "MoeShape: dispatch rows are fp8 or bf16";
    if (num_scales < 0 || y_itemsize != 2) return "MoeShape: bad scales or combine dtype";
    return "";
  }
};

}  // namespace jax_moe::proxy
