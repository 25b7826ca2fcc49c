#include "proxy/engine_pool.h"

#include "common/error.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/error.h"

namespace jax_moe::proxy {

namespace {

using Clock = std::chrono::steady_clock;
using Key = std::pair<std::string, std::string>;

struct Entry {
  std::shared_ptr<fabric::TransferEngine> engine;
  int64_t users = 0;
  Clock::time_point close_at;                // when users == 0
  std::vector<std::shared_ptr<void>> keep;  // KeepUntilClosed: released once the engine is closed
};

// Closes the engines (each joins its progress thread), then releases what had to outlive them. Outside the lock.
void Close(std::vector<Entry>& doomed) {
  for (Entry& e : doomed) {
    e.engine.reset();
    e.keep.clear();
  }
  doomed.clear();
}

struct Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::map<Key, Entry> engines;
  std::thread closer;  // closes engines whose linger ended; started on the first release
  bool stop = false;
};

// Never destroyed: engines must not be closed by static destructors, after libfabric may have finalized. At interpreter
// exit CloseIdleEngines runs first (an atexit hook of the Python binding).
Pool& GetPool() {
  static Pool* pool = new Pool;
  return *pool;
}

void CloserLoop() {
  Pool& pool = GetPool();
  std::unique_lock<std::mutex> lock(pool.mu);
  while (!pool.stop) {
    std::vector<Entry> doomed;
    Clock::time_point next = Clock::time_point::max();
    const Clock::time_point now = Clock::now();
    for (auto it = pool.engines.begin(); it != pool.engines.end();) {
      if (it->second.users == 0 && it->second.close_at <= now) {
        doomed.push_back(std::move(it->second));
        it = pool.engines.erase(it);
      } else {
        if (it->second.users == 0) next = std::min(next, it->second.close_at);
        ++it;
      }
    }
    if (!doomed.empty()) {
      lock.unlock();
      Close(doomed);
      lock.lock();
      continue;
    }
    if (next == Clock::time_point::max()) {
      pool.cv.wait(lock);
    } else {
      pool.cv.wait_until(lock, next);
    }
  }
}

void Release(const Key& key) {
  Pool& pool = GetPool();
  std::lock_guard<std::mutex> lock(pool.mu);
  auto it = pool.engines.find(key);
  if (it == pool.engines.end() || --it->second.users > 0) return;
  it->second.close_at =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kEngineLingerS));
  if (!pool.stop && !pool.closer.joinable()) pool.closer = std::thread(CloserLoop);  // stop: CloseIdleEngines runs
  pool.cv.notify_all();
}

}  // namespace

std::shared_ptr<fabric::TransferEngine> AcquireEngine(const std::string& device, const std::string& provider,
                                                      fabric::EngineOptions options) {
  Pool& pool = GetPool();
  const Key key{device, provider};
  std::lock_guard<std::mutex> lock(pool.mu);
  Entry& e = pool.engines[key];
  if (!e.engine) {
    try {
      options.provider = provider;
      e.engine = std::make_shared<fabric::TransferEngine>(options);
    } catch (...) {
      pool.engines.erase(key);
      throw;
    }
  }
  ++e.users;
  // The handle does not own the engine: its deleter gives the use back, and the pool closes the engine when the
  // last use is gone (never while a handle exists).
  return std::shared_ptr<fabric::TransferEngine>(e.engine.get(), [key](fabric::TransferEngine*) { Release(key); });
}

void CloseIdleEngines() {
  Pool& pool = GetPool();
  std::thread closer;
  std::vector<Entry> doomed;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.stop = true;
    closer = std::move(pool.closer);
    pool.cv.notify_all();
  }
  if (closer.joinable()) closer.join();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.stop = false;
    for (auto it = pool.engines.begin(); it != pool.engines.end();) {
      if (it->second.users == 0) {
        doomed.push_back(std::move(it->second));
        it = pool.engines.erase(it);
      } else {
        ++it;
      }
    }
  }
  Close(doomed);
}

void KeepUntilClosed(const std::string& device, const std::string& provider, std::shared_ptr<void> what) {
  Pool& pool = GetPool();
  std::lock_guard<std::mutex> lock(pool.mu);
  auto it = pool.engines.find(Key{device, provider});
  Require(it != pool.engines.end(), "KeepUntilClosed: no engine of " + device + " and " + provider + " is open");
  it->second.keep.push_back(std::move(what));
}

int64_t OpenEngines() {
  Pool& pool = GetPool();
  std::lock_guard<std::mutex> lock(pool.mu);
  return int64_t(pool.engines.size());
}

}  // namespace jax_moe::proxy
