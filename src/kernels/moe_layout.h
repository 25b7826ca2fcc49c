// Shapes, buffer layout and kernel arguments of the CUDA dispatch/combine (shared by host code and kernels).
//
// One device buffer per (Communicator, device), identical layout on every rank, so a peer's address of any field is
// peer_base + the same offset. Receiver-owned areas are written by the senders over NVLink (peer pointers).
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define JAX_MOE_HD __host__ __device__
#else
#define JAX_MOE_HD
#endif

namespace jax_moe::cuda {

// Epoch counters and "last block" counters, one per half. Combine has two channels (areas, flags, epochs): the
// forward combine and the one inside dispatch's gradient, which XLA may schedule in either order relative to each
// other (nothing orders the forward combine_recv, whose output only feeds the loss, before the backward pass).
enum Half { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };  // + 2 * channel for combine
constexpr int kCombineChannels = 2;
constexpr int kHalves = 4 + 2 * (kCombineChannels - 1);
constexpr int kFlagKinds = 2 + 2 * kCombineChannels;

// Error codes in the host-mapped error word (reported by the next recv half's handler).
enum ErrorKind { kNoError = 0, kBadExpertId = 1, kTimeout = 2 };

struct MoeShape {
  int n = 1;            // ranks on the axis
  int rank = 0;         // this device's rank
  int l = 1;            // local experts per rank
  int r = 1;            // experts per token
  int max_tokens = 1;   // T at most
  int c = 1;            // rows one rank can send to one peer: max_tokens * min(R, L)
  int x_bytes = 0;      // hidden * itemsize of the dispatch dtype (multiple of 16)
  int scale_bytes = 0;  // num_scales * 4 (0 for bf16)
  int rec_bytes = 0;    // one received record: x then scales, rounded up to 16
  int y_bytes = 0;      // hidden * 2 (combine dtype bf16, multiple of 16)
  JAX_MOE_HD int experts() const { return n * l; }
  JAX_MOE_HD int64_t slots() const { return int64_t(max_tokens) * r; }   // (t, k) slots of a rank
  JAX_MOE_HD int64_t max_recv_rows() const { return int64_t(n) * c; }
};

// Byte offsets of the fields inside one device buffer.
struct MoeLayout {
  size_t flags = 0;   // uint64 [kFlagKinds][n]: dispatch flag, dispatch ack, then per combine channel flag and ack;
                      // peer s writes slot [.][s]
  size_t local = 0;   // LocalSync (this device only)
  size_t peers = 0;   // uint8_t* [n]: every peer's buffer base, as this device addresses it
  size_t counts = 0;  // int32 [n][l]: rows per local expert from sender s
  size_t meta = 0;    // int32 [n][c]: (t * R + k) on the sender of every received row
  size_t rows = 0;    // [n][c] records of rec_bytes from sender s
  size_t comb = 0;    // [channels][max_tokens * R] rows of y_bytes: expert outputs returned to this token owner
  size_t hist = 0;    // int32 [E]: this rank's rows per global expert (scratch of dispatch_send)
  size_t pos = 0;     // int32 [max_tokens * R]: position of (t, k) among the tokens of its expert (scratch)
  size_t total = 0;
};

struct LocalSync {
  unsigned long long epoch[kHalves];  // completed calls of each half
  unsigned int done[kHalves];         // blocks finished in the running launch of each half
  int timed_out;                      // a wait timed out: later waits give up at once (device copy of the error)
};

inline size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline MoeLayout MakeLayout(const MoeShape& s) {
  MoeLayout m;
  size_t at = 0;
  auto take = [&](size_t bytes) { size_t here = at; at = AlignUp(at + bytes, 256); return here; };
  m.flags = take(sizeof(unsigned long long) * kFlagKinds * s.n);
  m.local = take(sizeof(LocalSync));
  m.peers = take(sizeof(void*) * s.n);
  m.counts = take(sizeof(int32_t) * s.n * s.l);
  m.meta = take(sizeof(int32_t) * size_t(s.n) * s.c);
  m.rows = take(size_t(s.rec_bytes) * s.n * s.c);
  m.comb = take(size_t(s.y_bytes) * s.slots() * kCombineChannels);
  m.hist = take(sizeof(int32_t) * s.experts());
  m.pos = take(sizeof(int32_t) * s.slots());
  m.total = at;
  return m;
}

// Everything a kernel needs about its device's group membership; passed by value.
struct KernelArgs {
  MoeShape s;
  MoeLayout lay;
  uint8_t* base = nullptr;          // this device's buffer
  int* error = nullptr;             // host-mapped int32 [2]: ErrorKind, detail (first writer wins)
  long long timeout_ns = 0;         // bound of every wait on a peer
  int num_sms = 1;
};

}  // namespace jax_moe::cuda
