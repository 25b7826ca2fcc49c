// EngineCore lifecycle: open the backend, start and close the progress thread, run calls on it; peers and stats.
#include "fabric/engine_core.h"

#include <unistd.h>

#include <chrono>
#include <random>

#include "common/error.h"

namespace jax_moe::fabric {

namespace {

uint64_t MakeNonce() {
  std::random_device rd;
  uint64_t t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (t * 0x9e3779b97f4a7c15ull) ^
               (static_cast<uint64_t>(getpid()) << 17);
  return v == 0 ? 1 : v;
}

}  // namespace

EngineCore::EngineCore(const EngineOptions& options) : options_(options) {
  Require(options.num_nics >= 1 && options.num_nics <= 16, "num_nics must be in [1, 16]");
  backend_ = OpenBackend(options.provider, options.num_nics, options.pci_bus_id, options.host_memory_only);
  num_nics_ = backend_->num_nics();
  caps_.provider = backend_->provider();
  caps_.max_imm = backend_->max_imm();
  caps_.max_write_bytes = backend_->max_write_bytes();
  caps_.remote_virt_addr = backend_->remote_virt_addr();
  Require(!(options.fake_device_memory && options.host_memory_only),
          "fake_device_memory and host_memory_only contradict each other");
  // host_memory_only: device memory is refused on every backend (verbs never asks its NIC anything up front).
  caps_.device_memory = !options.host_memory_only && (options.fake_device_memory || backend_->supports_device_memory());
  nonce_ = MakeNonce();
  EngineAddress addr;
  addr.nonce = nonce_;
  addr.provider = backend_->provider();
  for (int i = 0; i < num_nics_; ++i) addr.nics.push_back(backend_->NicAddress(i));
  address_ = addr.Serialize();
  imms_per_nic_ = std::vector<std::atomic<uint64_t>>(num_nics_);
}

EngineCore::~EngineCore() { Close(); }

void EngineCore::Start() {
  thread_ = std::thread([this] { ProgressLoop(); });
}

void EngineCore::CheckImm(uint64_t imm) const {
  const uint32_t max = caps_.max_imm;
  JAX_MOE_REQUIRE(imm <= max, "imm " + std::to_string(imm) + " out of range: this provider carries immediates in [0, " +
                          std::to_string(max) + "]");
}

void EngineCore::CheckOpen() const {
  if (closed_.load()) Throw(ErrorCode::kClosed, "TransferEngine is closed");
}

void EngineCore::Close() {
  if (closed_.exchange(true)) return;
  stop_ = true;
  sq_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  imms_.Shutdown();
  {
    std::lock_guard<std::mutex> lock(sq_mu_);
    for (auto& call : sq_calls_) {
      std::lock_guard<std::mutex> l(call.state->mu);
      call.state->error = std::make_exception_ptr(Error(ErrorCode::kClosed, "TransferEngine is closed"));
      call.state->done = true;
      call.state->cv.notify_all();
    }
    sq_calls_.clear();
    sq_writes_.clear();
  }
  peers_cv_.notify_all();
  sends_cv_.notify_all();
  std::lock_guard<std::mutex> lock(mu_);
  regions_.clear();  // closes memory registrations before their domains
  backend_.reset();
  backlog_.clear();
  pending_sends_.clear();
  free_ops_.clear();
  all_ops_.clear();
}

void EngineCore::RunOnProgress(std::function<void()> fn) {
  CheckOpen();
  auto state = std::make_shared<CallState>();
  {
    std::lock_guard<std::mutex> lock(sq_mu_);
    // Checked under sq_mu_: Close() fails queued calls under it after the thread stopped.
    if (stop_.load()) Throw(ErrorCode::kClosed, "TransferEngine is closed");
    sq_calls_.push_back({std::move(fn), state});
    sq_nonempty_ = true;
  }
  sq_cv_.notify_one();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done; });
  if (state->error) std::rethrow_exception(state->error);
}

std::vector<PeerInfo> EngineCore::Peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerInfo> out;
  for (const auto& p : peers_) out.push_back({p->id, p->label, p->nic, p->failed.load(), p->failure});
  return out;
}

EngineStats EngineCore::Stats() const {
  EngineStats s;
  // Completed first: a write posted and completed between the two loads then only counts as in flight, never the
  // other way round (SendsInFlight must not read 0 while a write is still out).
  s.writes_completed = writes_completed_.load();
  s.writes_posted = writes_posted_.load();
  s.write_errors = write_errors_.load();
  for (const auto& c : imms_per_nic_) s.imms_per_nic.push_back(c.load());
  s.notices_apart = notices_apart_.load(std::memory_order_relaxed);
  const double ns = profile_.NsPerTick();
  s.progress_passes = profile_.passes.load(std::memory_order_relaxed);
  s.progress_ns = ns * double(profile_.pass_ticks.load(std::memory_order_relaxed));
  s.poll_ns = ns * double(profile_.ticks[PassProfile::kPoll].load(std::memory_order_relaxed));
  s.hooks_ns = ns * double(profile_.ticks[PassProfile::kHooks].load(std::memory_order_relaxed));
  s.post_ns = ns * double(profile_.ticks[PassProfile::kPost].load(std::memory_order_relaxed));
  s.longest_poll_ns = ns * double(profile_.longest[PassProfile::kPoll].load(std::memory_order_relaxed));
  s.longest_hooks_ns = ns * double(profile_.longest[PassProfile::kHooks].load(std::memory_order_relaxed));
  s.longest_post_ns = ns * double(profile_.longest[PassProfile::kPost].load(std::memory_order_relaxed));
  return s;
}

}  // namespace jax_moe::fabric
