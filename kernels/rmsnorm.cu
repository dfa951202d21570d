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
// many SMs, which exchange their tiles' sums of squares through distributed shared memory. Every
// kernel that normalizes a decode row adds its squares in one order, decode's order (below): the
// cluster, a block holding the whole row (normalize_row_in_block, for the persistent kernel), and
// the GEMVs around a norm, which split it between them (gemv_int4.cu), all give the same bits.
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

// The slice's updated residual into x; returns this thread's sum of squares (add_rmsnorm's order:
// decode's kernels add the squares of x in decode's order instead).
template <int THREADS, int VECTORS, int ITEMS>
__device__ __forceinline__ float update_slice(const float4* residual_row, const float4* delta_row, int first,
                                              float4 (&x)[ITEMS]) {
  float sum_squares = 0.0f;
#pragma unroll
  for (int item = 0; item < ITEMS; ++item) {
    const int i = threadIdx.x + item * THREADS;
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

// ---------------------------------------------------------------- decode's order of the squares
//
// A decode row's sum of squares is added in one order, whichever kernels hold the row:
// 1. The row is cut into NORM_TILES tiles of 16 values, a GEMV's 16-row tile. Tile t's sum is a
//    16-lane butterfly: with value m of the tile in lane m, each lane adds its square to lane
//    m ^ 8's, then to m ^ 4's, m ^ 2's and m ^ 1's partial sums, and every lane ends with the same
//    bits. The GEMV that produces the row can so add up each tile as it finishes it.
// 2. One warp adds the tile sums: lane l adds tiles l, l + 32, l + 64, ... in order from zero, and
//    warp_sum adds the lanes.
// __fmul_rn and __fadd_rn keep the compiler from fusing a square into its sum (an FMA rounds once,
// a multiply and an add twice), which would give each kernel its own bits. NumPy replays the order
// in nanoqwen.testing.decode_order_square_sums.
constexpr int NORM_TILE_VALUES = 16;
constexpr int NORM_TILES = NQ_HIDDEN / NORM_TILE_VALUES;

// Tile sum of 16 values held one per lane by lanes 16 k .. 16 k + 15 (value m in lane 16 k + m); each
// of the 16 lanes returns it. Every lane of the warp calls it.
__device__ __forceinline__ float tile_squares_across_lanes(float value) {
  float sum = __fmul_rn(value, value);
#pragma unroll
  for (int offset = NORM_TILE_VALUES / 2; offset > 0; offset >>= 1)
    sum = __fadd_rn(sum, __shfl_xor_sync(FULL_MASK, sum, offset));
  return sum;
}

// The same sum, with values 4 j .. 4 j + 3 of the tile held as one float4 by lane 4 k + j: the
// butterfly's steps m ^ 8 and m ^ 4 are lanes j ^ 2 and j ^ 1, its steps m ^ 2 and m ^ 1 the
// float4's own components. Each of the 4 lanes returns it. Every lane of the warp calls it.
__device__ __forceinline__ float tile_squares_of_float4s(float4 r) {
  float4 s = make_float4(__fmul_rn(r.x, r.x), __fmul_rn(r.y, r.y), __fmul_rn(r.z, r.z), __fmul_rn(r.w, r.w));
#pragma unroll
  for (int offset = 2; offset > 0; offset >>= 1) {
    s.x = __fadd_rn(s.x, __shfl_xor_sync(FULL_MASK, s.x, offset));
    s.y = __fadd_rn(s.y, __shfl_xor_sync(FULL_MASK, s.y, offset));
    s.z = __fadd_rn(s.z, __shfl_xor_sync(FULL_MASK, s.z, offset));
    s.w = __fadd_rn(s.w, __shfl_xor_sync(FULL_MASK, s.w, offset));
  }
  return __fadd_rn(__fadd_rn(s.x, s.z), __fadd_rn(s.y, s.w));
}

// The row's sum of squares from its NORM_TILES tile sums, as one warp adds them; every lane of the
// calling warp returns it. tile_sums may be an earlier kernel's output: plain loads.
__device__ __forceinline__ float row_squares_from_tiles(const float* tile_sums) {
  float sum = 0.0f;
  for (int t = threadIdx.x % WARP_SIZE; t < NORM_TILES; t += WARP_SIZE) sum = __fadd_rn(sum, tile_sums[t]);
  return warp_sum(sum);
}

// ---------------------------------------------------------------- decode: a row over a cluster
//
// A cluster is a group of blocks that Hopper schedules at the same time on SMs of one GPC and
// that may read and write each other's shared memory. Block `rank` of the cluster owns float4
// numbers [rank * CLUSTER_VECTORS, (rank + 1) * CLUSTER_VECTORS) of the row, whole tiles of decode's
// order. The 4 lanes of each tile add its squares and store the sum into the tile's slot of every
// block's `tile_sums`, 2 blocks a lane; after one cluster barrier each warp adds all the tile sums
// as decode's order does, so every block computes the same inv_rms. The barrier is split: each
// block announces at its start that it is running (arrive), and waits for the others only just
// before its remote stores, since a block's shared memory may be written only once the block has
// started.
constexpr int RMS_CLUSTER = 8;  // the portable maximum cluster size
NQ_EXPORT_INT(RMS_CLUSTER)
constexpr int CLUSTER_VECTORS = RMS_VECTORS / RMS_CLUSTER;  // float4 per block: 112 for the 7B
constexpr int CLUSTER_THREADS_WANTED = (CLUSTER_VECTORS + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;
constexpr int CLUSTER_THREADS = CLUSTER_THREADS_WANTED < 1024 ? CLUSTER_THREADS_WANTED : 1024;
constexpr int CLUSTER_ITEMS = (CLUSTER_VECTORS + CLUSTER_THREADS - 1) / CLUSTER_THREADS;
static_assert(RMS_VECTORS % RMS_CLUSTER == 0, "hidden_size / 4 must split evenly over the cluster");
static_assert(CLUSTER_VECTORS % (NORM_TILE_VALUES / 4) == 0, "a cluster block must hold whole tiles of 16 values");

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
  __shared__ float tile_sums[NORM_TILES];  // every block's tiles
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
  update_slice<CLUSTER_THREADS, CLUSTER_VECTORS>(residual_row, delta_row_of(delta, row), first, x);
  float tile_squares[CLUSTER_ITEMS];
#pragma unroll
  for (int item = 0; item < CLUSTER_ITEMS; ++item) {  // every lane shuffles; those past the slice add zeros
    const bool holds = threadIdx.x + item * CLUSTER_THREADS < CLUSTER_VECTORS;
    tile_squares[item] = tile_squares_of_float4s(holds ? x[item] : make_float4(0.0f, 0.0f, 0.0f, 0.0f));
  }
  cluster_wait_acquire();  // every block of the cluster has started
  constexpr int LANES_PER_TILE = NORM_TILE_VALUES / 4, RANKS_PER_LANE = RMS_CLUSTER / LANES_PER_TILE;
#pragma unroll
  for (int item = 0; item < CLUSTER_ITEMS; ++item) {
    const int v = threadIdx.x + item * CLUSTER_THREADS;  // this lane's float4 in the slice
    if (v >= CLUSTER_VECTORS) break;
    const int tile = (first + v) / LANES_PER_TILE, lane_in_tile = v % LANES_PER_TILE;
#pragma unroll
    for (int r = 0; r < RANKS_PER_LANE; ++r)
      store_to_cluster_block(&tile_sums[tile], lane_in_tile * RANKS_PER_LANE + r, tile_squares[item]);
  }
  cluster_arrive_release();
  cluster_wait_acquire();  // every tile's sum is in every block's tile_sums
  const float inv_rms = inverse_rms(row_squares_from_tiles(tile_sums));
  store_slice<CLUSTER_THREADS, CLUSTER_VECTORS>(residual_row, out, row, first, x, w, inv_rms);
}

// ---------------------------------------------------------------- decode's bits in one block
//
// The persistent decode kernel (decode_persistent.cu) normalizes the whole updated row in each of
// its blocks, bit for bit as add_rmsnorm_cluster does: each warp sums two tiles at a time, a value
// per lane as a GEMV's block sums its tile, and each warp adds the tile sums, in decode's order.
static_assert(NORM_TILES % 2 == 0, "a warp sums two tiles at a time");

// out = norm(row) * weight, fp16 [H]. row: the updated residual, RMS_VECTORS float4 in shared
// memory; tile_sums: NORM_TILES floats of shared memory. Every thread of the block calls it, after
// the barrier that makes the row visible.
__device__ __forceinline__ void normalize_row_in_block(const float4* row, const unsigned short* __restrict__ weight,
                                                       uint2* out, float* tile_sums) {
  const float* values = reinterpret_cast<const float*>(row);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, warps = blockDim.x / WARP_SIZE;
  for (int pair = warp; pair < NORM_TILES / 2; pair += warps) {
    const float sum = tile_squares_across_lanes(values[pair * WARP_SIZE + lane]);
    if (lane % NORM_TILE_VALUES == 0) tile_sums[2 * pair + lane / NORM_TILE_VALUES] = sum;
  }
  __syncthreads();
  const float inv_rms = inverse_rms(row_squares_from_tiles(tile_sums));
  const uint2* weight4 = reinterpret_cast<const uint2*>(weight);
  for (int v = threadIdx.x; v < RMS_VECTORS; v += blockDim.x) out[v] = normalized_halves(row[v], inv_rms, __ldg(weight4 + v));
}
