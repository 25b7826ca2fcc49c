// `jax_moe._core.proxy_testing`: one rank of the GPU proxy path with a host thread (Python) playing the GPU. The
// rank owns its send area, receive area and doorbell words in host memory, a TransferEngine, one channel (dispatch)
// whose peers are all in other processes, and the Pump that serves it: the same proxy code a GPU rank runs, minus
// the kernels. Python writes regions and rings, the pump posts, counts arrivals, raises flags and returns credits.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "cpu/host_buffer.h"
#include "fabric/transfer_engine.h"
#include "proxy/channel.h"
#include "proxy/pump.h"
#include "proxy/region_header.h"
#include "python/registry.h"

namespace nb = nanobind;

namespace jax_moe::py {
namespace {

using proxy::Pump;

proxy::MoeShape Shape(int n, int max_tokens, int hidden) {
  proxy::MoeShape s;
  s.num_ranks = n;
  s.num_experts = n;
  s.local_experts = 1;
  s.experts_per_token = 1;
  s.hidden = hidden;
  s.max_tokens = max_tokens;
  if (*s.Problem()) Throw(ErrorCode::kInvalidArgument, s.Problem());
  return s;
}

uint64_t RegionBytes(const proxy::MoeShape& s) {
  return proxy::AlignUp(proxy::RegionHeaderBytes(s) + uint64_t(s.rows_per_peer()) * s.dispatch_row_bytes(), 64);
}

class PumpRank {
 public:
  // The regions of a dispatch of `max_tokens` tokens of `hidden` bf16 channels, one expert per rank, top-1.
  // share: another PumpRank of this process whose engine this one uses too (two Communicators of one GPU).
  // nodes: every rank's node, laying the buffers out for the ranks on other nodes only, as a GPU's
  // (proxy::RegionSlots::OtherNodes; ranks of our node are served by the device, here nobody); empty: a region per
  // rank, every other rank remote.
  PumpRank(const std::string& provider, int rank, int n, int lanes, int max_tokens, int hidden, uint32_t comm_id,
           double timeout_s, bool busy_poll, const PumpRank* share, const std::vector<int32_t>& nodes)
      : rank_(rank),
        n_(n),
        comm_id_(comm_id),
        timeout_s_(timeout_s),
        shape_(Shape(n, max_tokens, hidden)),
        slots_(nodes.empty() ? proxy::RegionSlots::EveryRank(n) : proxy::RegionSlots::OtherNodes(nodes)),
        lanes_{Checked(rank, n, nodes, slots_), lanes, RegionBytes(shape_)},
        send_(lanes_.buffer_bytes()),
        recv_(lanes_.buffer_bytes()),
        bell_(sizeof(uint64_t) * proxy::kBellWords),
        bytes_(sizeof(uint64_t) * n * lanes) {
    Require(lanes >= 2 && lanes <= proxy::kMaxLanes, "PumpRank: bad lanes");
    fabric::EngineOptions options;
    options.provider = provider;
    options.busy_poll = busy_poll;  // a GPU's proxy spins on its core; tests on 2 cores share them
    shared_ = share != nullptr;
    engine_ = shared_ ? share->engine_ : std::make_shared<fabric::TransferEngine>(options);
    send_mr_ = engine_->Register(send_.data(), send_.size());
    recv_mr_ = engine_->Register(recv_.data(), recv_.size());
    proxy::ChannelConfig config;
    config.name = "dispatch";
    config.data_kind = proxy::ImmKind::kDispatchData;
    config.credit_kind = proxy::ImmKind::kDispatchCredit;
    config.comm_id = comm_id;
    config.rank = rank;
    config.lanes = lanes_;
    config.slots = slots_;
    std::vector<bool> remote(n, true);
    for (int p = 0; p < n; ++p) remote[p] = p != rank && (nodes.empty() || nodes[p] != nodes[rank]);
    channel_ = std::make_unique<proxy::Channel>(
        config, remote, engine_, &local_, [](uint64_t) -> proxy::Block { Throw(ErrorCode::kInternal, "no staging"); },
        mu_, cv_);
  }
  ~PumpRank() { Close(); }

