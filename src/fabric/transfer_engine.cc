#include "fabric/transfer_engine.h"

#include "common/error.h"
#include "fabric/engine_core.h"

namespace jax_moe::fabric {

MemoryRegion::~MemoryRegion() {
  if (auto core = core_.lock()) {
    try {
      core->Deregister(id_);
    } catch (...) {
      // Destructors must not throw; a failed deregistration only leaks until the engine closes.
    }
  }
}

TransferEngine::TransferEngine(const EngineOptions& options) : core_(std::make_shared<EngineCore>(options)) {
  core_->Start();
}

TransferEngine::~TransferEngine() { Close(); }

std::string TransferEngine::Address() const {
  core_->CheckOpen();
  return core_->address();
}
std::string TransferEngine::provider() const {
  return EngineAddress::Parse(core_->address()).provider;
}
int TransferEngine::num_nics() const { return core_->num_nics(); }
uint32_t TransferEngine::max_imm() const {
  core_->CheckOpen();
  return core_->max_imm();
}

std::shared_ptr<MemoryRegion> TransferEngine::Register(void* ptr, uint64_t nbytes, int device) {
  MemorySpec mem;
  mem.device = device;
  return core_->Register(ptr, nbytes, mem);
}

std::shared_ptr<MemoryRegion> TransferEngine::Register(void* ptr, uint64_t nbytes, const MemorySpec& mem) {
  return core_->Register(ptr, nbytes, mem);
}

bool TransferEngine::supports_device_memory() const { return core_->supports_device_memory();
}

PeerId TransferEngine::Connect(const std::string& address, double timeout_s) {
  return core_->Connect(address, timeout_s);
}

PeerSetId TransferEngine::CreatePeerSet(const std::vector<PeerId>& peers,
                                        const std::vector<RegionDescriptor>& regions) {
  return core_->CreatePeerSet(peers, regions);
}

size_t TransferEngine::PeerSetSize(PeerSetId set) const { return core_->PeerSetSize(set); }

void TransferEngine::Scatter(PeerSetId set, const MemoryRegion& src, const uint64_t* src_offsets,
                             const uint64_t* lengths, const uint64_t* dst_offsets, size_t n,
                             std::optional<uint32_t> imm) {
  core_->Scatter(set, &src, src_offsets, lengths, dst_offsets, n, imm, /*zero_byte=*/false);
}

void TransferEngine::Barrier(PeerSetId set, uint32_t imm) {
  core_->Scatter(set, nullptr, nullptr, nullptr, nullptr, core_->PeerSetSize(set), imm, /*zero_byte=*/true);
}

void TransferEngine::Write(PeerId peer, const MemoryRegion& src, uint64_t src_offset, uint64_t length,
                           const RegionDescriptor& dst, uint64_t dst_offset, std::optional<uint32_t> imm,
                           std::optional<PeerSetId> counted_in) {
  core_->Write(peer, src, src_offset, length, dst, dst_offset, imm, counted_in);
}

void TransferEngine::WaitImm(uint32_t imm, uint64_t count, double timeout_s) { core_->WaitImm(imm, count, timeout_s); }

void TransferEngine::WaitImmFrom(uint32_t imm, const std::vector<PeerId>& peers, double timeout_s) {
  core_->WaitImmFrom(imm, peers, timeout_s);
}

void TransferEngine::WaitSends(double timeout_s) { core_->WaitSends(timeout_s); }

bool TransferEngine::TryConsumeImm(uint32_t imm, uint64_t count) { return core_->TryConsumeImm(imm, count); }
uint64_t TransferEngine::BankedImm(uint32_t imm) const { return core_->BankedImm(imm); }
uint64_t TransferEngine::AddProgressHook(std::function<bool()> hook) { return core_->AddProgressHook(std::move(hook)); }
void TransferEngine::RemoveProgressHook(uint64_t id) { core_->RemoveProgressHook(id); }
uint64_t TransferEngine::SendsInFlight(PeerSetId set) const { return core_->SendsInFlight(set); }
uint64_t TransferEngine::DiscardImms(uint32_t mask, uint32_t value) { return core_->DiscardImms(mask, value); }
void TransferEngine::DestroyPeerSet(PeerSetId set) { core_->DestroyPeerSet(set); }

uint64_t TransferEngine::SendsInFlight() const {
  EngineStats s = core_->Stats();
  return s.writes_posted - s.writes_completed;
}

std::vector<PeerInfo> TransferEngine::Peers() const { return core_->Peers(); }
EngineStats TransferEngine::Stats() const { return core_->Stats(); }

void TransferEngine::Close() { core_->Close(); }

}  // namespace jax_moe::fabric
