// The "cpu" backend's TransferEngines: one per (device, provider), shared by the CpuComms that use it, closed when
// the last of them is gone (after a short linger), so that a process keeps no endpoint (and, with the shm provider,
// no 16 MB region in /dev/shm) for Communicators it no longer has.
//
// The linger: a peer's last write to us (the credit it sends after its last receive) may still be on its way when
// our last Communicator goes; an endpoint closed under it leaves that write without completion on the peer (tcp),
// where it would hold up every later wait_sends of the peer's engine. ~CpuComm first waits for those credits
// (bounded); the linger covers what the transport still does after them (acks). A CpuComm made during the linger
// takes the engine back.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "fabric/transfer_engine.h"

namespace jax_moe::cpu {

// The engine of `device` and `provider`, opened if needed. The handle keeps it open; it must not outlive the process's
// last call into this file (ReleaseIdleEngines at exit closes only engines nobody holds).
std::shared_ptr<fabric::TransferEngine> AcquireEngine(int64_t device, const std::string& provider);

// Closes at once every engine no CpuComm holds (also lingering ones) and stops the thread that closes them later.
// For interpreter exit; engines acquired afterwards work as before.
void CloseIdleEngines();

// Engines open now: held by a CpuComm or lingering.
int64_t OpenEngines();

// Seconds an engine stays open after its last CpuComm is gone.
constexpr double kEngineLingerS = 1.0;

}  // namespace jax_moe::cpu
