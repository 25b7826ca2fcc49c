// Per-Communicator CUDA resources: one buffer per local device, the peers' buffers mapped into it (peer access in one
// process, CUDA IPC across processes), and a host-mapped error word. Created from Python before the first call;
// looked up by the FFI handlers by (Communicator id, device ordinal). Thread-safe: XLA calls each device's handler from its
// own thread.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device_fabric.h"
#include "kernels/moe_layout.h"

namespace jax_moe::cuda {

// How a device reaches one peer's buffer. kRemote: not at all; the peer is on another node, reached through the host
// proxy (cuda/device_fabric.h).
enum class PeerKind { kSelf = 0, kLocalDevice = 1, kIpc = 2, kRemote = 3 };

struct PeerSpec {
  int rank = 0;
  PeerKind kind = PeerKind::kSelf;
  int ordinal = -1;   // kLocalDevice: the peer's device ordinal in this process
  std::string ipc;    // kIpc: the peer's exported cudaIpcMemHandle_t bytes
  std::string where;  // how errors name the rank's place, e.g. "process 1 on host h, GPU 1"
};

// The round streams of a device: dispatch, and combine per channel. A send whose stream still has a round that was
// never received would wait (on the stream) for an acknowledgement that never comes.
constexpr int kRoundStreams = 1 + kCombineChannels;

// A device's host-mapped words, host_error[kErrorWord ...]: args.error, args.timeout (both written by the device
// only) and args.error_ack (written by the host only).
enum HostWord { kErrorWord = 0, kTimeoutWord = 1, kAckWord = 2, kHostWords = 4 };

// One device's membership in one Communicator. Owns its CUDA allocations.
struct DeviceComm {
  DeviceComm() = default;
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;
  ~DeviceComm();

  int ordinal = -1;
  KernelArgs args;                  // args.base, args.error: this device's buffer and error word
  unsigned long long* host_error = nullptr;  // host view of this device's kHostWords words (see HostWord)
  // The mapped words of every local device of the Communicator, shared: a handler holding one device reads the others'
  // timeout words (comm_timeouts), so they are freed with the last device, not the first.
  std::shared_ptr<unsigned long long> host_words;
  std::vector<const unsigned long long*> comm_timeouts;  // the timeout words of every local device of the Communicator
  std::vector<void*> ipc_mapped;    // peers' buffers opened through IPC (closed on destruction)
  std::vector<std::string> names;   // [N] "rank r (process p on host h, GPU g)", for error messages
  std::vector<bool> remote;         // [N] ranks on other nodes
  std::unique_ptr<DeviceFabric> fabric;  // when some rank is remote: areas, engine and pump (set up before launches)
  double timeout_s = 0;
  bool connected = false;
  // Rounds launched and not yet received, per round stream (dispatch, combine channel 0, 1); the handlers of one
  // device run in program order on one host thread at a time.
  mutable std::atomic<int64_t> open_rounds[kRoundStreams]{};
  // Sends launched by the plain handlers per round stream: the round each one rings (cuda/run_ahead.h).
  mutable std::atomic<uint64_t> sends_launched[kRoundStreams]{};
};

// Creates the Communicator `id` on the given local devices ((ordinal, rank) pairs). Throws
// jax_moe::Error (with the failing CUDA call's name) on failure.
void CreateComm(int64_t id, const MoeShape& shape, const std::vector<std::pair<int, int>>& devices,
                 long long timeout_ns);
// The IPC handle of a device's buffer, for peers in other processes.
std::string ExportBuffer(int64_t id, int ordinal);
// Maps every peer's buffer (peers[i].rank == i) into this device's peer table; enables peer access where needed.
void ConnectComm(int64_t id, int ordinal, const std::vector<PeerSpec>& peers);
void DestroyComm(int64_t id);
// Every Communicator of the process (at exit).
void DestroyAllComms();
// For a device with remote ranks (after ConnectComm): its engine, areas and pump on `provider`. Returns the engine's
// address and the receive areas' descriptors, for the remote ranks' processes. held: the device's sends go through
// the plain handlers, which hold the host back (cuda/run_ahead.h); "auto" stages through HBM only then. nodes: every
// rank's node, the same on every rank (the areas hold regions for other nodes' ranks only, and a sender finds its
// region in a receiver's area from them); the ranks remote to this device must be those ConnectComm was told of.
std::pair<std::string, std::vector<std::string>> OpenFabric(int64_t id, int ordinal, const std::string& provider,
                                                             const std::vector<int32_t>& nodes,
                                                             AreaMemory memory = AreaMemory::kAuto, bool held = false);
// Connects the device to its remote ranks and starts its pump; then the device may launch.
void ConnectFabric(int64_t id, int ordinal, const std::vector<RemoteEndpoint>& peers);

// The handlers' view. Null when unknown; the shared_ptr keeps the Communicator alive during a launch.
std::shared_ptr<const DeviceComm> FindDevice(int64_t id, int ordinal);
// The device-side trace ([kTraceRing][kHalves][kTracePoints] %globaltimer ns; zeros unless JAX_MOE_CUDA_TRACE=1
// when the Communicator was made). Synchronous: for benchmarks and diagnostics only.
std::vector<unsigned long long> ReadTrace(int64_t id, int ordinal);
// Bytes of one device's buffer for this shape.
size_t BufferBytes(const MoeShape& shape);

}  // namespace jax_moe::cuda