  nb::bytes Address() const {
    std::string a = engine_->Address();
    return nb::bytes(a.data(), a.size());
  }
  nb::bytes Descriptor() const {
    std::string d = recv_mr_->descriptor().Serialize();
    return nb::bytes(d.data(), d.size());
  }
  // peers: (address, receive descriptor) of every remote rank, in rank order.
  void Connect(const std::vector<std::tuple<nb::bytes, nb::bytes>>& peers) {
    std::vector<fabric::PeerId> ids;
    std::vector<fabric::RegionDescriptor> regions;
    for (const auto& [address, descriptor] : peers) {
      ids.push_back(engine_->Connect(std::string(address.c_str(), address.size()), timeout_s_));
      regions.push_back(fabric::RegionDescriptor::Parse(std::string(descriptor.c_str(), descriptor.size())));
    }
    channel_->Connect(ids, std::move(regions));
  }
  // not_ready: the device side's hooks (a GPU's copy engine, cuda/stage_copies.h) say "not yet" to the first
  // `not_ready` questions about each round before posting it and before flagging it; -1: the arrival hook never
  // says yes (a copy that never completes). The hooks also check that they are asked in round order.
  void Start(bool own_thread, int not_ready) {
    Require(!pump_, "PumpRank: started twice");
    Pump::Link link{channel_.get(), send_mr_.get(), reinterpret_cast<uint64_t*>(bell_.data()),
                    reinterpret_cast<const uint64_t*>(bytes_.data())};
    Pump::Hooks hooks;
    if (not_ready != 0) {
      auto gate = [this, not_ready](int which, uint64_t round) {
        Gate& g = gates_[which];
        if (g.round != round) {
          Require(round == g.round + 1, "PumpRank: a hook was asked about round " + std::to_string(round) +
                                            " after round " + std::to_string(g.round));
          g = {round, 0};
        }
        if (not_ready < 0) return which == 0;  // posts go out; arrivals are never ready
        return ++g.calls > not_ready;
      };
      hooks.before_post = [gate](size_t, uint64_t round) { return gate(0, round); };
      hooks.before_arrival = [gate](size_t, uint64_t round) { return gate(1, round); };
    }
    pump_ = std::make_unique<Pump>(std::vector<Pump::Link>{link}, timeout_s_,
                                   [](int64_t r) { return "rank " + std::to_string(r); }, own_thread,
                                   std::move(hooks));
  }
  void Close() {
    if (pump_) pump_->Drain(timeout_s_ < 5 ? timeout_s_ : 5);
    pump_.reset();
    channel_.reset();  // gives the engine its peer set and banked immediates back
    if (engine_ && !shared_) engine_->Close();
  }

