// sanitizer_probe.cu: which global -> shared copy mechanisms does compute-sanitizer's racecheck
// accept in a warp-specialized producer/consumer ring? (issue #5; run by tools/sanitizer_probe.py)
//
// Every kernel here has the hand-off shape of paged_attention_decode (kernels/paged_attention.cu):
// warp 0 is the producer and fills a ring of PROBE_STAGES shared-memory stages with 4 KiB slices
// of a global pool, named by a table (as pages are named by a page table); PROBE_CONSUMERS
// consumer warps each take every PROBE_CONSUMERS-th slice, wait on the stage's `full` barrier,
// read the slice with 16-byte shared loads, write its sum to out[], and release the stage on its
// `empty` barrier (__syncwarp, then lane 0 arrives), as the decode kernel's consumers do.
// The kernels differ only in how the producer moves the bytes:
//
//   bulk             cp.async.bulk (raw addresses), arrive.expect_tx BEFORE the copy: the decode
//                    kernel as it is
//   bulk_copy_first  the same copy issued BEFORE arrive.expect_tx
//   bulk_split       expect_tx (no arrival), the copy, then a plain arrive: the order libcu++'s
//                    cuda::memcpy_async + barrier.arrive() compile to. ptxas lists a plain arrive
//                    in the kernel's EIATTR_MBARRIER_INSTR_OFFSETS (the barrier operations the
//                    sanitizer is told about) but not an arrive.expect_tx
//   tma1d, tma3d     cp.async.bulk.tensor through a CUtensorMap (a tensor map in global memory,
//                    or a __grid_constant__ kernel parameter)
//   memcpy_async     libcu++ cuda::memcpy_async + cuda::barrier (compiled only with
//                    -DPROBE_LIBCUDACXX, in a module of its own)
//   cpasync          every producer lane issues 16-byte cp.async and then
//                    cp.async.mbarrier.arrive.noinc (the full barrier expects 32 arrivals)
//   plain            every producer lane loads to registers and stores to shared memory, then
//                    arrives (release) on the full barrier: the control racecheck must understand
//
// A `_broken` kernel is its mechanism with the consumers' wait on `full` left out (and no release
// of `empty`): a real read-before-the-bytes-landed race, the positive control racecheck must
// report. A `_decode_broken` kernel has the hooks of kernels/paged_attention_broken.cu (see Hooks).
//
// A second axis, the hand-off (see Handoff), keeps the bulk copy and changes how the stages are
// passed back and forth. racecheck 2025.3 reported a WAR on every fixed ring above, always a
// consumer lane other than lane 0 reading and the producer's next copy writing: either it does
// not take `empty` (consumer arrives on an mbarrier, producer waits on it) as happens-before, or
// it does, but not the __syncwarp() that orders lanes 1-31's reads before lane 0's arrival.
//
//   bulk_lane_empty   every consumer lane arrives on `empty` itself (32 arrivals), no __syncwarp
//   bulk_named_empty  `empty` is a hardware named barrier per stage: the consumer warp
//                     bar.arrive, the producer warp bar.sync before refilling the stage
//   bulk_named_both   `full` is one too: the producer waits on the copy's mbarrier itself, then
//                     bar.arrive; the consumer warp bar.sync before reading
//
// Their `_broken` twins (Hooks::SkipFirstFullWait) leave out the consumers' wait for the bytes
// in each stage's first round only and keep every other hand-off, so they differ from their
// fixed kernel in the one edge racecheck must see. (Leaving out every wait, as the other twins
// do, would let a consumer warp lap the producer and arrive twice on one named barrier or run
// an mbarrier two phases ahead: a hang, not a race.)
// The `_decode_broken` kernel needs no named twin: paged_attention_broken.cu replaces all four
// hooks, both directions, so with named barriers in the fixed kernel it is bulk_decode_broken.
//
// Pool layout, like one KV page slice at head_dim 128: int32 [slices][16 rows][64 words].

