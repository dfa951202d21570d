// lm_head.cu: logits = W x with W fp16 [V, H], x fp16 [H]; then the next token, chosen on device.
//
// Reference: reference/ops.py fp16_linear (fp32 products and sums), and nanoqwen.sampling.sample for
// the choice (numpy.argmax when greedy).
//
// At V = 152064 and H = 3584 the matrix is 1.09 GB, a quarter of every decoded token's bytes,
// so this is the single largest stream of the step. A warp owns a tile of 16 rows at a time and
// multiplies it on the tensor cores, as the INT4 GEMVs do (gemv_int4.cu): mma.m16n8k16 takes the
// tile's rows as A and x as B, products exact and sums in fp32. Lane (g, t) loads 16 bytes of
// rows g and g + 8 from every 32-element window of the row, elements 8 t .. 8 t + 7, and the
// matching 16 bytes of x; the MMA's k slots are relabelled to fit (its slots 2t, 2t+1 and
// 2t+8, 2t+9 take elements 8t..8t+3, two MMAs per window), which a dot product allows. Each lane
// has LM_BATCH windows of both rows in flight (all issued before the first is used). x was staged
// in shared memory once for all the block's tiles. The grid is persistent: as many blocks as fit
// on the GPU, each warp striding over tiles, so no block ever waits to be scheduled.
//
// Decode repeats its one x in the MMA's 8 columns; a verify pass (kernels/verify.cu) puts a token
// in each, and since a column's sums depend only on its own x, each token's logits are decode's
// bits. The FMA chains of CUDA cores would be bound by arithmetic from about four tokens on.
//
// Greedy decoding needs only the index of the largest logit. Each warp tracks its best row
// while it goes; each block leaves one (value, index) candidate; argmax_select_next reduces
// the candidates and writes the winner where the next step's embedding reads its token.
// Sampling at a temperature T is an argmax too (the Gumbel-max trick): of each row's key,
// float32(logit + T * g), with g a standard Gumbel variable that a hash of (seed, position, row)
// gives, so the sampled token never leaves the device either (nanoqwen/sampling.py says why the
// draw is exact and computes the same keys on the host).
// Non-finite logits must not pass silently (numpy's greedy choice raises on them, see
// nanoqwen/sampling.py): a block that computed a NaN or +inf logit leaves NaN as its candidate
// value, which never wins a comparison, and argmax_select_next turns any such NaN, or a best
// logit of -inf, into state[STATE_STATUS] = STATUS_NOT_FINITE, which the host checks with the token.
#pragma once  // verify.cu includes it too, for its multi-row kernels
#include "common.cuh"
#include "sampler.cuh"

constexpr int LM_PIECES = NQ_HIDDEN / 8;  // 16-byte pieces (8 halves) per row
constexpr int LM_THREADS = 256;
NQ_EXPORT_INT(LM_THREADS)
constexpr int LM_WARPS = LM_THREADS / WARP_SIZE;
constexpr int LM_TILE_ROWS = 16;                    // rows of a warp's tile: the MMA's M
constexpr int LM_TILES = (NQ_VOCAB + LM_TILE_ROWS - 1) / LM_TILE_ROWS;
constexpr int LM_WINDOWS = NQ_HIDDEN / 32;          // 32-element windows of a row, 4 pieces each
// Windows of both rows a lane has in flight, and blocks per SM: 16 warps per SM with 16 pieces in
// flight each (128 registers a thread) keep the stream as full as 24 with 12 would, without the
// spills that 80 registers cost the tensor-core tile.
#ifndef NQ_LM_BATCH
#define NQ_LM_BATCH 8
#endif
#ifndef NQ_LM_BLOCKS_PER_SM
#define NQ_LM_BLOCKS_PER_SM 2
#endif
constexpr int LM_BATCH = NQ_LM_BATCH;
static_assert(NQ_HIDDEN % 32 == 0, "lm_head_logits takes H in 32-element windows");