  // The device's side.
  void WriteRegion(uint64_t round, int peer, const nb::bytes& data) {
    Require(data.size() <= lanes_.region_bytes, "write_region: more than a region");
    std::memcpy(send_.data() + lanes_.Offset(round, SlotOf(peer, "write_region")), data.c_str(), data.size());
  }
  nb::bytes ReadRegion(uint64_t round, int sender, uint64_t size) const {
    Require(size <= lanes_.region_bytes, "read_region: more than a region");
    return nb::bytes(reinterpret_cast<const char*>(recv_.data() + lanes_.Offset(round, SlotOf(sender, "read_region"))),
                     size);
  }
  void SetBytes(uint64_t round, int peer, uint64_t v) {
    Require(peer >= 0 && peer < n_, "set_bytes: out of range");
    uint64_t* word = reinterpret_cast<uint64_t*>(bytes_.data()) + lanes_.Lane(round) * n_ + peer;
    __atomic_store_n(word, v, __ATOMIC_RELAXED);
  }
  // The checks a receiving device runs on a region before using it (proxy::CheckHeader): "" or what is wrong.
  std::string CheckRegion(uint64_t round, int sender) const {
    const uint8_t* region = recv_.data() + lanes_.Offset(round, SlotOf(sender, "check_region"));
    const auto* h = reinterpret_cast<const proxy::RegionHeader*>(region);
    return proxy::CheckHeader(*h, shape_, comm_id_, round, sender, true);
  }
  uint64_t Bell(int word) const {
    Require(word >= 0 && word < proxy::kBellWords, "bell: no such word");
    return __atomic_load_n(reinterpret_cast<const uint64_t*>(bell_.data()) + word, __ATOMIC_ACQUIRE);
  }
  void Ring(int word, uint64_t v) {
    Require(word == proxy::kRung || word == proxy::kRead, "ring: the device writes rung and read only");
    __atomic_store_n(reinterpret_cast<uint64_t*>(bell_.data()) + word, v, __ATOMIC_RELEASE);
  }
  // The benchmark's device, in C++ so that no interpreter sits on the measured path (a GPU has none): rounds
  // 1..warmup+iters of a ping-pong with `peer`. The leader rings first and waits for the answer; the other answers
  // each round as soon as its flag is up. Per measured round, steady-clock ns: (rung, arrival seen by the device).
  // The pump's Trace() gives the steps between; both ranks' clocks are the host's.
  std::vector<std::tuple<int64_t, int64_t>> PingPong(int peer, uint64_t size, int warmup, int iters, bool leader) {
    Require(size <= lanes_.region_bytes && pump_, "ping_pong: bad size, or the pump is not started");
    const int64_t slot = SlotOf(peer, "ping_pong");
    auto* bell = reinterpret_cast<uint64_t*>(bell_.data());
    auto* bytes = reinterpret_cast<uint64_t*>(bytes_.data());
    const auto spin = [&](int word, uint64_t v) {
      const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
      for (uint32_t i = 0; __atomic_load_n(bell + word, __ATOMIC_ACQUIRE) < v; ++i) {
        if ((i & 1023) == 0 && (__atomic_load_n(bell + proxy::kError, __ATOMIC_ACQUIRE) != 0 ||
                                std::chrono::steady_clock::now() > end))
          Throw(ErrorCode::kTimeout, "ping_pong: " + (pump_->error().empty() ? "no progress" : pump_->error()));
      }
    };
    const auto now = [] {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now().time_since_epoch()).count();
    };
    std::vector<std::tuple<int64_t, int64_t>> out;
    for (uint64_t k = 1; k <= uint64_t(warmup + iters); ++k) {
      int64_t seen = 0;
      if (!leader) {
        spin(proxy::kArrived, k);
        seen = now();
        __atomic_store_n(bell + proxy::kRead, k, __ATOMIC_RELEASE);
      }
      spin(proxy::kSent, k > uint64_t(lanes_.count) ? k - uint64_t(lanes_.count) : 0);
      uint8_t* region = send_.data() + lanes_.Offset(k, slot);
      std::memset(region, int(k & 0xff), size);
      __atomic_store_n(bytes + lanes_.Lane(k) * n_ + peer, size, __ATOMIC_RELAXED);
      const int64_t rung = now();
      __atomic_store_n(bell + proxy::kRung, k, __ATOMIC_RELEASE);
      if (leader) {
        spin(proxy::kArrived, k);
        seen = now();
        __atomic_store_n(bell + proxy::kRead, k, __ATOMIC_RELEASE);
      }
      if (k > uint64_t(warmup)) out.emplace_back(rung, seen);
    }
    return out;
  }
  // The engine's progress thread so far: (passes, ns in passes, in polling, in hooks, in posting).
  std::tuple<uint64_t, double, double, double, double> PassProfile() const {
    const fabric::EngineStats st = engine_->Stats();
    return {st.progress_passes, st.progress_ns, st.poll_ns, st.hooks_ns, st.post_ns};
  }
  uint64_t region_bytes() const { return lanes_.region_bytes; }
  uint64_t buffer_bytes() const { return lanes_.buffer_bytes(); }
  uint64_t header_bytes() const { return proxy::RegionHeaderBytes(shape_); }
  std::string Error() const { return pump_ ? pump_->error() : std::string(); }
  std::vector<std::tuple<int64_t, int64_t, int64_t>> Trace(int rounds) const {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    if (!pump_) return out;
    auto t = pump_->Trace();
    for (int i = 0; i < rounds && i < int(t.size()); ++i) out.emplace_back(t[i][0], t[i][1], t[i][2]);
    return out;
  }