constexpr int PROBE_STAGES = 4;
constexpr int PROBE_CONSUMERS = 2;
constexpr int PROBE_THREADS = 32 * (1 + PROBE_CONSUMERS);
constexpr int SLICE_ROWS = 16;
constexpr int ROW_WORDS = 64;
constexpr int SLICE_WORDS = SLICE_ROWS * ROW_WORDS;
constexpr int SLICE_BYTES = SLICE_WORDS * 4;
constexpr int TMA1D_BOX = 256;  // a tensor map's box is at most 256 elements per dimension
constexpr int LANE_CHUNKS = SLICE_WORDS / (32 * 4);  // 16-byte pieces per lane when all 32 lanes copy
static_assert(PROBE_STAGES % PROBE_CONSUMERS == 0, "a stage is always read by the same consumer warp");
static_assert(SLICE_WORDS % TMA1D_BOX == 0, "a slice is whole 1-D boxes");

// Read by the host to size the launch.
__device__ int probe_threads = PROBE_THREADS;
__device__ int probe_slice_words = SLICE_WORDS;

__device__ __forceinline__ unsigned smem_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// Sum of a slice as one consumer warp reads it: lane l takes 16 bytes at word 4 l + 128 k.
__device__ __forceinline__ int warp_slice_sum(const int* slice, int lane) {
  int sum = 0;
#pragma unroll
  for (int k = 0; k < LANE_CHUNKS; ++k) {
    const int4 v = *reinterpret_cast<const int4*>(slice + 4 * lane + 128 * k);
    sum += v.x + v.y + v.z + v.w;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

#ifndef PROBE_LIBCUDACXX
// The engine's primitives (mbar_init/_arrive_expect_tx/_wait, bulk_copy_to_shared, named
// barriers) are the ones under test; the probe adds the variants the engine does not use.
#include "mbarrier.cuh"
// ============================================================ raw PTX mechanisms

struct alignas(64) TensorMap128 {  // CUtensorMap: 128 opaque bytes, 64-byte aligned
  unsigned long long opaque[16];
};

struct ProbeShared {
  int slices[PROBE_STAGES][SLICE_WORDS];  // copy destinations (offset 0: 128-byte aligned)
  unsigned long long full[PROBE_STAGES];
  unsigned long long empty[PROBE_STAGES];
};
__device__ int probe_smem_bytes = sizeof(ProbeShared);

// Named barriers: 0 is __syncthreads; stage s's `full` is 1 + s, its `empty` 1 + STAGES + s. Each
// is met by the producer warp and the one consumer warp that reads stage s.
constexpr int FULL_BARRIER0 = 1;
constexpr int EMPTY_BARRIER0 = FULL_BARRIER0 + PROBE_STAGES;
constexpr int STAGE_BARRIER_THREADS = 2 * 32;
static_assert(EMPTY_BARRIER0 + PROBE_STAGES <= 16, "a block has 16 named barriers");

// Announce `bytes` more to come from the copy engine, without arriving.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void tensor_copy_1d(void* dst, const void* map, int c0, unsigned long long* bar) {
  asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];"
               ::"r"(smem_address(dst)), "l"(map), "r"(c0), "r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void tensor_copy_3d(void* dst, const void* map, int c0, int c1, int c2,
                                               unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(smem_address(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(dst)), "l"(src) : "memory");
}

// The barrier's pending count drops by one when this thread's earlier cp.async have landed.
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(bar)) : "memory");
}

enum class Copy { Bulk, BulkCopyFirst, BulkSplit, Tma1d, Tma3d, CpAsync, Plain };

__host__ __device__ constexpr bool every_lane_copies(Copy c) { return c == Copy::CpAsync || c == Copy::Plain; }

// How the stage hand-off is done. Fixed: as kernels/paged_attention.cu (the producer waits for a
// free stage, the consumers wait for the bytes and release the stage). NoConsumerWait: the
// consumers neither wait nor release, and the producer waits only for its own copies (so no copy
// is in flight when the block exits, and no barrier phase can run two ahead of a waiter).
// DecodeBroken: kernels/paged_attention_broken.cu's hooks, i.e. NoConsumerWait plus a
// __syncthreads() that only the producer warp reaches. SkipFirstFullWait: as Fixed, except that
// the consumers read each stage's first round without waiting for the bytes (as if a fresh stage
// needed no wait, the mirror of the producer's first fill, which needs no release) and the
// producer waits for its own copies after issuing them.
enum class Hooks { Fixed, NoConsumerWait, DecodeBroken, SkipFirstFullWait };

