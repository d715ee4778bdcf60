// Fixed-order collectives between the GPUs of one host over CUDA IPC.
//
// Every rank owns one buffer that all its peers have mapped (cudaIpcOpenMemHandle): a flag area
// for the barriers, then a staging area that peers store into. A collective is one kernel per
// rank: a start barrier (every peer has finished its previous collective, so its staging area is
// free), the peers' payload pushed into each other's staging areas with plain stores over NVLink,
// a barrier, and the local work: a copy (all-gather) or a sum over the staged slots in rank order
// 0..N-1 in fp32 with one rounding (reduce-scatter; all-reduce then pushes its reduced shard to
// every peer and copies after a third barrier). No NCCL, no host synchronisation, and the same
// steps at every size; the flags count up in device memory, so a captured CUDA graph replays.
//
// The barriers are per block: block b of every rank handles the same element range in every
// phase, so it only has to wait for block b of each peer, never for the whole grid.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/rank_order_sum.cuh"
#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

constexpr int kIpcMaxRanks = 8;
constexpr int kIpcMaxBlocks = 256;
constexpr int kIpcThreads = 512;
// Flag area at the start of every buffer: one 8-byte flag per (block, peer).
constexpr int64_t kIpcFlagBytes = int64_t{kIpcMaxBlocks} * kIpcMaxRanks * 8;
// A peer that has not arrived after this long is gone (dead or never calling): the kernel traps,
// so the rank fails with a CUDA error instead of hanging (NCCL's watchdog waits as long).
constexpr uint64_t kIpcTimeoutNs = 600ull * 1000 * 1000 * 1000;

struct IpcPeers {
  char* base[kIpcMaxRanks];  // base[p]: rank p's buffer as mapped in this process
};

__device__ __forceinline__ void ipc_store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ipc_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t ipc_load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Block-level barrier with the same block of every peer. epoch counts this block's barriers; all
// ranks run the same collectives with the same grids, so their epochs agree.
__device__ __forceinline__ void ipc_block_barrier(const IpcPeers& peers, int rank, int ranks,
                                                  uint64_t epoch) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < ranks && t != rank) {
    // The block's earlier stores (ordered before this thread by __syncthreads) are made visible
    // system-wide before the flag that announces them.
    __threadfence_system();
    auto* peer_flags = reinterpret_cast<uint64_t*>(peers.base[t]);
    ipc_store_release(peer_flags + blockIdx.x * kIpcMaxRanks + rank, epoch);
    const auto* own = reinterpret_cast<const uint64_t*>(peers.base[rank]);
    const uint64_t start = ipc_now_ns();
    while (ipc_load_acquire(own + blockIdx.x * kIpcMaxRanks + t) < epoch) {
      if (ipc_now_ns() - start > kIpcTimeoutNs) __trap();
    }
  }
  __syncthreads();
}

// V elements of p[i..i+V) below limit, as stored (bits unchanged); lanes past limit read as zero.
// wide: p + i is 16-byte aligned whenever i is a multiple of V.
template <typename T, int V>
__device__ __forceinline__ void ipc_load(const T* p, int64_t i, int64_t limit, bool wide,
                                         T (&v)[V]) {
  if (wide && i + V <= limit) {
    *reinterpret_cast<uint4*>(v) = __ldcg(reinterpret_cast<const uint4*>(p + i));
    return;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) v[k] = i + k < limit ? p[i + k] : from_float<T>(0.0f);
}

template <typename T, int V>
__device__ __forceinline__ void ipc_store(T* p, int64_t i, int64_t limit, bool wide,
                                          const T (&v)[V]) {
  if (wide && i + V <= limit) {
    *reinterpret_cast<uint4*>(p + i) = *reinterpret_cast<const uint4*>(v);
    return;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (i + k < limit) p[i + k] = v[k];
  }
}

template <typename T>
__device__ __forceinline__ T* ipc_stage(const IpcPeers& peers, int owner) {
  return reinterpret_cast<T*>(peers.base[owner] + kIpcFlagBytes);
}

// Sum over the ranks' slots of this rank's staging area, slot 0 first, then one rounding.
template <typename T, int V>
__device__ __forceinline__ void ipc_sum_slots(const T* stage, int64_t slot, int64_t j, int ranks,
                                              T (&out)[V]) {
  T v[V];
  ipc_load<T, V>(stage, j, j + V, true, v);
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = to_float(v[k]);
  for (int s = 1; s < ranks; ++s) {
    ipc_load<T, V>(stage + s * slot, j, j + V, true, v);
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = rank_order_add(acc[k], to_float(v[k]));
  }
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = from_float<T>(acc[k]);
}

// First phase of reduce-scatter and all-reduce: piece p of this rank's input (load(p, j, v)
// gives its elements j..j+V) goes to slot `rank` of peer p's staging, this rank's own piece last.
template <typename T, int V, typename Load>
__device__ __forceinline__ void ipc_push_pieces(const IpcPeers& peers, int rank, int ranks,
                                                int64_t slot, int64_t first, int64_t stride,
                                                Load&& load) {
  for (int64_t j = first; j < slot; j += stride) {
    for (int d = 1; d <= ranks; ++d) {
      const int p = (rank + d) % ranks;
      T v[V];
      load(p, j, v);
      ipc_store<T, V>(ipc_stage<T>(peers, p) + int64_t{rank} * slot, j, j + V, true, v);
    }
  }
}

