// One direction (dispatch or combine) of one rank: the protocol of regions, credits and arrivals toward every peer.
//
// A send half never waits: each peer's region is delivered at once when the receiver has credit for the round's
// lane, and otherwise staged in a per-peer queue that Flush (the progress thread) delivers as credits arrive. XLA may
// schedule independent sends and receives (say, of the forward and the backward pass) in any order that respects data
// dependencies; a send that waited for credit could wait for a receive queued behind itself on the same device.
//
// Peers in other processes are served here, through the TransferEngine: one scatter (or write) with a data immediate
// per round, credit immediates back after the receiver read a round, arrivals counted per sender and lane. Peers in
// this process are served by the device side (SameProcess), which may write their regions in place. Memory is the
// device side's too: the receive buffer it registers, staging from its allocator; the proxy only posts transfers.
//
// Locking: methods run under the Proxy's lock (proxy/proxy.h) except Send, which takes it around its fill, and
// Release, which only touches atomics and the engine.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fabric/transfer_engine.h"
#include "proxy/imm.h"
#include "proxy/lanes.h"
#include "proxy/staging.h"

namespace jax_moe::proxy {

struct ChannelConfig {
  const char* name = "";  // "dispatch" or "combine", for errors
  ImmKind data_kind{}, credit_kind{};
  uint32_t comm_id = 0;
  int32_t rank = 0;  // this rank
  Lanes lanes;        // of this rank's buffers (lanes.slots == slots.Slots(rank))
  RegionSlots slots = RegionSlots::EveryRank(1);  // whose region is where, in every rank's buffers
  uint64_t header_bytes = 0;  // a region's header, then rows of row_bytes
  uint64_t row_bytes = 0;
};

// The peers of this process, as the device side reaches them (on "cpu": a copy into the peer's host buffer).
class SameProcess {
 public:
  virtual ~SameProcess() = default;
  // `peer` finished reading every earlier round of `round`'s lane.
  virtual bool CreditOk(int64_t peer, uint64_t round) const = 0;
  // Our region of `round` in `peer`'s receive buffer, to fill in place when it has credit.
  virtual uint8_t* Region(int64_t peer, uint64_t round) const = 0;
  // Our region of `round` is in `peer`'s buffer: copied from `src` first when not null, then published.
  virtual void Deliver(int64_t peer, const uint8_t* src, uint64_t bytes, uint64_t round) = 0;
  // `sender` delivered its region of `round` to us.
  virtual bool Arrived(int64_t sender, uint64_t round) const = 0;
  // We finished reading `round`: its lane may be written again.
  virtual void Released(uint64_t round) = 0;
};

class Channel {
 public:
  // remote[p]: rank p is in another process, reached through `engine` (null when none is); otherwise through `local`.
  // `mu` and `cv` are the Proxy's: queues, staging and credits are guarded by `mu`, waiters sleep on `cv`.
  Channel(const ChannelConfig& config, const std::vector<bool>& remote, std::shared_ptr<fabric::TransferEngine> engine,
          SameProcess* local, Allocate allocate, std::mutex& mu, std::condition_variable& cv);
  // Gives the engine back what this channel held there: its peer set, and the immediates of its Communicator still
  // banked (the engine is shared: a later Communicator with the same id must not count them).
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  const ChannelConfig& config() const { return config_; }
  const Lanes& lanes() const { return config_.lanes; }
  int64_t num_ranks() const { return int64_t(remote_index_.size()); }
  // Ranks of other processes, in the order their endpoints are given to Connect.
  const std::vector<int32_t>& remote_ranks() const { return remote_ranks_; }
  fabric::TransferEngine* engine() const { return engine_.get(); }
  // Our writes still in flight (posted through this channel, not yet completed); 0 before Connect.
  uint64_t SendsInFlight() const;
  // The remote ranks' engines and receive buffers, in remote_ranks() order.
  void Connect(const std::vector<fabric::PeerId>& peers, std::vector<fabric::RegionDescriptor> regions);

  // Round counters, touched by the rank's own XLA thread only: rounds sent and received so far.
  uint64_t send_round() const { return send_round_; }
  uint64_t received() const { return received_; }
  uint64_t NextSendRound() { return ++send_round_; }
  // Counts `round` as received; false (counting nothing) when it was received before: a handle presented twice,
  // which would read a stale lane and credit it twice. Rounds of one lane are received in order (the next one can
  // only be sent after the credit of this one), so the last received round per lane tells.
  bool CountReceived(uint64_t round);