// How stages change hands (the header's second axis). Mbarrier: the decode kernel as it is.
enum class Handoff { Mbarrier, LaneEmpty, NamedEmpty, NamedBoth };

__host__ __device__ constexpr bool named_empty(Handoff f) { return f == Handoff::NamedEmpty || f == Handoff::NamedBoth; }

// NamedBoth: the producer tells the consumers that page i has landed once it has issued page
// i + PUBLISH_LAG, so STAGES - 1 copies stay in flight; any larger lag deadlocks, since stage
// i % STAGES is refilled, after the consumer of page i released it, at page i + STAGES.
constexpr int PUBLISH_LAG = PROBE_STAGES - 1;

// NamedBoth, producer warp: wait until page j's bytes have landed (the copy completes on the
// stage's mbarrier, which only this warp waits on), then let its consumer warp through; under
// SkipFirstFullWait nobody waits for a first round, so it is not published.
template <Hooks H>
__device__ __forceinline__ void publish_landed(unsigned long long* full, int j) {
  if (H == Hooks::SkipFirstFullWait && j < PROBE_STAGES) return;
  mbar_wait(&full[j % PROBE_STAGES], (j / PROBE_STAGES) & 1);
  __syncwarp();  // converged for the .aligned barrier
  named_barrier_arrive<STAGE_BARRIER_THREADS>(FULL_BARRIER0 + j % PROBE_STAGES);
}

