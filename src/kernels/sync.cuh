// Device-side synchronisation between GPUs: system-scope release/acquire on 64-bit epoch flags, bounded waits.
#pragma once
#include <cstdint>

#include "kernels/moe_layout.h"
#include "kernels/part.cuh"

namespace jax_moe::cuda {

__device__ __forceinline__ unsigned long long LoadAcquireSys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The same at GPU scope, for words only this device's blocks share.
__device__ __forceinline__ unsigned long long LoadAcquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelease(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ LocalSync* Local(const KernelArgs& a) {
  return reinterpret_cast<LocalSync*>(a.base + a.lay.local);
}

// Records an error of the running launch in device memory (its first error wins); FinishPart publishes it to the
// host when the launch ends. Published at each raise, one launch could report twice: the host's handler for the
// next recv half runs while this launch runs, so it could take the first raise and a later raise (another bad id)
// would set the word again for the call after. A timeout also goes at once to the timeout word, which only the
// device writes and nobody clears: it ends the Communicator.
__device__ __forceinline__ void RaiseError(const KernelArgs& a, int kind, int detail) {
  const unsigned long long word = (static_cast<unsigned long long>(kind) << 32) | static_cast<unsigned>(detail);
  atomicCAS(&Local(a)->error, 0ull, word);
  if (kind == kTimeout || kind == kProxyFailed || kind == kOutOfOrder) atomicCAS_system(a.timeout, 0ull, word);
}

// A split receive's handle must be the round it is due to receive (its epoch): else the rounds are out of step (a
// handle dropped, or received out of send order across programs), reported once and for good (kOutOfOrder).
__device__ __forceinline__ void CheckTicket(const KernelArgs& a, const int32_t* ticket, unsigned long long epoch,
                                            int stream, Part part) {
  if (ticket != nullptr && part.id == 0 && threadIdx.x == 0 && __ldcg(ticket) != static_cast<int32_t>(epoch))
    RaiseError(a, kOutOfOrder, stream);
}

// Publishes the ending launch's error, if any, with the next number. Only when the host has acknowledged the previous
// number: until then that error stands (first error wins) and this one is dropped. The device is the only writer of
// the error word and the host of the ack word (see KernelArgs). Called by the last part after FinishPart's fences,
// so every part's RaiseError is visible.
__device__ __forceinline__ void PublishError(const KernelArgs& a, LocalSync* ls) {
  if (*reinterpret_cast<volatile unsigned long long*>(&ls->error) == 0) return;  // the usual case: no error
  const unsigned long long error = atomicExch(&ls->error, 0ull);
  const unsigned int seq = ls->error_seq;
  if (LoadAcquireSys(a.error_ack) != seq) return;
  const unsigned int next = seq >= kErrorSeqMax ? 1u : seq + 1u;
  ls->error_seq = next;
  StoreReleaseSys(a.error, (static_cast<unsigned long long>(next) << kErrorSeqShift) | (error & kErrorBody));
}

// Spins until *flag >= want; on timeout raises kTimeout (detail = which) and returns false instead of hanging.
// The loop touches device memory only: polling the host-mapped error word here would flood PCIe and delay the
// GPU's own command fetches.
__device__ __forceinline__ bool WaitAtLeast(const KernelArgs& a, const unsigned long long* flag,
                                           unsigned long long want, int which) {
  if (LoadAcquireSys(flag) >= want) return true;
  volatile int* timed_out = &Local(a)->timed_out;
  if (*timed_out) return false;  // an earlier wait gave up: the peer is gone, do not stall every call
  const unsigned long long start = GlobalTimer();
  while (LoadAcquireSys(flag) < want) {
    if (static_cast<long long>(GlobalTimer() - start) > a.timeout_ns) {
      RaiseError(a, kTimeout, which);
      *timed_out = 1;
      return false;
    }
  }
  return true;
}

// Publishes v into a device word with release semantics (max, so a late publisher never lowers it).
__device__ __forceinline__ void MaxReleaseSys(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// WaitAtLeast on a pump's bell word (kSent or kArrived) in host-mapped memory: also gives up when the pump stopped
// (kError). Only block 0 touches host memory: it polls the word, napping between polls, and publishes what it saw
// into LocalSync::fab_seen with release semantics; the other blocks acquire that device word and nothing else. Its
// acquire of the host word and its release of the copy chain (causality is transitive), so every block sees what
// the proxy made visible before it raised the word, without a read of its own over PCIe: every block polling host
// memory flooded the link that the receive kernels read their rows through, when the rows are in host memory.
// Part 0 polls: only a half's own kernel waits on the fabric (never the one-shot kernel), and there part 0 is block 0
// (dispatch_send's and combine_send's block 0 polls for the blocks after it, which wait with part ids from 1).
__device__ __forceinline__ bool WaitFabric(const KernelArgs& a, const FabricArgs& f, int word, unsigned long long want,
                                           int which, int stream, Part part) {
  unsigned long long* seen = &Local(a)->fab_seen[stream][word == proxy::kSent ? 0 : 1];
  if (LoadAcquireSys(seen) >= want) return true;
  volatile int* timed_out = &Local(a)->timed_out;
  if (*timed_out) return false;
  const unsigned long long start = GlobalTimer();
  if (part.id == 0) {
    const unsigned long long* host = f.bell + word;
    unsigned long long v;
    while ((v = LoadAcquireSys(host)) < want) {
      if (LoadAcquireSys(f.bell + proxy::kError) != 0) {
        RaiseError(a, kProxyFailed, stream);
        *timed_out = 1;
        return false;
      }
      if (static_cast<long long>(GlobalTimer() - start) > a.timeout_ns) {
        RaiseError(a, kTimeout, which);
        *timed_out = 1;
        return false;
      }
      __nanosleep(256);
    }
    MaxReleaseSys(seen, v);
    return true;
  }
  while (LoadAcquireSys(seen) < want) {
    if (*timed_out) return false;  // block 0 gave up and raised the error
    if (static_cast<long long>(GlobalTimer() - start) > a.timeout_ns) {
      RaiseError(a, kTimeout, which);
      *timed_out = 1;
      return false;
    }
    __nanosleep(64);
  }
  return true;
}

// The first remote rank (names a fabric wait that timed out: the pump's own error names every late rank).
__device__ __forceinline__ int FirstRemote(const KernelArgs& a) {
  for (int p = 0; p < a.s.num_ranks; ++p)
    if (IsRemote(a, p)) return p;
  return 0;
}

// A remote rank's region in our areas: [kFabricLanes][num_remote] regions, one per rank on another node in rank order
// (proxy::RegionSlots::OtherNodes), so its slot is the count of remote ranks before it.
__device__ __forceinline__ int RemoteSlot(const KernelArgs& a, int p) {
  int slot = __popc(a.remote[p >> 5] & ((1u << (p & 31)) - 1u));
  for (int w = 0; w < (p >> 5); ++w) slot += __popc(a.remote[w]);
  return slot;
}
__device__ __forceinline__ uint8_t* SendRegion(const FabricArgs& f, const KernelArgs& a, unsigned long long epoch, int p) {
  return f.send + ((epoch % kFabricLanes) * a.num_remote + RemoteSlot(a, p)) * f.region;
}
__device__ __forceinline__ const uint8_t* RecvRegion(const FabricArgs& f, const KernelArgs& a, unsigned long long epoch,
                                                     int q) {
  return f.recv + ((epoch % kFabricLanes) * a.num_remote + RemoteSlot(a, q)) * f.region;
}

// A received region's header is the round's, from `sender`, with at most `max_rows` rows; else its data is dropped and
// reported (kBadPeerData). Read once by the caller (a peer could be rewriting it).
__device__ __forceinline__ bool HeaderOk(const proxy::RegionHeader& h, const FabricArgs& f, unsigned long long epoch,
                                         int sender, long long max_rows) {
  return h.magic == proxy::kRegionMagic && h.comm_id == f.comm_id && h.seq == epoch && h.sender == sender &&
         h.error == 0 && h.rows >= 0 && h.rows <= max_rows;
}

// Three independent 16-byte loads (the header is 40 bytes; the region's header area is 64-byte aligned and at least
// 64 bytes), not ten dependent 4-byte ones: each is a PCIe round trip when the region is in host memory.
__device__ __forceinline__ proxy::RegionHeader LoadHeader(const uint8_t* region) {
  static_assert(sizeof(proxy::RegionHeader) <= 48, "LoadHeader reads 48 bytes");
  int4 v[3];
#pragma unroll
  for (int i = 0; i < 3; ++i) v[i] = __ldcv(reinterpret_cast<const int4*>(region) + i);
  proxy::RegionHeader h;
  memcpy(&h, v, sizeof(h));
  return h;
}

// Writes our header for `epoch` into a send region.
__device__ __forceinline__ void StoreHeader(uint8_t* region, const FabricArgs& f, const KernelArgs& a,
                                            unsigned long long epoch, int rows) {
  proxy::RegionHeader* h = reinterpret_cast<proxy::RegionHeader*>(region);
  h->magic = proxy::kRegionMagic;
  h->comm_id = f.comm_id;
  h->seq = epoch;
  h->sender = a.rank;
  h->error = 0;
  h->error_value = 0;
  h->rows = rows;
  h->pad = 0;
}

__device__ __forceinline__ unsigned long long* Flags(uint8_t* base, const KernelArgs& a, int kind) {
  return reinterpret_cast<unsigned long long*>(base + a.lay.flags) + kind * a.s.num_ranks;
}

__device__ __forceinline__ uint8_t* Peer(const KernelArgs& a, int p) {
  return reinterpret_cast<uint8_t* const*>(a.base + a.lay.peers)[p];
}

// Raises column a.rank of flag `kind` on every rank of this node to `epoch`. This rank's own word at GPU scope: its
// reader is a later kernel on this GPU, and a system-scope release waits for every store of the thread to be visible
// to the host and the peers.
__device__ __forceinline__ void RaiseNodeFlags(const KernelArgs& a, int kind, unsigned long long epoch) {
  for (int p = 0; p < a.s.num_ranks; ++p) {
    if (IsRemote(a, p)) continue;
    unsigned long long* word = Flags(Peer(a, p), a, kind) + a.rank;
    if (p == a.rank) StoreRelease(word, epoch);
    else StoreReleaseSys(word, epoch);
  }
}

// Records trace point `point` of this launch of `half` (epoch = the call being made) when tracing is on; block 0's
// thread 0 calls it for kTraceStart / kTraceWaited.
__device__ __forceinline__ void Trace(const KernelArgs& a, int half, unsigned long long epoch, int point) {
  if (!a.trace) return;
  unsigned long long* t = reinterpret_cast<unsigned long long*>(a.base + a.lay.trace);
  t[((epoch % kTraceRing) * kHalves + half) * kTracePoints + point] = GlobalTimer();
}

__device__ __forceinline__ void TracePart0(const KernelArgs& a, Part part, int half, unsigned long long epoch, int point) {
  if (part.id == 0 && threadIdx.x == 0) Trace(a, half, epoch, point);
}

// Ends a part of a half: its stores are ordered before its arrival (barrier, then one system-scope fence by thread 0,
// as cooperative groups' grid sync does); the last part to arrive runs `last()` (signals the peers, advances the
// epoch), publishes the launch's error and re-arms the part counter for the next launch. `fenced`: the part's thread
// 0 ran that barrier and fence itself after the block's last store (dispatch_send's pack blocks, before their bell's
// count), so this arrival needs neither again (a system fence waits for the block's stores to drain, on the launch's tail). A
// store such a part makes after its fence is not ordered before its arrival.
template <typename Last>
__device__ __forceinline__ void FinishPart(const KernelArgs& a, Part part, int half, Last last, bool fenced = false) {
  if (!fenced) __syncthreads();
  if (threadIdx.x == 0) {
    LocalSync* ls = Local(a);
    if (part.id == 0) Trace(a, half, ls->epoch[half] + 1, kTraceWork);
    if (!fenced) __threadfence_system();
    const unsigned prev = atomicAdd(&ls->done[half], 1u);
    if (prev == static_cast<unsigned>(part.count) - 1) {
      ls->done[half] = 0;
      __threadfence_system();
      Trace(a, half, ls->epoch[half] + 1, kTraceEnd);
      last(ls);
      PublishError(a, ls);
    }
  }
}

// Sanitised expert of entry k of a token: -1 when masked, out of range, or a repeat of an earlier entry.
__device__ __forceinline__ int SentExpert(const int32_t* row, int k, int experts) {
  const int g = row[k];
  if (g < 0 || g >= experts) return -1;
  for (int j = 0; j < k; ++j)
    if (row[j] == g) return -1;
  return g;
}

}  // namespace jax_moe::cuda