  // Sends `round`: rows[p] rows to rank p. `fill` writes every peer's region (header, then rows) at the addresses it
  // is given, without the lock: in place in a same-process receiver when it has credit, else in staging.
  using Fill = std::function<void(const std::vector<uint8_t*>& regions)>;
  void Send(uint64_t round, const std::vector<int32_t>& rows, const Fill& fill);
  // Posts the rounds up to `ready` of a send area the device filled (laid out as our receive buffer: [K lanes][S
  // slots] regions, rank p's in slot config().slots.Slot(rank, p); words[lane * N + p]: the bytes of rank p's region
  // of a round in that lane) to the remote ranks, each as far as its own credits allow, rounds in order: a receiver
  // late with its credits holds back its own regions only. Returns the last round every remote rank was posted. A
  // pass asks, per round, the receivers due it in turn up to the first without credit (a look-up a round while all
  // wait: at most K), and that round's next pass starts after that one, so a receiver with credit waits at most
  // N - 1 passes. That needs `ready` <= the last return + K (one round per lane in progress), which a device keeps
  // by rewriting a lane only once it was posted to all. For a device that packs its own regions (a GPU through the
  // Pump). Under the lock.
  uint64_t PostAreas(uint64_t ready, const fabric::MemoryRegion& area, const uint64_t* words);
  // The lock the Proxy or Pump gave this channel.
  std::mutex& mu() const { return mu_; }
  // Delivers queued regions whose receivers gave credit since (the progress thread). Under the lock.
  void Flush();
  bool HasQueued() const;
  // Every sender's region of `round` is here; else the missing ranks are appended to `missing` (if not null).
  // Under the lock.
  bool Arrived(uint64_t round, std::vector<int32_t>* missing);
  // We finished reading `round`: credit to every sender. Without the lock.
  void Release(uint64_t round);
  // Nothing queued and every remote receiver gave credit for every round we sent it: no write of ours is still
  // owed or on its way. Under the lock.
  bool Drained();
  uint64_t BytesAllocated() const { return staging_.BytesAllocated(); }

 private:
  struct Outgoing {
    uint64_t round;
    Staging* staging;
    uint64_t bytes;
  };
  bool CreditOk(int64_t peer, uint64_t round);
  uint32_t Imm(ImmKind kind, uint64_t round, uint32_t rank) const {
    return MakeImm(kind, config_.comm_id, rank, uint32_t(lanes().Lane(round)));
  }
  // Posts our region of `round` for the remote ranks `ranks`, rank ranks[i]'s from src_offsets[i] of `src` (one
  // scatter when they are all the remote ranks); throws kPeerFailed naming the ranks it could not reach after
  // serving the others.
  void Post(uint64_t round, const fabric::MemoryRegion& src, const std::vector<uint64_t>& src_offsets,
            const std::vector<int32_t>& ranks, const std::vector<uint64_t>& bytes);

  ChannelConfig config_;
  std::shared_ptr<fabric::TransferEngine> engine_;
  SameProcess* local_;
  std::mutex& mu_;
  std::condition_variable& cv_;
  std::vector<int32_t> remote_ranks_;  // ranks of other processes
  std::vector<int64_t> remote_index_;  // [N]: position in remote_ranks_, or -1 for a same-process rank
  // Per remote rank (remote_ranks_ order): its region in our send area (PostAreas), and where ours is in its receive
  // buffer, whose lanes hold `peer_slots` regions (RegionSlots: a receiver on a smaller node holds more).
  std::vector<int64_t> own_slot_, slot_at_peer_, peer_slots_;
  // Byte offset of our region of `round` in the receive buffer of remote_ranks_[i].
  uint64_t PeerOffset(uint64_t round, size_t i) const {
    return uint64_t(lanes().Lane(round) * peer_slots_[i] + slot_at_peer_[i]) * lanes().region_bytes;
  }
  std::vector<fabric::PeerId> remote_peers_;
  std::vector<fabric::RegionDescriptor> remote_regions_;  // receive buffers of the remote ranks
  fabric::PeerSetId peer_set_ = 0;
  uint64_t send_round_ = 0, received_ = 0;
  std::vector<uint64_t> last_received_;  // [K]: the last round received on each lane
  // Guarded by mu_:
  StagingPool staging_;
  std::vector<std::deque<Outgoing>> queue_;  // [N] regions waiting for the receiver's credit, in round order
  std::vector<uint64_t> remote_credits_;     // [N][K] rounds of a lane a remote receiver released
  std::vector<uint64_t> remote_rounds_;      // [N][K] rounds of a lane a remote sender delivered
  // A pass of the proxy asks a round's arrivals again until they are all in, and with N ranks that was N look-ups of
  // the engine's banked immediates per question. Once a rank's region for a round is here it stays here, so the
  // question resumes at the first rank not yet seen for its round: a pass that finds nothing new costs one look-up,
  // not N (credits: PostAreas asks in turn up to the first without). Guarded by mu_.
  struct Cursor {
    uint64_t round = 0;
    int64_t next = 0;  // ranks before it were seen for `round`
  };
  Cursor arrived_cursor_;
  // PostAreas: the last round posted to each remote rank (remote_ranks_ order), to every one; per lane, the remote
  // rank (index in remote_ranks_) a pass asks first for that lane's round in progress; which ones a round takes.
  std::vector<uint64_t> posted_to_;
  uint64_t posted_all_ = 0;
  std::vector<size_t> ask_from_;
  std::vector<char> take_;
};

// "[1, 3]"
std::string RankList(const std::vector<int32_t>& ranks);

}  // namespace jax_moe::proxy
