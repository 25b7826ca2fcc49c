#include "proxy/pump.h"

#include <chrono>

#include "common/error.h"
#include "common/format.h"

namespace jax_moe::proxy {
namespace {

uint64_t Load(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
void Store(uint64_t* word, uint64_t v) { __atomic_store_n(word, v, __ATOMIC_RELEASE); }

constexpr uint64_t kTraceRounds = 1 << 14;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Pump::Pump(std::vector<Link> links, double timeout_s, std::function<std::string(int64_t)> name, bool own_thread,
           Hooks hooks)
    : links_(std::move(links)), timeout_s_(timeout_s), name_(std::move(name)), hooks_(std::move(hooks)) {
  Require(timeout_s > 0, "Pump: timeout must be positive");
  for (const Link& l : links_) Require(l.channel && l.area && l.bell && l.bytes, "Pump: incomplete link");
  states_.resize(links_.size());
  traces_.assign(links_.size(), std::vector<std::array<int64_t, 3>>(kTraceRounds, {0, 0, 0}));
  fabric::TransferEngine* engine = links_.empty() ? nullptr : links_[0].channel->engine();
  for (const Link& l : links_) engine = l.channel->engine() == engine ? engine : nullptr;
  if (engine && !own_thread) {
    hook_ = engine->AddProgressHook([this] { return StepAll(); });
    hooked_ = engine;
  } else {
    thread_ = std::thread([this] { Loop(); });
  }
}

Pump::~Pump() {
  stop_.store(true);
  if (hooked_) hooked_->RemoveProgressHook(hook_);  // returns once no pass of ours runs any more
  if (thread_.joinable()) thread_.join();
}

void Pump::Drain(double bound_s) {
  try {
    DrainOrThrow(bound_s);
  } catch (const std::exception&) {  // a closed engine: nothing more will come (callers are destructors)
  }
}

void Pump::DrainOrThrow(double bound_s) {
  const double end = Now() + bound_s;
  while (Now() < end && error().empty()) {
    bool drained = true;
    for (size_t i = 0; i < links_.size() && drained; ++i) {
      std::lock_guard<std::mutex> lock(links_[i].channel->mu());
      const Link& l = links_[i];
      // Ours posted and read by every receiver; theirs credited, and those credits on the wire.
      drained = states_[i].posted == Load(l.bell + kRung) && l.channel->Drained() &&
                states_[i].released == Load(l.bell + kRead) && l.channel->SendsInFlight() == 0;
    }
    if (drained) return;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

std::vector<std::array<int64_t, 3>> Pump::Trace(size_t link) const {
  if (link >= links_.size()) return {};
  std::lock_guard<std::mutex> lock(links_[link].channel->mu());
  return traces_[link];
}

std::string Pump::error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_;
}

ErrorCode Pump::error_code() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_code_;
}

void Pump::Stop(const std::string& why, ErrorCode code) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.empty()) {
      error_ = why;
      error_code_ = code;
    }
  }
  for (Link& l : links_) Store(l.bell + kError, 1);
  stop_.store(true);
}