 private:
  // Our buffers' regions per lane, once the arguments are known to be sound.
  static int64_t Checked(int rank, int n, const std::vector<int32_t>& nodes, const proxy::RegionSlots& slots) {
    Require(rank >= 0 && rank < n && (nodes.empty() || int(nodes.size()) == n), "PumpRank: bad rank or nodes");
    Require(slots.Slots(rank) > 0, "PumpRank: no rank on another node");
    return slots.Slots(rank);
  }
  // The slot of `peer`'s region in our buffers: a remote rank's only.
  int64_t SlotOf(int peer, const char* op) const {
    Require(peer >= 0 && peer < n_ && peer != rank_ && slots_.Slot(rank_, peer) >= 0,
            std::string(op) + ": not a remote rank");
    return slots_.Slot(rank_, peer);
  }

  int rank_;
  int n_;
  uint32_t comm_id_;
  double timeout_s_;
  proxy::MoeShape shape_;
  proxy::RegionSlots slots_;
  proxy::Lanes lanes_;
  cpu::HostBuffer send_, recv_, bell_, bytes_;  // zeroed, 64-byte aligned
  std::shared_ptr<fabric::TransferEngine> engine_;
  bool shared_ = false;  // engine_ is another PumpRank's: closing is that one's job
  std::shared_ptr<fabric::MemoryRegion> send_mr_, recv_mr_;
  proxy::NoPeersHere local_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<proxy::Channel> channel_;
  struct Gate {
    uint64_t round = 0;
    int calls = 0;
  };
  Gate gates_[2];  // the hooks' view (post, arrival), on the pump's thread only
  std::unique_ptr<Pump> pump_;
};

void RegisterProxyTesting(nb::module_& m) {
  nb::module_ t = m.def_submodule("proxy_testing", "The GPU proxy path with a host thread playing the GPU");
  t.attr("RUNG") = int(proxy::kRung);
  t.attr("SENT") = int(proxy::kSent);
  t.attr("ARRIVED") = int(proxy::kArrived);
  t.attr("READ") = int(proxy::kRead);
  t.attr("ERROR") = int(proxy::kError);
  nb::class_<PumpRank>(t, "PumpRank")
      .def(nb::init<const std::string&, int, int, int, int, int, uint32_t, double, bool, const PumpRank*,
                    const std::vector<int32_t>&>(),
           nb::arg("provider"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("lanes"), nb::arg("max_tokens"),
           nb::arg("hidden"), nb::arg("comm_id"), nb::arg("timeout_s"), nb::arg("busy_poll") = false,
           nb::arg("share_engine_of").none() = nb::none(), nb::arg("nodes") = std::vector<int32_t>(),
           nb::keep_alive<1, 11>())
      .def_prop_ro("region_bytes", [](const PumpRank& r) { return r.region_bytes(); })
      .def_prop_ro("buffer_bytes", [](const PumpRank& r) { return r.buffer_bytes(); })
      .def_prop_ro("header_bytes", [](const PumpRank& r) { return r.header_bytes(); })
      .def("check_region", &PumpRank::CheckRegion)
      .def("address", &PumpRank::Address)
      .def("descriptor", &PumpRank::Descriptor)
      .def("connect", &PumpRank::Connect, nb::call_guard<nb::gil_scoped_release>())
      .def("start", &PumpRank::Start, nb::arg("own_thread") = false, nb::arg("not_ready") = 0)
      .def("close", &PumpRank::Close, nb::call_guard<nb::gil_scoped_release>())
      .def("write_region", &PumpRank::WriteRegion)
      .def("read_region", &PumpRank::ReadRegion)
      .def("set_bytes", &PumpRank::SetBytes)
      .def("bell", &PumpRank::Bell)
      .def("ring", &PumpRank::Ring)
      .def("error", &PumpRank::Error)
      .def("pass_profile", &PumpRank::PassProfile,
           "the progress thread so far: (passes, ns in passes, ns polling, ns in hooks, ns posting)")
      .def("ping_pong", &PumpRank::PingPong, nb::arg("peer"), nb::arg("size"), nb::arg("warmup"), nb::arg("iters"),
           nb::arg("leader"), nb::call_guard<nb::gil_scoped_release>(),
           "the benchmark's device loop in C++: per measured round (rung, arrival seen), steady-clock ns")
      .def("trace", &PumpRank::Trace, "per round: (ring seen, posted, arrival flagged), steady-clock ns");
}

}  // namespace
}  // namespace jax_moe::py

JAX_MOE_PY_REGISTER(proxy_testing, jax_moe::py::RegisterProxyTesting);
