// rmsnorm.cu: the residual update fused with the RMSNorm that follows it.
//
// Reference (nanoqwen/reference/ops.py, add_rmsnorm):
//     residual = residual + delta                                  fp32 [T, H]
//     out      = residual / sqrt(mean(residual**2) + eps) * weight  fp32 math, fp16 [T, H]
//
// One block per token row; each thread owns RMS_ITEMS float4 of the row and keeps them in
// registers between the two passes, so the row is read once and written once.
//
// `delta` is a projection's output: prefill's GEMM, or a decode GEMV, which adds its split-K
// pieces itself (gemv_int4.cu). The first layer passes none (null): its residual is the
// embedding.
//
// Decode has one row, and one block reading it keeps a single SM busy while the rest of the
// GPU waits: `add_rmsnorm_cluster` spreads the row over a cluster of RMS_CLUSTER blocks on as
// many SMs, which add their sums of squares through distributed shared memory. A kernel that holds
// the whole updated row already normalizes it in one block with that kernel's bits
// (normalize_row_in_block, at the end of this file).
#pragma once  // decode_persistent.cu includes it too, for normalize_row_in_block
#include "common.cuh"

constexpr int RMS_VECTORS = NQ_HIDDEN / 4;                       // float4 per row
constexpr int RMS_THREADS = RMS_VECTORS < 1024 ? RMS_VECTORS : 1024;  // a multiple of 32
constexpr int RMS_ITEMS = (RMS_VECTORS + RMS_THREADS - 1) / RMS_THREADS;

// residual[v] + delta[v] (the float4 number v of one row; no delta: the residual as it is).
__device__ __forceinline__ float4 updated_residual(const float4* residual_row, const float4* delta_row, int v) {
  float4 r = residual_row[v];
  if (delta_row != nullptr) {
    const float4 d = delta_row[v];
    r.x += d.x;
    r.y += d.y;
    r.z += d.z;
    r.w += d.w;
  }
  return r;
}

__device__ __forceinline__ const float4* delta_row_of(const float* delta, long long row) {
  return delta == nullptr ? nullptr : reinterpret_cast<const float4*>(delta + row * NQ_HIDDEN);
}

__device__ __forceinline__ float squares(float4 r) { return r.x * r.x + r.y * r.y + r.z * r.z + r.w * r.w; }

// IEEE sqrt and division, like numpy.
__device__ __forceinline__ float inverse_rms(float sum_squares) {
  return 1.0f / sqrtf(sum_squares / (float)NQ_HIDDEN + NQ_RMS_EPS);
}

// Four normalized values as fp16, x * inv_rms * weight in fp32.
__device__ __forceinline__ uint2 normalized_halves(float4 x, float inv_rms, uint2 weight) {
  const float2 w01 = half2_to_float2(weight.x), w23 = half2_to_float2(weight.y);
  return make_uint2(float2_to_half2(x.x * inv_rms * w01.x, x.y * inv_rms * w01.y),
                    float2_to_half2(x.z * inv_rms * w23.x, x.w * inv_rms * w23.y));
}

// A block's slice of a row: float4 numbers [first, first + VECTORS), ITEMS per thread, so that
// both kernels below read the weights before their wait and keep the row in registers.
template <int THREADS, int VECTORS, int ITEMS>
__device__ __forceinline__ void load_weight_slice(const unsigned short* weight, int first, uint2 (&w)[ITEMS]) {
  const uint2* weight4 = reinterpret_cast<const uint2*>(weight) + first;
#pragma unroll
  for (int item = 0; item < ITEMS; ++item) {
    const int i = threadIdx.x + item * THREADS;
    if (i < VECTORS) w[item] = __ldg(weight4 + i);
  }
}

// The slice's updated residual into x; returns this thread's sum of squares. `thread` is the
// thread's index in its block (the persistent decode kernel plays the cluster's threads itself).
template <int THREADS, int VECTORS, int ITEMS>
__device__ __forceinline__ float update_slice(const float4* residual_row, const float4* delta_row, int first,
                                              float4 (&x)[ITEMS], int thread = threadIdx.x) {
  float sum_squares = 0.0f;
#pragma unroll
  for (int item = 0; item < ITEMS; ++item) {
    const int i = thread + item * THREADS;
    if (i < VECTORS) {
      x[item] = updated_residual(residual_row, delta_row, first + i);
      sum_squares += squares(x[item]);
    }
  }
  return sum_squares;
}

