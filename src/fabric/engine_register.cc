// EngineCore memory registration: Register() and Deregister() (their backend calls run on the progress thread).
#include "fabric/engine_core.h"

#include "common/error.h"

namespace jax_moe::fabric {

std::shared_ptr<MemoryRegion> EngineCore::Register(void* ptr, uint64_t nbytes, const MemorySpec& mem) {
  const int device = mem.device;
  CheckOpen();
  Require(ptr != nullptr, "register: null pointer");
  Require(nbytes > 0, "register: empty region");
  Require(reinterpret_cast<uint64_t>(ptr) + nbytes >= reinterpret_cast<uint64_t>(ptr), "register: region wraps");
  if (device >= 0 && !caps_.device_memory) {
    Throw(ErrorCode::kUnavailable, "register: provider " + caps_.provider +
                                       " did not grant FI_HMEM: it cannot register CUDA memory (libfabric needs CUDA: "
                                       "configure --with-cuda; AWS's EFA libfabric has it)");
  }
  std::unique_ptr<BackendRegion> br;
  if (device >= 0 && options_.fake_device_memory) {
    MemorySpec host;  // the bytes are host memory in such tests: registered as such, carried as device regions
    RunOnProgress([&] { br = backend_->Register(ptr, nbytes, host); });
    br->how = Registration::kFakeDevice;
  } else {
    RunOnProgress([&] { br = backend_->Register(ptr, nbytes, mem); });
  }
  std::shared_ptr<MemoryRegion> mr(new MemoryRegion());
  mr->core_ = weak_from_this();
  mr->ptr_ = ptr;
  mr->size_ = nbytes;
  mr->device_ = device;
  mr->how_ = br->how;
  mr->descriptor_.owner = nonce_;
  mr->descriptor_.base = reinterpret_cast<uint64_t>(ptr);
  mr->descriptor_.size = nbytes;
  mr->descriptor_.flags = device >= 0 ? RegionDescriptor::kFlagDevice : 0;
  mr->descriptor_.keys = br->keys;
  std::lock_guard<std::mutex> lock(mu_);
  mr->id_ = next_region_id_++;
  regions_[mr->id_].region = std::move(br);
  regions_[mr->id_].descriptor = mr->descriptor_;
  return mr;
}

void EngineCore::Deregister(uint64_t id) {
  if (closed_.load()) return;
  std::unique_ptr<BackendRegion> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return;
    region = std::move(it->second.region);
    regions_.erase(it);
  }
  // fi_close must run on the progress thread; hand the registration over and let it die there.
  auto holder = std::make_shared<std::unique_ptr<BackendRegion>>(std::move(region));
  try {
    RunOnProgress([holder] { holder->reset(); });
  } catch (const Error&) {
    // Engine closed meanwhile: the backend already released everything.
    holder->release();
  }
}

}  // namespace jax_moe::fabric
