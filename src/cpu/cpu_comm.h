// The "cpu" backend's protocol engine: one CpuComm per Communicator and process, one Rank per local device.
//
// Each rank owns, per direction (dispatch, combine), receive buffers of K lanes x N per-sender regions.
// Round k of a direction writes lane k % K; before writing round k into a receiver, a sender needs the
// receiver's credit for round k - K (it finished reading that lane). Rounds may be received in any order (XLA
// schedules independent halves freely, e.g. a forward combine_recv after backward sends) as long as fewer than K
// rounds of a direction are in flight.
//
// XLA may schedule independent sends and receives (say, of the forward and the backward pass) in any order that
// respects data dependencies, e.g. three sends before the first receive. A send that waited for credit would then wait
// for a receive queued behind itself on the same device. Hence:
//  - a send half never waits: it delivers each region at once when the receiver has credit (same process: memcpy
//    straight into the receiver's region, then a release store of the round number; other processes: one
//    TransferEngine scatter from a registered staging buffer), and otherwise leaves it staged in a per-peer queue;
//  - a progress thread per CpuComm delivers queued regions as credits arrive;
//  - a receive half waits (bounded by the timeout, naming the ranks that did not answer) for its round only: XLA:CPU
//    runs a device's program in one order, the same on every rank, so it only waits for sends that come earlier.
// Any error marks the CpuComm failed; later calls fail at once with the first error.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/error.h"
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
  // by the process's CpuComms and close with the last of them (cpu/engine_pool.h).
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

  // The four halves, for the local rank on `device`. Tickets are int32[2] = {round, comm slot}. They throw
  // jax_moe::Error; any error marks the CpuComm failed.
  // per_slot: x holds one row per (token, k) ([T * R] rows, no scales) instead of one per token (the gradients).
  void DispatchSend(int64_t device, const uint8_t* x, const uint8_t* x_scale, const int32_t* topk_idx, int64_t tokens,
                    bool per_slot, int32_t* slot, int32_t* ticket);
  void DispatchRecv(int64_t device, const int32_t* ticket, uint8_t* expert_x, uint8_t* expert_x_scale,
                    int32_t* expert_counts, int32_t* dest);
  void CombineSend(int64_t device, const uint8_t* expert_y, const int32_t* dest, int32_t* ticket);
  // reduce: out [T, H] = float32 sum of w * y over k; else out [T * R, H] = each (token, k)'s row, 0 if masked.
  void CombineRecv(int64_t device, const int32_t* ticket, const float* topk_weights, const int32_t* slot,
                   int64_t tokens, bool reduce, uint8_t* out);

  struct Rank;
  struct Direction;
  using DirectionOf = Direction Rank::*;
  // "rank r (process p on host h, device d)" for rank `rank` of `me`'s group.
  std::string Name(const Rank& me, int64_t rank) const;

 private:
  Rank& RankOf(int64_t device);
  void CheckHealthy() const;
  void Fail(const std::string& message, ErrorCode code);
  // Runs a half: a failure marks the CpuComm failed and is rethrown.
  void Guard(const std::function<void()>& fn);

  // Send side (cpu/delivery.cc).
  using Fill = std::function<void(const std::vector<uint8_t*>& regions)>;
  void SendRound(Rank& me, DirectionOf dir, uint64_t round, const std::vector<int32_t>& rows, const Fill& fill);
  bool CreditOk(Rank& me, DirectionOf dir, int64_t peer, uint64_t round);
  void FlushQueues(Rank& me, DirectionOf dir);
  // Receive side.
  // Waits (bounded) for every sender's region of the ticket's round, runs `finish` on them, then releases the lane.
  void Receive(Rank& me, DirectionOf dir, const int32_t* ticket, const char* op, const std::function<void()>& finish);
  bool Arrived(Rank& me, DirectionOf dir, uint64_t round, std::vector<int32_t>* missing);
  void Release(Rank& me, DirectionOf dir, uint64_t round);
  void ProgressLoop();
  void Drain();
  bool Drained();

  CommOptions options_;
  int32_t process_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // local ranks
  std::unordered_map<int64_t, Rank*> by_device_;
  mutable std::mutex failure_mu_;
  std::string failure_;
  ErrorCode failure_code_ = ErrorCode::kPeerFailed;  // the first error's code: later calls fail with the same
  std::vector<std::string> hosts_;                    // [process] host name, when known
  std::unordered_map<int64_t, std::vector<const RankInfo*>> members_;  // group -> [rank] its device's info
  std::vector<RankInfo> table_;
  // Queues, staging and credits of every local rank; receivers and the progress thread sleep on cv_.
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread progress_;
};

// Process-wide registry, so that XLA handlers find a CpuComm from the slot attribute of their call.
void RegisterComm(std::shared_ptr<CpuComm> comm);
std::shared_ptr<CpuComm> FindComm(uint32_t slot);
void ReleaseComm(uint32_t slot);
// Releases every registered CpuComm, then closes the engines no CpuComm holds (interpreter exit).
void ReleaseAllComms();

}  // namespace jax_moe::cpu
