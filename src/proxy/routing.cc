#include "proxy/routing.h"

#include "common/error.h"

#include <algorithm>

namespace jax_moe::proxy {

void ComputeSendPlan(const int32_t* topk_idx, int64_t tokens, const MoeShape& s, SendPlan* plan) {
  const int64_t n = s.num_ranks, l = s.local_experts, r = s.experts_per_token, e_total = s.num_experts;
  const int64_t c = s.rows_per_peer();
  plan->position.assign(tokens * r, -1);
  plan->counts.assign(n * l, 0);
  plan->rows.assign(n, 0);
  plan->bad_index = -1;
  plan->bad_value = 0;
  // Pass 1: validate, mask repeats, count per global expert.
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* ids = topk_idx + t * r;
    for (int64_t k = 0; k < r; ++k) {
      const int64_t g = ids[k];
      if (g == -1) continue;  // masked by the caller
      if (g < 0 || g >= e_total) {  // any other id outside [0, E) is a caller's bug: masked, then reported
        if (plan->bad_index < 0) {
          plan->bad_index = t * r + k;
          plan->bad_value = g;
        }
        continue;
      }
      if (std::find(ids, ids + k, ids[k]) != ids + k) continue;  // a repeat of an earlier k
      plan->position[t * r + k] = 0;  // marks "valid" for pass 2
      ++plan->counts[g];
    }
  }
  // Block starts: experts of a rank are laid out in order inside its block.
  std::vector<int32_t> next(n * l);
  for (int64_t p = 0; p < n; ++p) {
    int32_t acc = 0;
    for (int64_t e = 0; e < l; ++e) {
      next[p * l + e] = acc;
      acc += plan->counts[p * l + e];
    }
    plan->rows[p] = acc;
    Require(acc <= c, "ComputeSendPlan: more rows for one rank than a region holds");
  }
  // Pass 2: tokens in order, so rows of an expert are sorted by token.
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < r; ++k) {
      int32_t& pos = plan->position[t * r + k];
      if (pos < 0) continue;
      const int64_t g = topk_idx[t * r + k];
      pos = static_cast<int32_t>((g / l) * c + next[g]++);
    }
  }
}

void ComputeRecvLayout(const std::vector<int32_t>& counts, const MoeShape& s, int32_t* dest, int32_t* expert_counts) {
  const int64_t n = s.num_ranks, l = s.local_experts, c = s.rows_per_peer();
  std::vector<int64_t> start(l);
  int64_t acc = 0;
  for (int64_t e = 0; e < l; ++e) {
    int64_t total = 0;
    for (int64_t src = 0; src < n; ++src) total += counts[src * l + e];
    expert_counts[e] = static_cast<int32_t>(total);
    start[e] = acc;
    acc += total;
  }
  for (int64_t src = 0; src < n; ++src) {
    int32_t* d = dest + src * c;
    int64_t j = 0;
    for (int64_t e = 0; e < l; ++e) {
      for (int32_t i = 0; i < counts[src * l + e]; ++i) d[j++] = static_cast<int32_t>(start[e]++);
    }
    std::fill(d + j, d + c, -1);
  }
}

}  // namespace jax_moe::proxy