// d = A B + d for a 16x16 fp16 A (rows g, g+8), a 16x8 fp16 B, fp32 accumulators.
__device__ __forceinline__ void lm_mma(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                       unsigned int a3, unsigned int b0, unsigned int b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Lane (g, t)'s pieces of windows [first_window, first_window + LM_BATCH) of its tile's rows g
// and g + 8 (`rows`: the pieces of window 0 of each), all loads issued before any is used.
__device__ __forceinline__ void load_lm_batch(const uint4* const (&rows)[2], int first_window, uint4 (&w)[LM_BATCH][2]) {
#pragma unroll
  for (int b = 0; b < LM_BATCH; ++b) {
    if (first_window + b < LM_WINDOWS) {
#pragma unroll
      for (int r = 0; r < 2; ++r) w[b][r] = load_weights_16B(rows[r] + 4 * (first_window + b));
    }
  }
}

// Lane (g, t)'s rows of tile `tile`, g and g + 8 (the last row where the tile runs past the end):
// where its pieces of window 0 sit.
__device__ __forceinline__ void lm_tile_rows(const uint4* __restrict__ weight, int tile, int lane,
                                             const uint4* (&rows)[2]) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    rows[r] = weight + (long long)min(tile * LM_TILE_ROWS + g + 8 * r, NQ_VOCAB - 1) * LM_PIECES + t;
}

// The logits of one 16-row tile for BLOCKS blocks of 8 columns: lane (g, t) ends with d[c] = rows
// g (d[0], d[1]) and g + 8 (d[2], d[3]) of columns 2t and 2t + 1 of block c. Column n of block c
// multiplies `column_x[c]` (the lane's token 8 c + g: its row of pieces in shared memory). `w`
// holds the tile's first batch on entry (the caller may load it early); the batches after it
// are loaded here. Decode and the verify pass both run it, so a column's sums are the same
// sequence of MMAs over the same fragments whatever the other columns hold.
template <int BLOCKS>
__device__ __forceinline__ void lm_tile_dot(const uint4* const (&rows)[2], const uint4* const (&column_x)[BLOCKS],
                                            int blocks, int t, uint4 (&w)[LM_BATCH][2], float (&d)[BLOCKS][4]) {
#pragma unroll
  for (int c = 0; c < BLOCKS; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0.0f;
#pragma unroll 1
  for (int first_window = 0; first_window < LM_WINDOWS; first_window += LM_BATCH) {
    if (first_window != 0) load_lm_batch(rows, first_window, w);
    // Each batch's MMAs start from zero and its sums join d with one rounded add each: the tensor
    // cores' accumulation truncates, which over a whole row's 224 MMAs would drift by more than
    // fp32's rounding of the dot product does (the kernel tests' tolerance).
    float batch[BLOCKS][4] = {};
#pragma unroll
    for (int b = 0; b < LM_BATCH; ++b) {
      const int window = first_window + b;
      if (window >= LM_WINDOWS) break;  // the same for the whole warp
#pragma unroll
      for (int c = 0; c < BLOCKS; ++c) {
        if (c >= blocks) break;  // the same for the whole warp
        const uint4 xv = column_x[c][4 * window + t];
        lm_mma(batch[c], w[b][0].x, w[b][1].x, w[b][0].y, w[b][1].y, xv.x, xv.y);
        lm_mma(batch[c], w[b][0].z, w[b][1].z, w[b][0].w, w[b][1].w, xv.z, xv.w);
      }
    }
#pragma unroll
    for (int c = 0; c < BLOCKS; ++c)
      for (int k = 0; k < 4; ++k) d[c][k] += batch[c][k];
  }
}

// The temperature of the lm_head's keys: 0 (the keys are the logits) when greedy, and with a top-k,
// where argmax_select_next filters the plain logits before it draws.
__device__ __forceinline__ double key_temperature(const SamplerSettings* sampler) {
  return sampler == nullptr || sampler->top_k > 0 ? 0.0 : sampler->temperature;
}

// Row `row`'s key from its logit and its noise T * g (gumbel_noise(step, row)): separate
// roundings, as numpy's keys: logit + (T * g), never one fused multiply-add.
__device__ __forceinline__ double scaled_noise(double temperature, unsigned int step, int row) {
  return __dmul_rn(temperature, gumbel_noise(step, row));
}
__device__ __forceinline__ float noisy_key(float logit, double noise) { return (float)__dadd_rn((double)logit, noise); }

// One warp's tiles, from `first_tile` (whose first batch `w` already holds) in steps of the grid's
// warps: each row's logit into `logits`, the best key so far into best_value and best_index. Every
// column holds the same x, so lanes t = 0 (column 0) hold the results. A template, so that the
// greedy scan carries none of the sampler's instructions.
template <bool SAMPLING>
__device__ __forceinline__ void scan_tiles(const uint4* __restrict__ weight, float* __restrict__ logits,
                                           const uint4* x_shared, int first_tile, int lane,
                                           uint4 (&w)[LM_BATCH][2], double temperature, unsigned int step,
                                           float& best_value, int& best_index, bool& saw_non_finite) {
  const int g = lane / 4, t = lane % 4, warps_in_grid = gridDim.x * LM_WARPS;
  const uint4* const column_x[1] = {x_shared};
  for (int tile = first_tile; tile < LM_TILES; tile += warps_in_grid) {
    const uint4* rows[2];
    lm_tile_rows(weight, tile, lane, rows);
    if (tile != first_tile) load_lm_batch(rows, 0, w);
    float d[1][4];
    lm_tile_dot<1>(rows, column_x, 1, t, w, d);
    if (t != 0) continue;  // columns 1-7 repeat column 0
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = tile * LM_TILE_ROWS + g + 8 * r;
      if (row >= NQ_VOCAB) continue;
      const float logit = d[0][2 * r];
      logits[row] = logit;
      saw_non_finite |= !(logit < POSITIVE_INFINITY);  // NaN or +inf
      const float key = SAMPLING ? noisy_key(logit, scaled_noise(temperature, step, row)) : logit;
      if (better_candidate(key, row, best_value, best_index)) {
        best_value = key;
        best_index = row;
      }
    }
  }
}