// Last phase of all-gather and all-reduce: every peer's slot s of `stage` to its place in the
// output (store(s, j, v) writes elements j..j+V of slot s).
template <typename T, int V, typename Store>
__device__ __forceinline__ void ipc_collect(const T* stage, int rank, int ranks, int64_t slot,
                                            int64_t first, int64_t stride, Store&& store) {
  for (int64_t j = first; j < slot; j += stride) {
    for (int s = 0; s < ranks; ++s) {
      if (s == rank) continue;
      T v[V];
      ipc_load<T, V>(stage + s * slot, j, j + V, true, v);
      store(s, j, v);
    }
  }
}

// all_gather: x [n] on every rank, out [ranks * n] in rank order. Staging: ranks slots of
// `slot` (n rounded up to V) elements; slot p holds rank p's x.
template <typename T, int V>
__global__ void __launch_bounds__(kIpcThreads)
    rlk_ipc_all_gather_kernel(IpcPeers peers, int rank, int ranks, const T* __restrict__ x,
                              int64_t n, int64_t slot, T* __restrict__ out, bool wide_x,
                              bool wide_out, uint64_t* __restrict__ epochs) {
  uint64_t epoch = epochs[blockIdx.x];
  ipc_block_barrier(peers, rank, ranks, ++epoch);
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * V;
  const int64_t first = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * V;
  for (int64_t j = first; j < slot; j += stride) {
    T v[V];
    ipc_load<T, V>(x, j, n, wide_x, v);
    for (int d = 1; d <= ranks; ++d) {  // own slot last: the peers' stores go out first
      const int p = (rank + d) % ranks;
      if (p == rank) {
        ipc_store<T, V>(out + int64_t{rank} * n, j, n, wide_out, v);
      } else {
        ipc_store<T, V>(ipc_stage<T>(peers, p) + int64_t{rank} * slot, j, j + V, true, v);
      }
    }
  }
  ipc_block_barrier(peers, rank, ranks, ++epoch);
  ipc_collect<T, V>(ipc_stage<T>(peers, rank), rank, ranks, slot, first, stride,
                    [&](int s, int64_t j, const T (&v)[V]) {
                      ipc_store<T, V>(out + int64_t{s} * n, j, n, wide_out, v);
                    });
  if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}

// reduce_scatter: x [ranks * m] on every rank, out [m] = this rank's share of the sum. Staging:
// ranks slots of `slot` (m rounded up to V) elements; slot s holds rank s's share for this rank.
template <typename T, int V>
__global__ void __launch_bounds__(kIpcThreads)
    rlk_ipc_reduce_scatter_kernel(IpcPeers peers, int rank, int ranks, const T* __restrict__ x,
                                  int64_t m, int64_t slot, T* __restrict__ out, bool wide_x,
                                  bool wide_out, uint64_t* __restrict__ epochs) {
  uint64_t epoch = epochs[blockIdx.x];
  ipc_block_barrier(peers, rank, ranks, ++epoch);
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * V;
  const int64_t first = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * V;
  ipc_push_pieces<T, V>(peers, rank, ranks, slot, first, stride, [&](int p, int64_t j, T (&v)[V]) {
    ipc_load<T, V>(x + int64_t{p} * m, j, m, wide_x, v);
  });
  ipc_block_barrier(peers, rank, ranks, ++epoch);
  const T* stage = ipc_stage<T>(peers, rank);
  for (int64_t j = first; j < slot; j += stride) {
    T v[V];
    ipc_sum_slots<T, V>(stage, slot, j, ranks, v);
    ipc_store<T, V>(out, j, m, wide_out, v);
  }
  if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}

// all_reduce: x [n] on every rank, out [n] the sum. Shard p is x[p*slot, (p+1)*slot) (slot = n /
// ranks rounded up to V). Staging: ranks input slots (rank s's piece of this rank's shard), then
// ranks output slots (rank s's reduced shard s).
template <typename T, int V>
__global__ void __launch_bounds__(kIpcThreads)
    rlk_ipc_all_reduce_kernel(IpcPeers peers, int rank, int ranks, const T* __restrict__ x,
                              int64_t n, int64_t slot, T* __restrict__ out, bool wide_x,
                              bool wide_out, uint64_t* __restrict__ epochs) {
  uint64_t epoch = epochs[blockIdx.x];
  ipc_block_barrier(peers, rank, ranks, ++epoch);
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * V;
  const int64_t first = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * V;
  const int64_t reduced = int64_t{ranks} * slot;  // offset of the output slots
  ipc_push_pieces<T, V>(peers, rank, ranks, slot, first, stride, [&](int p, int64_t j, T (&v)[V]) {
    ipc_load<T, V>(x, int64_t{p} * slot + j, n, wide_x, v);
  });
  ipc_block_barrier(peers, rank, ranks, ++epoch);
  const T* stage = ipc_stage<T>(peers, rank);
  for (int64_t j = first; j < slot; j += stride) {
    T v[V];
    ipc_sum_slots<T, V>(stage, slot, j, ranks, v);
    for (int d = 1; d <= ranks; ++d) {
      const int p = (rank + d) % ranks;
      if (p == rank) {
        ipc_store<T, V>(out, int64_t{rank} * slot + j, n, wide_out, v);
      } else {
        ipc_store<T, V>(ipc_stage<T>(peers, p) + reduced + int64_t{rank} * slot, j, j + V, true,
                        v);
      }
    }
  }
  ipc_block_barrier(peers, rank, ranks, ++epoch);
  ipc_collect<T, V>(stage + reduced, rank, ranks, slot, first, stride,
                    [&](int s, int64_t j, const T (&v)[V]) {
                      ipc_store<T, V>(out, int64_t{s} * slot + j, n, wide_out, v);
                    });
  if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}

}  // namespace rl_engine::cuda
