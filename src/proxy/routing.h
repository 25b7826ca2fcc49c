// Where every row goes, computed alike by senders and receivers from the routing and the exchanged counts.
//
// Sender side: a token's (t, k) entry for global expert g = p * L + e goes to rank p, into p's region for this sender,
// at row `start of e in the block + number of earlier tokens for g` (rows sorted by local expert, then token).
// Receiver side: expert_x is grouped by local expert, then source rank, then token; the counts every sender put in
// its header give each received row its place. Ids outside [0, E) and repeats within a token are masked.
#pragma once
#include <cstdint>
#include <vector>

#include "proxy/moe_shape.h"

namespace jax_moe::proxy {

struct SendPlan {
  std::vector<int32_t> position;  // [T * R]: p * C + row within p's block, or -1 when masked
  std::vector<int32_t> counts;  // [N * L]: rows for (rank p, local expert e)
  std::vector<int32_t> rows;    // [N]: rows for rank p
  int64_t bad_index = -1;       // first (t * R + k) whose id was out of range, -1 if none
  int64_t bad_value = 0;
};

void ComputeSendPlan(const int32_t* topk_idx, int64_t tokens, const MoeShape& s, SendPlan* plan);

// counts[src * L + e] from every sender's header -> dest[src * C + j] = row in expert_x (or -1), expert_counts[L].
void ComputeRecvLayout(const std::vector<int32_t>& counts, const MoeShape& s, int32_t* dest, int32_t* expert_counts);

}  // namespace jax_moe::proxy
