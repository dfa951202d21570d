// lm_head.cu: logits = W x with W fp16 [V, H], x fp16 [H]; then the next token, chosen on device.
//
// Reference: reference/ops.py fp16_linear (fp32 products and sums), and nanoqwen.sampling.sample for
// the choice (numpy.argmax when greedy).
//
// At V = 152064 and H = 3584 the matrix is 1.09 GB, a quarter of every decoded token's bytes,
// so this is the single largest stream of the step. A warp owns one row at a time: each lane
// loads LM_PIECES_PER_LANE 16-byte pieces of it (all issued before the first is used) and
// multiplies them with the matching pieces of x, which the block staged in shared memory once
// for all its rows (in registers, x would halve the warps that fit on an SM). A butterfly (warp_sum) finishes the row. The grid is persistent: as many blocks
// as fit on the GPU, each warp striding over rows, so no block ever waits to be scheduled.
//
// Greedy decoding needs only the index of the largest logit. Each warp tracks its best row
// while it goes; each block leaves one (value, index) candidate; argmax_select_next reduces
// the candidates and writes the winner where the next step's embedding reads its token.
// Sampling at a temperature T is an argmax too (the Gumbel-max trick): of each row's key,
// float32(logit + T * g), with g a standard Gumbel variable that a hash of (seed, position, row)
// gives, so the sampled token never leaves the device either (nanoqwen/sampling.py says why the
// draw is exact and computes the same keys on the host). The noise does not depend on the row's
// weights, so the warp computes it while the row's loads are in flight.
// Non-finite logits must not pass silently (numpy's greedy choice raises on them, see
// nanoqwen/sampling.py): a block that computed a NaN or +inf logit leaves NaN as its candidate
// value, which never wins a comparison, and argmax_select_next turns any such NaN, or a best
// logit of -inf, into state[STATE_STATUS] = STATUS_NOT_FINITE, which the host checks with the token.
#pragma once  // verify.cu includes it too, for its multi-row kernels
#include "common.cuh"
#include "sampler.cuh"

constexpr int LM_PIECES = NQ_HIDDEN / 8;  // 16-byte pieces (8 halves) per row
constexpr int LM_PIECES_PER_LANE = (LM_PIECES + WARP_SIZE - 1) / WARP_SIZE;
constexpr int LM_THREADS = 256;
NQ_EXPORT_INT(LM_THREADS)
constexpr int LM_WARPS = LM_THREADS / WARP_SIZE;

__device__ __forceinline__ float dot8_half(uint4 w, uint4 x, float sum) {
  const unsigned int ws[4] = {w.x, w.y, w.z, w.w}, xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 wf = half2_to_float2(ws[k]), xf = half2_to_float2(xs[k]);
    sum = fmaf(wf.x, xf.x, sum);
    sum = fmaf(wf.y, xf.y, sum);
  }
  return sum;
}

// This lane's pieces of one row of the weight, all loads issued before any is used.
__device__ __forceinline__ void load_lm_row(const uint4* __restrict__ weight, int row, int lane,
                                            uint4 (&w)[LM_PIECES_PER_LANE]) {
  const uint4* w_row = weight + (long long)row * LM_PIECES;
#pragma unroll
  for (int p = 0; p < LM_PIECES_PER_LANE; ++p) {
    const int piece = lane + p * WARP_SIZE;
    if (piece < LM_PIECES) w[p] = load_weights_16B(w_row + piece);
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

// One warp's rows, from `first_row` (whose pieces `w` already holds) in steps of the grid's warps:
// each row's logit into `logits`, the best key so far into best_value and best_index. A template,
// so that the greedy scan carries none of the sampler's instructions.
template <bool SAMPLING>
__device__ __forceinline__ void scan_rows(const uint4* __restrict__ weight, float* __restrict__ logits,
                                          const uint4* x_shared, int first_row, int lane,
                                          uint4 (&w)[LM_PIECES_PER_LANE], double temperature, unsigned int step,
                                          float& best_value, int& best_index, bool& saw_non_finite) {
  const int warps_in_grid = gridDim.x * LM_WARPS;
  for (int row = first_row; row < NQ_VOCAB; row += warps_in_grid) {
    if (row != first_row) load_lm_row(weight, row, lane, w);
    const double noise = SAMPLING ? scaled_noise(temperature, step, row) : 0.0;
    float sum = 0.0f;
#pragma unroll
    for (int p = 0; p < LM_PIECES_PER_LANE; ++p)
      if (lane + p * WARP_SIZE < LM_PIECES) sum = dot8_half(w[p], x_shared[lane + p * WARP_SIZE], sum);
    sum = warp_sum(sum);  // every lane now holds the row's logit
    if (lane == 0) logits[row] = sum;
    saw_non_finite |= !(sum < POSITIVE_INFINITY);  // NaN or +inf
    const float key = SAMPLING ? noisy_key(sum, noise) : sum;
    if (better_candidate(key, row, best_value, best_index)) {
      best_value = key;
      best_index = row;
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
// A thread holds its row's pieces (4 registers each) and about 24 registers besides. Up to 14
// pieces (hidden sizes to 3584) three blocks per SM fit at 80 registers a thread, 24 warps each
// with a row in flight; wider rows take two blocks per SM (128 registers), about as many bytes
// in flight per SM, where at three ptxas spills the pieces to local memory (hidden 5120: 364
// bytes a thread). __launch_bounds__ holds ptxas to the count: the sampler's float64 noise must
// not cost greedy decode a block per SM.
constexpr int SM_REGISTERS = 65536;  // a Hopper SM's register file
constexpr int LM_REGISTERS = 4 * LM_PIECES_PER_LANE + 24;
// The registers a thread may take when `blocks` blocks share an SM, in ptxas's steps of 8 (the
// host's plan.bounded_registers).
constexpr int lm_register_budget(int blocks) { return SM_REGISTERS / (blocks * LM_THREADS) / 8 * 8; }
constexpr int LM_MIN_BLOCKS = LM_REGISTERS <= lm_register_budget(3) ? 3 : LM_REGISTERS <= lm_register_budget(2) ? 2 : 1;
extern "C" __global__ void __launch_bounds__(LM_THREADS, LM_MIN_BLOCKS)
lm_head_logits(const uint4* x, const uint4* __restrict__ weight, float* __restrict__ logits,
               float* __restrict__ candidate_values, int* __restrict__ candidate_indices, const int* state,
               const SamplerSettings* sampler) {
  __shared__ uint4 x_shared[LM_PIECES];
  __shared__ float warp_values[LM_WARPS];
  __shared__ int warp_indices[LM_WARPS];
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  let_next_kernel_launch();
  // The weights are no kernel's output, so each warp's first row is on its way while the final
  // norm, which writes x, finishes; every later row is loaded at the top of its iteration.
  const int first_row = blockIdx.x * LM_WARPS + warp;
  uint4 w[LM_PIECES_PER_LANE];
  if (first_row < NQ_VOCAB) load_lm_row(weight, first_row, lane, w);
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
    scan_rows<true>(weight, logits, x_shared, first_row, lane, w, temperature, step, best_value, best_index, saw_non_finite);
  else
    scan_rows<false>(weight, logits, x_shared, first_row, lane, w, 0.0, 0u, best_value, best_index, saw_non_finite);

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
