// The "cpu" backend's protocol engine: one CpuComm per Communicator and process, one Rank per local device.
//
// Each rank owns, per direction (dispatch, combine), receive buffers of two parities x N per-sender regions.
// Round k of a direction writes parity k % 2. A sender writes a region (header with counts, then rows) and signals:
//  - a rank of the same process: memcpy straight into the peer's region, then a release store of the round number
//    (the CPU analogue of NVLink);
//  - a rank of another process: rows are packed into a registered staging buffer and a single TransferEngine scatter
//    writes every remote peer's region, each write carrying an immediate.
// Before writing round k a sender waits for the receiver's credit for round k - 2 (sent when it finished reading),
// so a fast rank never overwrites a region that is still being read; with two parities this wait is normally free.
// Every wait is bounded by the timeout; an error marks the CpuComm failed and later calls fail at once.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "proxy/moe_shape.h"

namespace jax_moe::cpu {

struct RankInfo {
  int64_t device_id;  // the XLA device ordinal its handlers see (the global device id on CPU)
  int32_t process;
  int32_t group;  // which expert-parallel group (meshes may hold several)
  int32_t rank;   // rank within the group
};

struct CommOptions {
  proxy::MoeShape shape;
  uint32_t slot = 0;  // the Communicator's id: identical on every process
  double timeout_s = 60.0;
  std::string provider = "auto";  // TransferEngine provider for ranks in other processes
};

// What a rank publishes to ranks of other processes.
struct Endpoint {
  int32_t group = 0, rank = 0;
  std::string address;          // its TransferEngine
  std::string dispatch_region;  // descriptors of its receive buffers
  std::string combine_region;
};

class CpuComm {
 public:
  CpuComm(const CommOptions& options, const std::vector<RankInfo>& table, int32_t process);
  ~CpuComm();
  CpuComm(const CpuComm&) = delete;
  CpuComm& operator=(const CpuComm&) = delete;

  const CommOptions& options() const { return options_; }
  bool has_remote_peers() const;
  std::vector<Endpoint> LocalEndpoints() const;
  // Connects to every remote rank of the local ranks' groups and builds the peer groups.
  void Connect(const std::vector<Endpoint>& remote);
  uint64_t BytesAllocated() const;

  // The four halves, for the local rank on `device`. Tickets are int32[2] = {round, comm slot}.
  void DispatchSend(int64_t device, const uint8_t* x, const uint8_t* x_scale, const int32_t* topk_idx, int64_t tokens,
                    int32_t* slot, int32_t* ticket);
  void DispatchRecv(int64_t device, const int32_t* ticket, uint8_t* expert_x, uint8_t* expert_x_scale,
                    int32_t* expert_counts, int32_t* dest);
  void CombineSend(int64_t device, const uint8_t* expert_y, const int32_t* dest, int32_t* ticket);
  void CombineRecv(int64_t device, const int32_t* ticket, const float* topk_weights, const int32_t* slot,
                   int64_t tokens, uint8_t* out);

  struct Rank;
  struct Direction;

 private:
  Rank& RankOf(int64_t device);
  void CheckHealthy() const;
  void Fail(const std::string& message);
  template <typename Fn>
  void Guard(Fn&& fn);

  CommOptions options_;
  int32_t process_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // local ranks
  std::unordered_map<int64_t, Rank*> by_device_;
  mutable std::mutex failure_mu_;
  std::string failure_;
};

// Process-wide registry, so that XLA handlers find a CpuComm from the slot attribute of their call.
void RegisterComm(std::shared_ptr<CpuComm> comm);
std::shared_ptr<CpuComm> FindComm(uint32_t slot);
void ReleaseComm(uint32_t slot);

}  // namespace jax_moe::cpu
