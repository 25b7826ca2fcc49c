// The "cpu" backend's device side: one CpuComm per Communicator and process, one Rank per local device. It packs
// token rows into per-sender regions and unpacks received ones, on host memory, over the protocol of src/proxy
// (lanes, credits, staging, delivery by the TransferEngine, the progress thread, bounded waits). Ranks of this process
// are reached through the same-process shortcut (cpu/same_process.h), others through the TransferEngine.
//
// A receive half waits (bounded by the timeout, naming the ranks that did not answer) for its round only: XLA:CPU
// runs a device's program in one order, the same on every rank, so it only waits for sends that come earlier; a send
// half never waits (proxy/channel.h). Rounds may be received in any order as long as fewer than K rounds of a
// direction are in flight. Any error marks the CpuComm failed; later calls fail at once with the first error.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/error.h"
#include "proxy/moe_shape.h"
#include "proxy/proxy.h"

namespace jax_moe::cpu {

struct RankInfo {
  int64_t device_id;  // the XLA device ordinal its handlers see (the global device id on CPU)
  int32_t process;
  int32_t group;  // which expert-parallel group (meshes may hold several)
  int32_t rank;   // rank within the group
};

struct CommOptions {
  proxy::MoeShape shape;
  uint32_t comm_id = 0;  // the Communicator's id: identical on every process
  double timeout_s = 60.0;
  std::string provider = "auto";  // TransferEngine provider for ranks in other processes
  int64_t lanes = 4;              // receive buffers per sender and direction: rounds that may be in flight
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
  // Delivers queued regions and waits for the peers' last credits first (bounded, see Drain): the engines are shared
  // by the process's CpuComms and close with the last of them (proxy/engine_pool.h).
  ~CpuComm();
  CpuComm(const CpuComm&) = delete;
  CpuComm& operator=(const CpuComm&) = delete;

  const CommOptions& options() const { return options_; }
  std::vector<Endpoint> LocalEndpoints() const;
  // Connects to every remote rank of the local ranks' groups and builds the peer sets.
  void Connect(const std::vector<Endpoint>& remote);
  uint64_t BytesAllocated() const;
  // The host of every process (index = process), for error messages that say where a rank runs.
  void SetHosts(const std::vector<std::string>& hosts);
  // CpuComms alive in this process.
  static int64_t Live();

  // The four halves, for the local rank on `device`. Tickets are int32[2] = {round, comm_id}. They throw
  // jax_moe::Error; any error marks the CpuComm failed.
  // per_entry: x holds one row per (token, k) entry ([T * R] rows, no scales) instead of one per token (gradients).
  // position [T * R]: where each entry went, p * C + row in p's region, or -1 when masked.
  void DispatchSend(int64_t device, const uint8_t* x, const uint8_t* x_scale, const int32_t* topk_idx, int64_t tokens,
                    bool per_entry, int32_t* position, int32_t* ticket);
  void DispatchRecv(int64_t device, const int32_t* ticket, uint8_t* expert_x, uint8_t* expert_x_scale,
                    int32_t* expert_counts, int32_t* dest);
  void CombineSend(int64_t device, const uint8_t* expert_y, const int32_t* dest, int32_t* ticket);
  // reduce: out [T, H] = float32 sum of w * y over k; else out [T * R, H] = each entry's row, 0 if masked.
  void CombineRecv(int64_t device, const int32_t* ticket, const float* topk_weights, const int32_t* position,
                   int64_t tokens, bool reduce, uint8_t* out);

  struct Rank;
  struct Direction;
  // "rank r (process p on host h, device d)" for rank `rank` of `me`'s group.
  std::string Name(const Rank& me, int64_t rank) const;

 private:
  Rank& RankOf(int64_t device);
  // The round a receive half's ticket names, checked against this Communicator and rank.
  uint64_t TicketRound(const Direction& d, const int32_t* ticket, const char* op) const;
  // Waits (bounded) for every sender's region of `round`, runs `finish` on them, then releases the lane.
  void Receive(Rank& me, Direction& d, uint64_t round, const std::function<void()>& finish);

  CommOptions options_;
  int32_t process_;
  std::vector<RankInfo> table_;
  std::unordered_map<int64_t, std::vector<const RankInfo*>> members_;  // group -> [rank] its device's info
  mutable std::mutex hosts_mu_;
  std::vector<std::string> hosts_;  // [process] host name, when known
  std::vector<std::unique_ptr<Rank>> ranks_;  // local ranks
  std::unordered_map<int64_t, Rank*> by_device_;
  // Declared last: destroyed first, so that its progress thread stops before the channels go.
  std::unique_ptr<proxy::Proxy> proxy_;
};

// Process-wide registry, so that XLA handlers find a CpuComm from the comm_id attribute of their call.
void RegisterComm(std::shared_ptr<CpuComm> comm);
std::shared_ptr<CpuComm> FindComm(uint32_t comm_id);
void ReleaseComm(uint32_t comm_id);
// Releases every registered CpuComm, then closes the engines no CpuComm holds (interpreter exit).
void ReleaseAllComms();

}  // namespace jax_moe::cpu