// One pass over a link: post what the device rang (as far as credits allow), raise `sent` once the NIC is done with
// it, raise `arrived` for every round whose remote regions are all here, and give credit for what the device read.
bool Pump::Step(Link& link, State& st) {
  Channel& ch = *link.channel;
  bool moved = false;
  const uint64_t rung = Load(link.bell + kRung);
  const size_t index = size_t(&link - links_.data());
  auto& trace = traces_[index];
  if (rung > 0 && rung <= kTraceRounds && trace[rung - 1][0] == 0) trace[rung - 1][0] = NowNs();
  // The hook runs as soon as the device rang (its copy overlaps the wait for credits), rounds in order; then each
  // receiver gets the rounds the hook released as its own credits come (Channel::PostAreas).
  while (st.hooked < rung && (!hooks_.before_post || hooks_.before_post(index, st.hooked + 1))) ++st.hooked;
  const uint64_t posted = ch.PostAreas(st.hooked, *link.area, link.bytes);
  while (st.posted < posted) {  // posted to every remote rank
    ++st.posted;
    if (st.posted <= kTraceRounds) trace[st.posted - 1][1] = NowNs();
    ch.NextSendRound();
    moved = true;
  }
  // The channel's own writes, not the engine's: other Communicators' pumps post through the same engine.
  if (Load(link.bell + kSent) < st.posted && ch.SendsInFlight() == 0) {
    Store(link.bell + kSent, st.posted);
    moved = true;
  }
  while (ch.Arrived(st.flagged + 1, nullptr)) {  // no list of who is missing on the data path: only for the error
    if (hooks_.before_arrival && !hooks_.before_arrival(index, st.flagged + 1)) break;
    Store(link.bell + kArrived, ++st.flagged);
    if (st.flagged <= kTraceRounds) trace[st.flagged - 1][2] = NowNs();
    st.waiting_since = -1;
    moved = true;
  }
  // A round is late only once the device rang it itself (every rank runs the same program): the clock starts then.
  // The clock is read when the wait starts and then every 256th pass (a clock read may be a system call in a VM).
  if (st.flagged < rung && (st.waiting_since < 0 || (++st.waits & 255) == 0)) {
    const double now = Now();
    if (st.waiting_since < 0) st.waiting_since = now;
    if (now - st.waiting_since > timeout_s_) {
      std::vector<int32_t> missing;
      if (ch.Arrived(st.flagged + 1, &missing)) {
        if (now - st.waiting_since <= 2 * timeout_s_) return true;  // it came in just now: the next pass flags it
        Stop(std::string(ch.config().name) + " on " + name_(ch.config().rank) + ": round " +
                 std::to_string(st.flagged + 1) + " arrived, but the device side was not ready to read it within " +
                 Format("%g", 2 * timeout_s_) + " s (a copy into GPU memory that never completed)",
             ErrorCode::kInternal);
        return false;
      }
      std::string names;
      for (int32_t p : missing) names += (names.empty() ? "" : ", ") + name_(p);
      Stop(std::string(ch.config().name) + " on " + name_(ch.config().rank) + ": no data from " + names +
           " within " + Format("%g", timeout_s_) + " s (round " + std::to_string(st.flagged + 1) +
           "): its process may have died or stopped calling this Communicator",
           ErrorCode::kTimeout);
      return false;
    }
  }
  const uint64_t read = Load(link.bell + kRead);
  while (st.released < read && st.released < st.flagged) {
    ch.Release(++st.released);
    ch.CountReceived(st.released);
    moved = true;
  }
  return moved;
}

// True while anything moved or a round of the device is in flight (rung and not yet posted or flagged, or read and
// not yet credited): the engine's progress thread then stays hot instead of napping between passes.
bool Pump::StepAll() {
  if (stop_.load(std::memory_order_relaxed)) return false;
  bool busy = false;
  try {
    for (size_t i = 0; i < links_.size(); ++i) {
      std::lock_guard<std::mutex> lock(links_[i].channel->mu());
      busy |= Step(links_[i], states_[i]);
      const State& st = states_[i];
      const uint64_t rung = Load(links_[i].bell + kRung);
      busy |= st.posted < rung || st.flagged < rung || st.released < Load(links_[i].bell + kRead);
    }
  } catch (const Error& e) {
    Stop(e.what(), e.code() == ErrorCode::kTimeout ? ErrorCode::kTimeout : ErrorCode::kPeerFailed);
  } catch (const std::exception& e) {
    Stop(e.what(), ErrorCode::kInternal);
  }
  return busy;
}

void Pump::Loop() {
  while (!stop_.load(std::memory_order_relaxed)) {
    // Busy while rounds move; a short nap when idle keeps the core free between layers.
    if (!StepAll()) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace jax_moe::proxy