// The slice's residual written back and its normalized values out.
template <int THREADS, int VECTORS, int ITEMS>
__device__ __forceinline__ void store_slice(float4* residual_row, unsigned short* out, long long row, int first,
                                            const float4 (&x)[ITEMS], const uint2 (&w)[ITEMS], float inv_rms) {
  uint2* out_row = reinterpret_cast<uint2*>(out + row * NQ_HIDDEN);
#pragma unroll
  for (int item = 0; item < ITEMS; ++item) {
    const int i = threadIdx.x + item * THREADS;
    if (i < VECTORS) {
      residual_row[first + i] = x[item];
      out_row[first + i] = normalized_halves(x[item], inv_rms, w[item]);
    }
  }
}

// grid (T), block (RMS_THREADS)
//   residual  fp32 [T, H], updated in place
//   delta     fp32 [T, H], or null (nothing to add)
//   weight    fp16 [H]
//   out       fp16 [T, H]
// What an earlier kernel of the step wrote is read with ordinary loads: no __restrict__ on its
// pointer and no __ldg, see nanoqwen/cuda/launch.py ("the read-only path").
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
add_rmsnorm(float* __restrict__ residual, const float* delta, const unsigned short* __restrict__ weight,
            unsigned short* __restrict__ out) {
  __shared__ float scratch[RMS_THREADS / WARP_SIZE];
  let_next_kernel_launch();
  const long long row = blockIdx.x;
  float4* residual_row = reinterpret_cast<float4*>(residual + row * NQ_HIDDEN);
  uint2 w[RMS_ITEMS];  // the norm's weights are no kernel's output: fetched while the kernel before finishes
  load_weight_slice<RMS_THREADS, RMS_VECTORS>(weight, 0, w);
  wait_for_previous_kernel();  // residual and delta are the earlier kernels' output

  float4 x[RMS_ITEMS];
  const float sum_squares = update_slice<RMS_THREADS, RMS_VECTORS>(residual_row, delta_row_of(delta, row), 0, x);
  const float inv_rms = inverse_rms(block_sum<RMS_THREADS>(sum_squares, scratch));
  store_slice<RMS_THREADS, RMS_VECTORS>(residual_row, out, row, 0, x, w, inv_rms);
}

