// Static sizes of one Communicator's transfers, computed alike on every rank (and by the GPU path).
//
// Receive buffers are split into one private region per sender. A region holds a header (the sender's per-expert
// counts travel with its rows) and up to C rows, C = max_tokens * min(R, L): the most rows one rank can send to one
// peer. N regions of C rows equal the worst case N * C = max_recv_rows, so the counts and all rows of a sender go in a
// single write and no count exchange has to precede the data.
#pragma once
#include <cstdint>

#include "common/error.h"

namespace jax_moe::proxy {

constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

struct MoeShape {
  int64_t num_ranks = 0;          // N
  int64_t num_experts = 0;        // E
  int64_t local_experts = 0;      // L = E / N
  int64_t experts_per_token = 0;  // R
  int64_t hidden = 0;             // H
  int64_t max_tokens = 0;
  int64_t x_itemsize = 0;         // 2 (bf16) or 1 (fp8)
  int64_t num_scales = 0;         // float32 scales per row (0 for bf16)
  int64_t y_itemsize = 2;         // combine rows are bf16

  int64_t rows_per_peer() const {  // C
    return max_tokens * (experts_per_token < local_experts ? experts_per_token : local_experts);
  }
  int64_t max_recv_rows() const { return num_ranks * rows_per_peer(); }
  uint64_t x_bytes() const { return uint64_t(hidden) * x_itemsize; }
  uint64_t scale_bytes() const { return uint64_t(num_scales) * 4; }
  // Dispatch rows carry payload then scales, 16-byte aligned so copies can use wide moves.
  uint64_t dispatch_row_bytes() const { return AlignUp(x_bytes() + scale_bytes(), 16); }
  uint64_t combine_row_bytes() const { return AlignUp(uint64_t(hidden) * y_itemsize, 16); }

  void Validate() const {
    Require(num_ranks > 0 && num_experts > 0 && num_experts % num_ranks == 0 &&
                local_experts == num_experts / num_ranks,
            "MoeShape: num_experts must be a positive multiple of num_ranks");
    Require(experts_per_token > 0 && experts_per_token <= num_experts, "MoeShape: bad experts_per_token");
    Require(hidden > 0 && max_tokens > 0, "MoeShape: hidden and max_tokens must be positive");
    Require(x_itemsize == 1 || x_itemsize == 2, "MoeShape: dispatch rows are fp8 or bf16");
    Require(num_scales >= 0 && y_itemsize == 2, "MoeShape: bad scales or combine dtype");
  }
};

}  // namespace jax_moe::proxy
