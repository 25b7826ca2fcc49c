// The proxy loop of a device that cannot drive the NIC itself (a GPU): it watches the device's doorbells, posts its
// regions to the ranks of other processes, counts their arrivals and raises the flags the device waits on, and
// returns credits once the device has read a round. It runs on the TransferEngine's progress thread (a progress hook)
// when every link uses one engine, so one thread posts, polls the completion queue and serves the device: nothing on
// the data path is handed to another thread. Otherwise it runs on a thread of its own. The pumps of every
// Communicator of a device share that device's engine (proxy/engine_pool.h), hence its one thread.
//
// Control words live in memory both sides see: host-mapped pinned memory on a GPU, plain host memory when a host
// thread plays the device (tests). Each word has one writer. Per direction of a rank (Bell):
//   device: bytes[lane][p] (our region's bytes for rank p), then rung = k: round k's regions are in the send area, lane
//           k % K, rank p's at its slot (Lanes::Offset(k, RegionSlots::Slot(rank, p))); read = k: the device finished
//           reading round k
//   pump:   sent = k: every write of rounds <= k completed (their send lanes may be rewritten); arrived = k: every
//           remote sender's region of rounds <= k is in the receive area; error != 0: the pump stopped (Pump::error)
// Peers this device reaches itself (NVLink) are not the pump's: their channel entries are same-process ones whose
// credits and arrivals the device handles (NoPeersHere).
#pragma once
#include <array>
#include <atomic>
#include <functional>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "proxy/bell.h"
#include "common/error.h"
#include "proxy/channel.h"

namespace jax_moe::proxy {

// The pump's view of peers it does not serve: the device signals those itself.
class NoPeersHere final : public SameProcess {
 public:
  bool CreditOk(int64_t, uint64_t) const override { return true; }
  uint8_t* Region(int64_t, uint64_t) const override { return nullptr; }
  void Deliver(int64_t, const uint8_t*, uint64_t, uint64_t) override {}
  bool Arrived(int64_t, uint64_t) const override { return true; }
  void Released(uint64_t) override {}
};

class Pump {
 public:
  struct Link {
    Channel* channel;                  // one direction of one rank; its remote ranks are the pump's
    const fabric::MemoryRegion* area;  // the send area: [K lanes][slots] regions (ChannelConfig::slots), registered
    uint64_t* bell;                    // kBellWords words (see BellWord)
    const uint64_t* bytes;             // [K lanes][N]: bytes of a round's region for each rank, in its lane
  };
  // `name(rank)` says where a rank runs, for errors. Starts serving at once.
  // own_thread: serve from a thread of its own even when one engine could host it (for comparison).
  // What the device side runs on the pump's thread (null: nothing), with the link's index and the round. Each says
  // whether the pump may go on; while it says false, the pump asks again on later passes (so it must not block, and
  // must start its work once only):
  // - before_arrival: before it raises a round's arrival flag (a GPU whose NIC writes need a flush, or whose rows
  //   a copy engine must first bring from the wire's host memory into HBM);
  // - before_post: before it posts a round's regions, once the device rang them (the device's rows copied from HBM
  //   into the wire's host memory; a check of what the device wrote, $JAX_MOE_FABRIC_INSPECT).
  struct Hooks {
    std::function<bool(size_t link, uint64_t round)> before_arrival;
    std::function<bool(size_t link, uint64_t round)> before_post;
  };
  Pump(std::vector<Link> links, double timeout_s, std::function<std::string(int64_t)> name, bool own_thread = false,
       Hooks hooks = {});
  ~Pump();
  Pump(const Pump&) = delete;
  Pump& operator=(const Pump&) = delete;

  // Waits (at most bound_s; not after an error) until every round the device rang is posted and every remote
  // receiver gave credit for it (it was read there), and every round the device read is credited and that credit
  // sent: the engine may then close without dropping a write in flight.
  void Drain(double bound_s);
  // Empty while the pump runs; else why it stopped (every later round of the device must fail with it).
  std::string error() const;
  // What kind of error it was (kTimeout: a peer was late; kPeerFailed: gone or bad data), when error() is not empty.
  ErrorCode error_code() const;
  // Per round of `link` (its first kTraceRounds), steady-clock ns: when the pump saw the ring, posted the round, and
  // flagged its arrival (0 where it has not happened). For the benchmark's breakdown; read after the pump is idle.
  std::vector<std::array<int64_t, 3>> Trace(size_t link = 0) const;

 private:
  struct State {
    uint64_t hooked = 0, posted = 0, flagged = 0, released = 0;  // hooked: before_post said ready up to it
    double waiting_since = -1;  // when the device rang a round whose arrivals are still missing
    uint32_t waits = 0;         // passes spent waiting (the clock is read every 256th)
  };
  void Loop();
  void DrainOrThrow(double bound_s);
  bool StepAll();                    // one pass over every link; true when anything moved
  bool Step(Link& link, State& st);  // true when anything moved
  void Stop(const std::string& why, ErrorCode code);

  std::vector<Link> links_;
  const double timeout_s_;
  std::function<std::string(int64_t)> name_;
  Hooks hooks_;
  mutable std::mutex error_mu_;
  std::string error_;
  ErrorCode error_code_ = ErrorCode::kInternal;
  std::vector<State> states_;
  std::vector<std::vector<std::array<int64_t, 3>>> traces_;  // [link][round - 1]: seen, posted, arrived
  fabric::TransferEngine* hooked_ = nullptr;  // the engine whose progress thread runs the pump, if any
  uint64_t hook_ = 0;                         // its hook id there
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace jax_moe::proxy
