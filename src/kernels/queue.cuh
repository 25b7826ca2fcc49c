// The one-shot kernel's schedule: every block takes parts from one queue, all of the send half's before any of the
// receive half's. A receive part waits for every send part to end (the send's last part raises the flags it waits
// on), and every send part was taken, so is running or done, by the time any receive part is taken: no block ever
// waits for a block of its own grid that is not resident. So the one kernel needs no cooperative launch, runs
// correctly on however many SMs it gets (beside other kernels), and a send part never waits behind our own spinning
// receive parts. Receive parts still wait on the peers' sends, as the receive kernel does: peers sharing one GPU
// need each process capped below the whole GPU (MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, or time-slicing), or
// one rank's spinning grid can starve the other's until the timeout. A block takes its next part while it works on
// this one, to hide the atomic's latency.
#pragma once
#include "kernels/part.cuh"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {

// Runs parts send(Part{i, sends}) for i < sends, then recv(Part{i, recvs}) for i < recvs, on `stream`'s queue (0:
// dispatch, 1 + c: combine channel c). Each body must end in FinishPart (a block barrier, after which every thread has
// read `next`). The block's last thread takes the tickets and holds the next one in a register until its part ends:
// thread 0, which waits on the peers' flags first thing, would otherwise hold its whole block for the atomic's round
// trip. One loop per half: in one loop over both, the compiler kept both bodies' loop-invariant values live and the
// combine kernel spilled.
template <typename Send, typename Recv>
__device__ __forceinline__ void RunQueued(const KernelArgs& a, int stream, int sends, int recvs, Send send, Recv recv) {
  unsigned int* queue = &Local(a)->queue[stream];
  const bool taker = threadIdx.x == blockDim.x - 1;
  __shared__ int next;
  if (taker) next = static_cast<int>(atomicAdd(queue, 1u));
  __syncthreads();
  int take = next;
  while (take < sends) {
    int ahead = 0;
    if (taker) ahead = static_cast<int>(atomicAdd(queue, 1u));
    send(Part{take, sends});
    if (taker) next = ahead;
    __syncthreads();
    take = next;
  }
  while (take < sends + recvs) {
    int ahead = 0;
    if (taker) ahead = static_cast<int>(atomicAdd(queue, 1u));
    recv(Part{take - sends, recvs});
    if (taker) next = ahead;
    __syncthreads();
    take = next;
  }
  if (taker) {
    __threadfence();
    if (atomicAdd(&Local(a)->queue_left[stream], 1u) == gridDim.x - 1) {
      __threadfence();  // after every block's last ticket (each fenced before its arrival above)
      *queue = 0;  // every block has taken its last ticket: the next launch starts from part 0
      Local(a)->queue_left[stream] = 0;
    }
  }
}

}  // namespace jax_moe::cuda