// Grid (blocks), PROBE_THREADS threads, sizeof(ProbeShared) dynamic shared memory. Block b sums
// slices table[b n .. b n + n) into out[b n ..]. `source` is the pool (raw mechanisms) or the
// tensor map's generic address (tensor mechanisms, whose map describes the pool).
template <Copy C, Hooks H, Handoff F = Handoff::Mbarrier>
__device__ __forceinline__ void ring(const void* source, const int* __restrict__ table, int n, int* __restrict__ out) {
  extern __shared__ __align__(128) unsigned char shared_raw[];
  ProbeShared& sh = *reinterpret_cast<ProbeShared*>(shared_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int* block_table = table + blockIdx.x * n;
  static_assert(H != Hooks::DecodeBroken || !every_lane_copies(C), "the broken decode kernel has one issuing lane");
  static_assert(F == Handoff::Mbarrier || (C == Copy::Bulk && (H == Hooks::Fixed || H == Hooks::SkipFirstFullWait)),
                "the hand-off variants keep the decode kernel's bulk copy; their broken twin is SkipFirstFullWait");
  constexpr bool releases = H == Hooks::Fixed || H == Hooks::SkipFirstFullWait;

  if (threadIdx.x == 0) {
    for (int s = 0; s < PROBE_STAGES; ++s) {
      mbar_init(&sh.full[s], every_lane_copies(C) ? 32 : 1);
      mbar_init(&sh.empty[s], F == Handoff::LaneEmpty ? 32 : 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 0) {  // ------------------------------------------------ producer
    if constexpr (C == Copy::Tma1d || C == Copy::Tma3d) {
      if (lane == 0) asm volatile("prefetch.tensormap [%0];" ::"l"(source) : "memory");
    }
    for (int i = 0; i < n; ++i) {
      const int stage = i % PROBE_STAGES, round = i / PROBE_STAGES;
      const int slice = block_table[i];
      int* dst = sh.slices[stage];
      const int* src = static_cast<const int*>(source) + (long long)slice * SLICE_WORDS;  // raw mechanisms
      if constexpr (every_lane_copies(C)) {
        // Every lane writes the stage, so every lane waits for it to be free.
        if constexpr (H == Hooks::Fixed) mbar_wait(&sh.empty[stage], (round & 1) ^ 1);
#pragma unroll
        for (int k = 0; k < LANE_CHUNKS; ++k) {
          const int w = 4 * lane + 128 * k;
          if constexpr (C == Copy::CpAsync) {
            cp_async_16(dst + w, src + w);
          } else {
            *reinterpret_cast<int4*>(dst + w) = *reinterpret_cast<const int4*>(src + w);
          }
        }
        if constexpr (C == Copy::CpAsync) {
          cp_async_arrive_noinc(&sh.full[stage]);
        } else {
          mbar_arrive(&sh.full[stage]);  // release: this lane's stores happen before the phase completes
        }
        if constexpr (H != Hooks::Fixed) mbar_wait(&sh.full[stage], round & 1);
      } else {
        // The whole warp meets the named barrier, from the stage's second round on: its first
        // fill needs no release.
        if constexpr (releases && named_empty(F)) {
          __syncwarp();  // converged for the .aligned barrier
          if (round > 0) named_barrier_sync<STAGE_BARRIER_THREADS>(EMPTY_BARRIER0 + stage);
        }
        if (lane == 0) {
          if constexpr (releases && !named_empty(F)) mbar_wait(&sh.empty[stage], (round & 1) ^ 1);
          if constexpr (C == Copy::Bulk) {
            mbar_arrive_expect_tx(&sh.full[stage], SLICE_BYTES);
            bulk_copy_to_shared(dst, src, SLICE_BYTES, &sh.full[stage]);
          } else if constexpr (C == Copy::BulkCopyFirst) {
            // The copy may complete before the expect_tx: the transaction count goes negative and
            // the phase still cannot complete before this thread's arrival.
            bulk_copy_to_shared(dst, src, SLICE_BYTES, &sh.full[stage]);
            mbar_arrive_expect_tx(&sh.full[stage], SLICE_BYTES);
          } else if constexpr (C == Copy::BulkSplit) {
            mbar_expect_tx(&sh.full[stage], SLICE_BYTES);
            bulk_copy_to_shared(dst, src, SLICE_BYTES, &sh.full[stage]);
            mbar_arrive(&sh.full[stage]);  // a plain arrive, issued after the copy (see the header)
          } else if constexpr (C == Copy::Tma1d) {
            mbar_arrive_expect_tx(&sh.full[stage], SLICE_BYTES);
            for (int b = 0; b < SLICE_WORDS / TMA1D_BOX; ++b)
              tensor_copy_1d(dst + b * TMA1D_BOX, source, slice * SLICE_WORDS + b * TMA1D_BOX, &sh.full[stage]);
          } else {  // Tma3d: box {64 words, 16 rows, 1 slice} at (0, 0, slice)
            mbar_arrive_expect_tx(&sh.full[stage], SLICE_BYTES);
            tensor_copy_3d(dst, source, 0, 0, slice, &sh.full[stage]);
          }
        }
        if constexpr (H == Hooks::Fixed) {
          __syncwarp();
        } else {
          mbar_wait(&sh.full[stage], round & 1);
          if constexpr (H == Hooks::DecodeBroken) __syncthreads();  // the bug: only this warp gets here
        }
        if constexpr (F == Handoff::NamedBoth) {
          if (i >= PUBLISH_LAG) publish_landed<H>(sh.full, i - PUBLISH_LAG);
        }
      }
    }
    if constexpr (F == Handoff::NamedBoth) {
      for (int j = n > PUBLISH_LAG ? n - PUBLISH_LAG : 0; j < n; ++j) publish_landed<H>(sh.full, j);
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  for (int i = warp - 1; i < n; i += PROBE_CONSUMERS) {
    const int stage = i % PROBE_STAGES, round = i / PROBE_STAGES;
    if (H == Hooks::Fixed || (H == Hooks::SkipFirstFullWait && round > 0)) {
      if constexpr (F == Handoff::NamedBoth) {
        named_barrier_sync<STAGE_BARRIER_THREADS>(FULL_BARRIER0 + stage);
      } else {
        mbar_wait(&sh.full[stage], round & 1);
      }
    }
    const int sum = warp_slice_sum(sh.slices[stage], lane);
    if (lane == 0) out[blockIdx.x * n + i] = sum;
    if constexpr (releases) {
      if constexpr (F == Handoff::LaneEmpty) {
        mbar_arrive(&sh.empty[stage]);  // each lane's own reads come before its own arrival
      } else if constexpr (named_empty(F)) {
        // Only for a stage the producer refills: an arrival nobody syncs with would stay pending.
        __syncwarp();  // converged for the .aligned barrier
        if (i + PROBE_STAGES < n) named_barrier_arrive<STAGE_BARRIER_THREADS>(EMPTY_BARRIER0 + stage);
      } else {
        __syncwarp();
        if (lane == 0) mbar_arrive(&sh.empty[stage]);
      }
    }
  }
}

// A kernel over the pool: ring<copy, hooks[, handoff]>.
#define PROBE_POOL_KERNEL(name, ...)                                                                          \
  extern "C" __global__ void __launch_bounds__(PROBE_THREADS)                                                \
      name(const int* __restrict__ pool, const int* __restrict__ table, int n, int* __restrict__ out) {       \
    ring<__VA_ARGS__>(pool, table, n, out);                                                                   \
  }

PROBE_POOL_KERNEL(probe_bulk, Copy::Bulk, Hooks::Fixed)
PROBE_POOL_KERNEL(probe_bulk_broken, Copy::Bulk, Hooks::NoConsumerWait)
PROBE_POOL_KERNEL(probe_bulk_decode_broken, Copy::Bulk, Hooks::DecodeBroken)
PROBE_POOL_KERNEL(probe_bulk_copy_first, Copy::BulkCopyFirst, Hooks::Fixed)
PROBE_POOL_KERNEL(probe_bulk_split, Copy::BulkSplit, Hooks::Fixed)
PROBE_POOL_KERNEL(probe_bulk_split_broken, Copy::BulkSplit, Hooks::NoConsumerWait)
PROBE_POOL_KERNEL(probe_bulk_split_decode_broken, Copy::BulkSplit, Hooks::DecodeBroken)
PROBE_POOL_KERNEL(probe_cpasync, Copy::CpAsync, Hooks::Fixed)
PROBE_POOL_KERNEL(probe_cpasync_broken, Copy::CpAsync, Hooks::NoConsumerWait)
PROBE_POOL_KERNEL(probe_plain, Copy::Plain, Hooks::Fixed)
PROBE_POOL_KERNEL(probe_plain_broken, Copy::Plain, Hooks::NoConsumerWait)

// The bulk copy with another stage hand-off (see Handoff).

PROBE_POOL_KERNEL(probe_bulk_lane_empty, Copy::Bulk, Hooks::Fixed, Handoff::LaneEmpty)
PROBE_POOL_KERNEL(probe_bulk_lane_empty_broken, Copy::Bulk, Hooks::SkipFirstFullWait, Handoff::LaneEmpty)
PROBE_POOL_KERNEL(probe_bulk_named_empty, Copy::Bulk, Hooks::Fixed, Handoff::NamedEmpty)
PROBE_POOL_KERNEL(probe_bulk_named_empty_broken, Copy::Bulk, Hooks::SkipFirstFullWait, Handoff::NamedEmpty)
PROBE_POOL_KERNEL(probe_bulk_named_both, Copy::Bulk, Hooks::Fixed, Handoff::NamedBoth)
PROBE_POOL_KERNEL(probe_bulk_named_both_broken, Copy::Bulk, Hooks::SkipFirstFullWait, Handoff::NamedBoth)

// The tensor map in global memory (written by the host before the launch): a plain pointer
// argument, so CuPy's RawKernel and graph capture need nothing new. The acquire fence orders the
// tensor-map proxy's reads of the map after the generic-proxy writes that put it there.
#define PROBE_GLOBAL_MAP_KERNEL(name, copy, hooks)                                                            \
  extern "C" __global__ void __launch_bounds__(PROBE_THREADS)                                                \
      name(const TensorMap128* map, const int* __restrict__ table, int n, int* __restrict__ out) {            \
    if (threadIdx.x == 0) asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(map) : "memory"); \
    ring<copy, hooks>(map, table, n, out);                                                                    \
  }

PROBE_GLOBAL_MAP_KERNEL(probe_tma1d_global, Copy::Tma1d, Hooks::Fixed)
PROBE_GLOBAL_MAP_KERNEL(probe_tma3d_global, Copy::Tma3d, Hooks::Fixed)
PROBE_GLOBAL_MAP_KERNEL(probe_tma3d_global_broken, Copy::Tma3d, Hooks::NoConsumerWait)
PROBE_GLOBAL_MAP_KERNEL(probe_tma3d_global_decode_broken, Copy::Tma3d, Hooks::DecodeBroken)

// The tensor map as a kernel parameter: 128 bytes that CuPy's argument packing cannot carry
// (the host side launches it with cuLaunchKernel).
extern "C" __global__ void __launch_bounds__(PROBE_THREADS)
probe_tma3d_param(const __grid_constant__ TensorMap128 map, const int* __restrict__ table, int n, int* __restrict__ out) {
  ring<Copy::Tma3d, Hooks::Fixed>(&map, table, n, out);
}

#else
// ============================================================ libcu++: cuda::memcpy_async + cuda::barrier
#include <cuda/barrier>

using block_barrier = cuda::barrier<cuda::thread_scope_block>;

struct LibShared {
  int slices[PROBE_STAGES][SLICE_WORDS];
  block_barrier full[PROBE_STAGES];
  block_barrier empty[PROBE_STAGES];
};
__device__ int probe_smem_bytes = sizeof(LibShared);

template <bool kFixed>  // false: the NoConsumerWait hooks of the raw kernels
__device__ __forceinline__ void libcu_ring(const int* __restrict__ pool, const int* __restrict__ table, int n,
                                           int* __restrict__ out) {
  extern __shared__ __align__(128) unsigned char shared_raw[];
  LibShared& sh = *reinterpret_cast<LibShared*>(shared_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int* block_table = table + blockIdx.x * n;

  if (threadIdx.x == 0) {
    for (int s = 0; s < PROBE_STAGES; ++s) {
      init(&sh.full[s], 1);
      init(&sh.empty[s], 1);
    }
  }
  __syncthreads();

  if (warp == 0) {
    for (int i = 0; i < n; ++i) {
      const int stage = i % PROBE_STAGES, round = i / PROBE_STAGES;
      if (lane == 0) {
        if constexpr (kFixed) sh.empty[stage].wait_parity(((round & 1) ^ 1) != 0);
        // On sm_90 with a 16-byte-aligned size and a block-scope barrier in shared memory, this is
        // cp.async.bulk completing on the barrier, followed by its expect_tx.
        (void)cuda::memcpy_async(sh.slices[stage], pool + (long long)block_table[i] * SLICE_WORDS,
                                 cuda::aligned_size_t<16>(SLICE_BYTES), sh.full[stage]);
        (void)sh.full[stage].arrive();
      }
      if constexpr (kFixed) {
        __syncwarp();
      } else {
        sh.full[stage].wait_parity((round & 1) != 0);
      }
    }
    return;
  }

  for (int i = warp - 1; i < n; i += PROBE_CONSUMERS) {
    const int stage = i % PROBE_STAGES, round = i / PROBE_STAGES;
    if constexpr (kFixed) sh.full[stage].wait_parity((round & 1) != 0);
    const int sum = warp_slice_sum(sh.slices[stage], lane);
    if (lane == 0) out[blockIdx.x * n + i] = sum;
    if constexpr (kFixed) {
      __syncwarp();
      if (lane == 0) (void)sh.empty[stage].arrive();
    }
  }
}

extern "C" __global__ void __launch_bounds__(PROBE_THREADS)
probe_memcpy_async(const int* __restrict__ pool, const int* __restrict__ table, int n, int* __restrict__ out) {
  libcu_ring<true>(pool, table, n, out);
}

extern "C" __global__ void __launch_bounds__(PROBE_THREADS)
probe_memcpy_async_broken(const int* __restrict__ pool, const int* __restrict__ table, int n, int* __restrict__ out) {
  libcu_ring<false>(pool, table, n, out);
}
#endif
