// The TransferEngines of a process: one per (device, provider), shared by every Communicator of that device (the
// "cpu" backend's CpuComms; on a GPU, every Communicator's fabric, whose pumps run side by side as progress hooks on
// the engine's one thread), closed when the last of them is gone (after a short linger), so that a process keeps no
// endpoint (and, with the shm provider, no 16 MB region in /dev/shm) for Communicators it no longer has. One engine
// per device, not per Communicator: a model's 61 MoE layers would otherwise spin 61 progress threads per GPU.
//
// The linger: a peer's last write to us (the credit it sends after its last receive) may still be on its way when
// our last Communicator goes; an endpoint closed under it leaves that write without completion on the peer (tcp),
// where it would hold up every later wait_sends of the peer's engine. A Communicator first waits for those credits
// (bounded); the linger covers what the transport still does after them (acks). A Communicator made during the
// linger takes the engine back.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "fabric/transfer_engine.h"

namespace jax_moe::proxy {

// The engine of `device` (a name unique in the process: "cpu:0", "cuda:1") and `provider`, opened with `options`
// (their provider is `provider`) if needed; an open engine is returned as it is. The handle keeps it open; it must
// not outlive the process's last call into this file (CloseIdleEngines at exit closes only engines nobody holds).
std::shared_ptr<fabric::TransferEngine> AcquireEngine(const std::string& device, const std::string& provider,
                                                      fabric::EngineOptions options = {});

// Closes at once every engine no Communicator holds (also lingering ones) and stops the thread that closes them later.
// For interpreter exit; engines acquired afterwards work as before.
void CloseIdleEngines();

// Keeps `what` (memory an engine's writes may still read or write: registrations, buffers) alive until the engine of
// `device` and `provider` is closed, for a user that goes while some of its writes never completed (a dead peer's):
// the engine may still post or complete them, so their memory must outlive it. The engine must be open (held).
void KeepUntilClosed(const std::string& device, const std::string& provider, std::shared_ptr<void> what);

// Engines open now: held by a Communicator or lingering.
int64_t OpenEngines();

// Seconds an engine stays open after its last Communicator is gone.
constexpr double kEngineLingerS = 1.0;

}  // namespace jax_moe::proxy