// grid (persistent: blocks that fit at once), block (LM_THREADS)
//   x fp16 [H], weight fp16 [V, H], logits fp32 [V],
//   candidate_values fp32 [gridDim.x], candidate_indices int32 [gridDim.x] (of the keys: the
//   logits when greedy), state int32 (common.cuh: the step's position) and sampler: both null, or
//   both set (prefill's lm_head passes null: the host chooses from its logits)
// What an earlier kernel of the step wrote is read with ordinary loads: no __restrict__ on its
// pointer and no __ldg, see nanoqwen/cuda/launch.py ("the read-only path").
// NQ_LM_BLOCKS_PER_SM blocks per SM (__launch_bounds__ holds ptxas to their registers): the
// sampler's float64 noise must not cost greedy decode a block per SM.
extern "C" __global__ void __launch_bounds__(LM_THREADS, NQ_LM_BLOCKS_PER_SM)
lm_head_logits(const uint4* x, const uint4* __restrict__ weight, float* __restrict__ logits,
               float* __restrict__ candidate_values, int* __restrict__ candidate_indices, const int* state,
               const SamplerSettings* sampler) {
  __shared__ uint4 x_shared[LM_PIECES];
  __shared__ float warp_values[LM_WARPS];
  __shared__ int warp_indices[LM_WARPS];
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  let_next_kernel_launch();
  // The weights are no kernel's output, so each warp's first batch is on its way while the final
  // norm, which writes x, finishes.
  const int first_tile = blockIdx.x * LM_WARPS + warp;
  uint4 w[LM_BATCH][2];
  const uint4* first_rows[2];
  lm_tile_rows(weight, first_tile, lane, first_rows);
  if (first_tile < LM_TILES) load_lm_batch(first_rows, 0, w);
  // No kernel of this step writes the sampler (the host sets it before the launch) or the position
  // (the previous step's argmax_select_next advanced it): both can be read before the wait.
  const double temperature = key_temperature(sampler);
  const unsigned int step = temperature > 0 ? noise_step(*sampler, state[STATE_POSITION]) : 0u;
  wait_for_previous_kernel();
  for (int piece = threadIdx.x; piece < LM_PIECES; piece += LM_THREADS) x_shared[piece] = x[piece];
  __syncthreads();

  float best_value = NEGATIVE_INFINITY;
  int best_index = 0;
  bool saw_non_finite = false;
  if (temperature > 0)
    scan_tiles<true>(weight, logits, x_shared, first_tile, lane, w, temperature, step, best_value, best_index, saw_non_finite);
  else
    scan_tiles<false>(weight, logits, x_shared, first_tile, lane, w, 0.0, 0u, best_value, best_index, saw_non_finite);

  warp_argmax(best_value, best_index);  // lanes t != 0 hold (-inf, 0), which never wins
  if (lane == 0) {
    warp_values[warp] = best_value;
    warp_indices[warp] = best_index;
  }
  const bool block_saw_non_finite = __syncthreads_or(saw_non_finite);
  if (warp == 0) {
    float value = lane < LM_WARPS ? warp_values[lane] : NEGATIVE_INFINITY;
    int index = lane < LM_WARPS ? warp_indices[lane] : 0;
    warp_argmax(value, index);
    if (lane == 0) {
      candidate_values[blockIdx.x] = block_saw_non_finite ? __int_as_float(0x7fc00000) : value;  // NaN flags it
      candidate_indices[blockIdx.x] = index;
    }
  }
}