// ---------------------------------------------------------------- decode: a row over a cluster
//
// A cluster is a group of blocks that Hopper schedules at the same time on SMs of one GPC and
// that may read and write each other's shared memory. Block `rank` of the cluster owns float4
// numbers [rank * CLUSTER_VECTORS, (rank + 1) * CLUSTER_VECTORS) of the row; after its block sum
// it stores its sum of squares into slot `rank` of every block's `cluster_sums`, and after one
// cluster barrier every block adds the RMS_CLUSTER slots in rank order, so all of them compute
// the same inv_rms. The barrier is split: each block announces at its start that it is running
// (arrive), and waits for the others only just before its remote stores, since a block's shared
// memory may be written only once the block has started.
constexpr int RMS_CLUSTER = 8;  // the portable maximum cluster size
NQ_EXPORT_INT(RMS_CLUSTER)
constexpr int CLUSTER_VECTORS = RMS_VECTORS / RMS_CLUSTER;  // float4 per block: 112 for the 7B
constexpr int CLUSTER_THREADS_WANTED = (CLUSTER_VECTORS + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;
constexpr int CLUSTER_THREADS = CLUSTER_THREADS_WANTED < 1024 ? CLUSTER_THREADS_WANTED : 1024;
constexpr int CLUSTER_ITEMS = (CLUSTER_VECTORS + CLUSTER_THREADS - 1) / CLUSTER_THREADS;
static_assert(RMS_VECTORS % RMS_CLUSTER == 0, "hidden_size / 4 must split evenly over the cluster");

__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait_acquire() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// *local_slot's twin in the shared memory of cluster block `rank` = value.
__device__ __forceinline__ void store_to_cluster_block(float* local_slot, int rank, float value) {
  unsigned int remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"((unsigned int)__cvta_generic_to_shared(local_slot)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(value) : "memory");
}

// grid (T * RMS_CLUSTER), block (CLUSTER_THREADS), clusters of RMS_CLUSTER consecutive blocks;
// arguments as add_rmsnorm's.
extern "C" __global__ void __cluster_dims__(RMS_CLUSTER, 1, 1) __launch_bounds__(CLUSTER_THREADS)
add_rmsnorm_cluster(float* __restrict__ residual, const float* delta, const unsigned short* __restrict__ weight,
                    unsigned short* __restrict__ out) {
  __shared__ float scratch[CLUSTER_THREADS / WARP_SIZE];
  __shared__ float cluster_sums[RMS_CLUSTER];
  let_next_kernel_launch();
  cluster_arrive_relaxed();  // this block runs: the others may store into its shared memory
  const long long row = blockIdx.x / RMS_CLUSTER;
  const int rank = blockIdx.x % RMS_CLUSTER;  // %cluster_ctarank: the clusters tile the 1-D grid in order
  const int first = rank * CLUSTER_VECTORS;
  float4* residual_row = reinterpret_cast<float4*>(residual + row * NQ_HIDDEN);
  uint2 w[CLUSTER_ITEMS];
  load_weight_slice<CLUSTER_THREADS, CLUSTER_VECTORS>(weight, first, w);
  wait_for_previous_kernel();  // residual and delta are the earlier kernels' output

  float4 x[CLUSTER_ITEMS];
  const float sum_squares =
      update_slice<CLUSTER_THREADS, CLUSTER_VECTORS>(residual_row, delta_row_of(delta, row), first, x);
  const float block_squares = block_sum<CLUSTER_THREADS>(sum_squares, scratch);
  cluster_wait_acquire();  // every block of the cluster has started
  if (threadIdx.x < RMS_CLUSTER) store_to_cluster_block(&cluster_sums[rank], threadIdx.x, block_squares);
  cluster_arrive_release();
  cluster_wait_acquire();  // every block's sum is in every block's cluster_sums
  float total = 0.0f;
#pragma unroll
  for (int r = 0; r < RMS_CLUSTER; ++r) total += cluster_sums[r];
  store_slice<CLUSTER_THREADS, CLUSTER_VECTORS>(residual_row, out, row, first, x, w, inverse_rms(total));
}

// ---------------------------------------------------------------- the cluster's bits in one block
//
// The persistent decode kernel (decode_persistent.cu) normalizes the whole updated row in each of
// its blocks, bit for bit as add_rmsnorm_cluster does: the block's warps play the cluster's
// RMS_CLUSTER x CLUSTER_THREADS threads. Warp w plays the cluster's warps w, w + warps, ...
// (virtual warp v is warp v % CLUSTER_WARPS of cluster block v / CLUSTER_WARPS): its lanes add
// their slice's squares as update_slice does and warp_sum reduces them. Then every thread adds
// each cluster block's warp sums in block_sum's order, and the blocks' sums in rank order.
constexpr int CLUSTER_WARPS = CLUSTER_THREADS / WARP_SIZE;
constexpr int NORM_VIRTUAL_WARPS = RMS_CLUSTER * CLUSTER_WARPS;

// out = norm(row) * weight, fp16 [H]. row: the updated residual, RMS_VECTORS float4 in shared
// memory; virtual_sums: NORM_VIRTUAL_WARPS floats of shared memory. Every thread of the block
// calls it, after the barrier that makes the row visible.
__device__ __forceinline__ void normalize_row_in_block(const float4* row, const unsigned short* __restrict__ weight,
                                                       uint2* out, float* virtual_sums) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, warps = blockDim.x / WARP_SIZE;
  for (int v = warp; v < NORM_VIRTUAL_WARPS; v += warps) {
    const int rank = v / CLUSTER_WARPS, thread = v % CLUSTER_WARPS * WARP_SIZE + lane;
    float4 x[CLUSTER_ITEMS];
    const float squares =
        update_slice<CLUSTER_THREADS, CLUSTER_VECTORS>(row, nullptr, rank * CLUSTER_VECTORS, x, thread);
    const float warp_total = warp_sum(squares);
    if (lane == 0) virtual_sums[v] = warp_total;
  }
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int rank = 0; rank < RMS_CLUSTER; ++rank) {
    float block_total = 0.0f;  // block_sum's order; with one warp, 0 + its sum is that sum exactly
    for (int w = 0; w < CLUSTER_WARPS; ++w) block_total += virtual_sums[rank * CLUSTER_WARPS + w];
    total += block_total;
  }
  const float inv_rms = inverse_rms(total);
  const uint2* weight4 = reinterpret_cast<const uint2*>(weight);
  for (int v = threadIdx.x; v < RMS_VECTORS; v += blockDim.x) out[v] = normalized_halves(row[v], inv_rms, __ldg(weight4 + v));
}
