// verify.cu: the decode step for several tokens at once, reading each weight once for all of them.
//
// Reference: nanoqwen/reference/backend.py, NumpyBackend.verify_logits: rows [token, *drafts] at
// consecutive positions, each row what a decode step computes at its position.
//
// A speculative verify pass runs `tokens` rows (the last accepted token and its drafts, at most
// VERIFY_ROWS) through the layers. At batch 1 every decode kernel streams its weights and does
// two FLOPs per weight, so the same stream can multiply several rows for nearly the same time:
// the kernels here are decode's (gemv_int4.cu, lm_head.cu, sampler.cu), each with a token
// dimension. Every row is computed with decode's arithmetic in decode's order (the same split-K
// ranges and split order, the same MMA inputs per column, the same per-lane FMA chains in the
// lm_head), so a row's logits, and so its token, are the bits a decode step at that position
// gives: greedy and sampled speculation make plain decoding's tokens exactly.
//
// The rest of the pass needs no kernel of its own: add_rmsnorm_cluster and embed_tokens already
// take a row per cluster or block, and paged_attention_decode takes the rows in gridDim.z.
#include "gemv_int4.cu"
#include "lm_head.cu"
#include "sampler.cu"

constexpr int VERIFY_ROWS = 17;  // the most rows of a pass: nanoqwen.speculative.MAX_DRAFTS + 1
NQ_EXPORT_INT(VERIFY_ROWS)
// Each verify GEMV comes in two widths: up to MMA_COLUMNS tokens (one MMA per weight fragment,
// registers close to decode's), and up to VERIFY_ROWS (three). A kernel sized for 17 tokens keeps
// 12 accumulators a tile per lane, which costs q|k|v and o a block per SM; the short passes, the
// most common, run the narrow kernels (nanoqwen/cuda/verify.py picks by the pass's rows).
constexpr int NARROW_ROWS = 8;
static_assert(NARROW_ROWS == MMA_COLUMNS, "a narrow verify GEMV takes one MMA block of columns");
NQ_EXPORT_INT(NARROW_ROWS)

// One warp's ring of a verify GEMV: its decode twin's depth of weight slots, without the x slots
// (int4_tile_dot loads a verify pass's x from global memory), so the block takes less shared memory
// than decode's and as many blocks fit an SM. The host reads NAME_ring_bytes to size the launch.
template <int STAGES, int TILES>
using VerifyRing = uint4[STAGES][TILES][2][WARP_SIZE];

template <int STAGES, int TILES>
__device__ __forceinline__ VerifyRing<STAGES, TILES>& verify_ring() {
  return reinterpret_cast<VerifyRing<STAGES, TILES>*>(gemv_shared)[threadIdx.x / WARP_SIZE];
}

// After its loop a warp's ring holds its split's sums instead, [tile][token][row of the tile]
// (TOKENS tokens apart), so that no static shared memory of every token's sums costs an SM the
// blocks decode fits.
template <int STAGES, int TILES, int TOKENS>
__device__ __forceinline__ float* split_sums_of(int split) {
  static_assert(sizeof(VerifyRing<STAGES, TILES>) >= TILES * TOKENS * TILE_ROWS * sizeof(float),
                "a verify ring must hold its warp's split sums");
  return reinterpret_cast<float*>(reinterpret_cast<VerifyRing<STAGES, TILES>*>(gemv_shared) + split);
}

// Each warp's split sums into its ring, from the MMA layout int4_tile_dot leaves (lane (g, t),
// block c: tokens 8 c + 2 t and 8 c + 2 t + 1 of rows g and g + 8); then one barrier.
template <int STAGES, int TILES, int TOKENS>
__device__ __forceinline__ void store_split_sums(const float (&acc)[TILES][gemv_accumulators(TOKENS)], int tokens) {
  const int split = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
  copy_async_wait<0>();  // no copy of the loop's is still landing in the ring (the last groups' are empty)
  __syncwarp();          // and no lane still reads it
  float* sums = split_sums_of<STAGES, TILES, TOKENS>(split);
#pragma unroll
  for (int m = 0; m < TILES; ++m) {
#pragma unroll
    for (int c = 0; c < gemv_accumulators(TOKENS) / 4; ++c) {
#pragma unroll
      for (int column = 0; column < 2; ++column) {
        const int token = c * MMA_COLUMNS + 2 * t + column;
        if (token < tokens) {
          sums[(m * TOKENS + token) * TILE_ROWS + g] = acc[m][4 * c + column];
          sums[(m * TOKENS + token) * TILE_ROWS + g + 8] = acc[m][4 * c + 2 + column];
        }
      }
    }
  }
  __syncthreads();
}

// Row `row` of tile `m` for `token`: begun from `start`, the splits added in split order, as
// add_splits (gemv_int4.cu) adds decode's.
template <int STAGES, int TILES, int TOKENS>
__device__ __forceinline__ float split_total(int m, int token, int row, float start) {
  const int splits = blockDim.x / WARP_SIZE, entry = (m * TOKENS + token) * TILE_ROWS + row;
  float total = split_sums_of<STAGES, TILES, TOKENS>(0)[entry] + start;
  for (int s = 1; s < splits; ++s) total += split_sums_of<STAGES, TILES, TOKENS>(s)[entry];
  return total;
}

// One 16-row tile of a verify GEMV: split_k_tile_dot for `tokens` rows of x, each warp into its own
// ring, then every warp's sums into its ring (one barrier).
template <int K, int STAGES, bool AHEAD, int TOKENS>
__device__ __forceinline__ void rows_tile_sums(const unsigned int* __restrict__ qweight,
                                               const unsigned short* __restrict__ scales, const unsigned short* x,
                                               const int (&rows)[1][2], int tokens) {
  float acc[1][gemv_accumulators(TOKENS)] = {};
  split_k_tile_dot<K, STAGES, AHEAD, TOKENS>(qweight, scales, x, rows, verify_ring<STAGES, 1>(), nullptr, tokens, acc);
  store_split_sums<STAGES, 1, TOKENS>(acc, tokens);
}

// After rows_tile_sums the block finishes every (token, row of the tile) once, entry e being token
// e / 16 and row e % 16, in passes of blockDim.x entries. Every thread runs every pass, so the 16
// entries of a token sit in one half-warp (the RoPE partner shuffle relies on it).

// y[token] = W x[token] (+ bias) for `tokens` rows of x, as gemv_int4_split_k computes one.
//   x fp16 [tokens, K], y fp32 [tokens, n_rows]; the rest as gemv_int4_split_k's.
// grid (ceil(n_rows / 16)), block (32 splits: decode's split of this projection),
// dynamic shared memory splits x NAME_ring_bytes
template <int K, int STAGES, bool AHEAD, int TOKENS>
__device__ __forceinline__ void gemv_int4_rows_split_k(const unsigned int* __restrict__ qweight,
                                                       const unsigned short* __restrict__ scales,
                                                       const unsigned short* __restrict__ bias,
                                                       const unsigned short* x, float* __restrict__ y, int n_rows,
                                                       int tokens) {
  let_next_kernel_launch();
  const int lane = threadIdx.x % WARP_SIZE;
  const int row0 = blockIdx.x * TILE_ROWS + lane / 4, row1 = row0 + 8;
  const int rows[1][2] = {{min(row0, n_rows - 1), min(row1, n_rows - 1)}};
  rows_tile_sums<K, STAGES, AHEAD, TOKENS>(qweight, scales, x, rows, tokens);
  for (int base = 0; base < tokens * TILE_ROWS; base += blockDim.x) {
    const int e = base + threadIdx.x, token = e / TILE_ROWS, r = e % TILE_ROWS;
    const int row = blockIdx.x * TILE_ROWS + r;
    if (token < tokens && row < n_rows)
      y[(long long)token * n_rows + row] =
          split_total<STAGES, 1, TOKENS>(0, token, r, bias != nullptr ? half_to_float(bias[row]) : 0.0f);
  }
}

// Each verify GEMV has its decode twin's ring depth and AHEAD (gemv_int4.cu), and a register budget
// (__maxnreg__) that keeps the blocks per SM decode's launch relies on at the 7B: q|k|v three blocks
// of 10 warps and o two of 12 (64 registers: the narrow kernels), down_proj two of 10 (96), gate+up
// all its 1184 tiles at once, 9 blocks of 2 warps (112). The wide q|k|v fits two.
#define NQ_GEMV_INT4_ROWS_KERNEL(NAME, K, STAGES, AHEAD, TOKENS, REGISTERS)                                \
  __device__ int NAME##_ring_bytes = sizeof(VerifyRing<STAGES, 1>);                                        \
  extern "C" __global__ void __maxnreg__(REGISTERS)                                                        \
      NAME(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,            \
           const unsigned short* __restrict__ bias, const unsigned short* x, float* __restrict__ y,        \
           int n_rows, int tokens) {                                                                       \
    gemv_int4_rows_split_k<K, STAGES, AHEAD, TOKENS>(qweight, scales, bias, x, y, n_rows, tokens);         \
  }

NQ_GEMV_INT4_ROWS_KERNEL(gemv_int4_rows_from_q_dim_narrow, NQ_Q_DIM, NQ_FROM_Q_DIM_STAGES, true, NARROW_ROWS, 64)
NQ_GEMV_INT4_ROWS_KERNEL(gemv_int4_rows_from_q_dim_wide, NQ_Q_DIM, NQ_FROM_Q_DIM_STAGES, true, VERIFY_ROWS, 96)
NQ_GEMV_INT4_ROWS_KERNEL(gemv_int4_rows_from_intermediate_narrow, NQ_INTERMEDIATE, NQ_FROM_INTERMEDIATE_STAGES, false,
                         NARROW_ROWS, 96)
NQ_GEMV_INT4_ROWS_KERNEL(gemv_int4_rows_from_intermediate_wide, NQ_INTERMEDIATE, NQ_FROM_INTERMEDIATE_STAGES, false,
                         VERIFY_ROWS, 96)

// gemv_int4_qkv_rope for `tokens` rows at positions positions[0] + token: each row's q rotated into
// q_out [tokens, Q_DIM], its K and V into its page. Block and row order as gemv_int4_qkv_rope's.
// grid (NQ_QKV_DIM / 16), block (32 splits), dynamic shared memory splits x NAME_ring_bytes
template <int TOKENS>
__device__ __forceinline__ void qkv_rope_rows(const unsigned int* __restrict__ qweight,
                                              const unsigned short* __restrict__ scales,
                                              const unsigned short* __restrict__ bias, const unsigned short* x,
                                              const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                              const int* __restrict__ page_table, unsigned short* __restrict__ kv_layer,
                                              float* __restrict__ q_out, int tokens) {
  let_next_kernel_launch();
  int rows[1][2], head_slot, first_dim;
  rope_tile_rows(blockIdx.x, rows, head_slot, first_dim);
  const int head_row = head_slot * NQ_HEAD_DIM;
  rows_tile_sums<NQ_HIDDEN, NQ_FROM_HIDDEN_STAGES, true, TOKENS>(qweight, scales, x, rows, tokens);
  // Read after the sums, not before: held through the GEMV, it cost the narrow kernel a spill
  // within its 64 registers at hidden sizes to 2048.
  const int first_position = positions[0];
  for (int base = 0; base < tokens * TILE_ROWS; base += blockDim.x) {
    const int e = base + threadIdx.x, token = e / TILE_ROWS, m = e % TILE_ROWS;
    const bool finishes = token < tokens;
    const int dim = rope_tile_dim(first_dim, m);
    const float total = finishes ? split_total<NQ_FROM_HIDDEN_STAGES, 1, TOKENS>(
                                       0, token, m, bias != nullptr ? half_to_float(bias[head_row + dim]) : 0.0f)
                                 : 0.0f;
    const float partner = __shfl_xor_sync(FULL_MASK, total, ROPE_PAIRS_PER_TILE);  // rows m and m ^ 8
    if (!finishes) continue;
    const int position = first_position + token;
    float c, s;
    rope_cos_sin(position, inv_freq[dim % ROPE_HALF], c, s);
    const long long page = head_slot >= NQ_NUM_HEADS ? page_table[position / NQ_PAGE_SIZE] : 0;
    store_qkv_dim(head_slot, dim, total, rope_rotate(total, partner, c, s, m < ROPE_PAIRS_PER_TILE), page,
                  position % NQ_PAGE_SIZE, kv_layer, q_out + (long long)token * NQ_Q_DIM);
  }
}

#define NQ_QKV_ROPE_ROWS_KERNEL(NAME, TOKENS, REGISTERS)                                                   \
  __device__ int NAME##_ring_bytes = sizeof(VerifyRing<NQ_FROM_HIDDEN_STAGES, 1>);                         \
  extern "C" __global__ void __maxnreg__(REGISTERS)                                                        \
      NAME(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,            \
           const unsigned short* __restrict__ bias, const unsigned short* x, const int* __restrict__ positions, \
           const float* __restrict__ inv_freq, const int* __restrict__ page_table,                         \
           unsigned short* __restrict__ kv_layer, float* __restrict__ q_out, int tokens) {                  \
    qkv_rope_rows<TOKENS>(qweight, scales, bias, x, positions, inv_freq, page_table, kv_layer, q_out, tokens); \
  }

NQ_QKV_ROPE_ROWS_KERNEL(gemv_int4_qkv_rope_rows_narrow, NARROW_ROWS, 64)
NQ_QKV_ROPE_ROWS_KERNEL(gemv_int4_qkv_rope_rows_wide, VERIFY_ROWS, 96)

// gemv_int4_gate_up_silu for `tokens` rows: h [tokens, I] fp16.
// grid (ceil(I / 16)), block (32 decode's splits), dynamic shared memory splits x NAME_ring_bytes
template <int TOKENS>
__device__ __forceinline__ void gate_up_silu_rows(const unsigned int* __restrict__ qweight,
                                                  const unsigned short* __restrict__ scales, const unsigned short* x,
                                                  unsigned short* __restrict__ h, int tokens) {
  __shared__ __align__(16) unsigned short tile_scales[2][TILE_ROWS * (NQ_HIDDEN / NQ_GROUP_SIZE)];
  let_next_kernel_launch();
  float acc[2][gemv_accumulators(TOKENS)] = {};
  gate_up_tile_dot<NQ_GATE_UP_STAGES, TOKENS>(qweight, scales, x, tile_scales, verify_ring<NQ_GATE_UP_STAGES, 2>(),
                                             nullptr, tokens, acc);
  store_split_sums<NQ_GATE_UP_STAGES, 2, TOKENS>(acc, tokens);
  for (int base = 0; base < tokens * TILE_ROWS; base += blockDim.x) {
    const int e = base + threadIdx.x, token = e / TILE_ROWS, r = e % TILE_ROWS;
    const int row = blockIdx.x * TILE_ROWS + r;
    if (token < tokens && row < NQ_INTERMEDIATE)
      h[(long long)token * NQ_INTERMEDIATE + row] =
          float_to_half(silu_times(split_total<NQ_GATE_UP_STAGES, 2, TOKENS>(0, token, r, 0.0f),
                                   split_total<NQ_GATE_UP_STAGES, 2, TOKENS>(1, token, r, 0.0f)));
  }
}

#define NQ_GATE_UP_SILU_ROWS_KERNEL(NAME, TOKENS, REGISTERS)                                               \
  __device__ int NAME##_ring_bytes = sizeof(VerifyRing<NQ_GATE_UP_STAGES, 2>);                             \
  extern "C" __global__ void __maxnreg__(REGISTERS)                                                        \
      NAME(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,            \
           const unsigned short* x, unsigned short* __restrict__ h, int tokens) {                          \
    gate_up_silu_rows<TOKENS>(qweight, scales, x, h, tokens);                                              \
  }

NQ_GATE_UP_SILU_ROWS_KERNEL(gemv_int4_gate_up_silu_rows_narrow, NARROW_ROWS, 112)
NQ_GATE_UP_SILU_ROWS_KERNEL(gemv_int4_gate_up_silu_rows_wide, VERIFY_ROWS, 112)

// lm_head_logits for `tokens` rows of x: every weight row is loaded once and multiplied with each
// token's x by the lane FMA chain and butterfly of scan_rows, so each logit is decode's bits. The
// key of row j is its logit (greedy) or logit + T * gumbel(seed, position + j, id), as decode's
// would be at that position.
// grid (persistent), block (LM_THREADS); x fp16 [tokens, H]; logits fp32 [tokens, V];
// candidate_values, candidate_indices [tokens, gridDim.x]; state and sampler as lm_head_logits'
// (a sampler with top-k never reaches here: the host chooses, CudaBackend.verify);
// dynamic shared memory tokens x H fp16
extern "C" __global__ void __launch_bounds__(LM_THREADS, 1)
lm_head_logits_rows(const uint4* x, const uint4* __restrict__ weight, float* __restrict__ logits,
                    float* __restrict__ candidate_values, int* __restrict__ candidate_indices, const int* state,
                    const SamplerSettings* sampler, int tokens) {
  uint4* x_shared = reinterpret_cast<uint4*>(gemv_shared);  // [tokens][LM_PIECES]
  __shared__ float warp_values[VERIFY_ROWS][LM_WARPS];
  __shared__ int warp_indices[VERIFY_ROWS][LM_WARPS];
  __shared__ unsigned int warp_non_finite[LM_WARPS];  // bit j: token j saw a NaN or +inf logit
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  let_next_kernel_launch();
  const int first_row = blockIdx.x * LM_WARPS + warp;
  uint4 w[LM_PIECES_PER_LANE];
  if (first_row < NQ_VOCAB) load_lm_row(weight, first_row, lane, w);
  const double temperature = key_temperature(sampler);
  unsigned int steps[VERIFY_ROWS];
#pragma unroll
  for (int j = 0; j < VERIFY_ROWS; ++j) steps[j] = temperature > 0 ? noise_step(*sampler, state[STATE_POSITION] + j) : 0u;
  wait_for_previous_kernel();
  for (int piece = threadIdx.x; piece < tokens * LM_PIECES; piece += LM_THREADS) x_shared[piece] = x[piece];
  __syncthreads();

  float best_value[VERIFY_ROWS];
  int best_index[VERIFY_ROWS];
#pragma unroll
  for (int j = 0; j < VERIFY_ROWS; ++j) best_value[j] = NEGATIVE_INFINITY, best_index[j] = 0;
  unsigned int non_finite = 0;
  const int warps_in_grid = gridDim.x * LM_WARPS;
  for (int row = first_row; row < NQ_VOCAB; row += warps_in_grid) {
    if (row != first_row) load_lm_row(weight, row, lane, w);
    // Pieces outside, tokens inside: each piece of weights is converted to fp32 once for all the
    // tokens, and every token's FMA chain still runs over the pieces in scan_rows' order.
    float sums[VERIFY_ROWS];
#pragma unroll
    for (int j = 0; j < VERIFY_ROWS; ++j) sums[j] = 0.0f;
#pragma unroll
    for (int p = 0; p < LM_PIECES_PER_LANE; ++p) {
      const int piece = lane + p * WARP_SIZE;
      if (piece >= LM_PIECES) continue;
      const unsigned int ws[4] = {w[p].x, w[p].y, w[p].z, w[p].w};
      float2 wf[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) wf[k] = half2_to_float2(ws[k]);
#pragma unroll
      for (int j = 0; j < VERIFY_ROWS; ++j) {
        if (j >= tokens) break;  // the same for the whole block
        const uint4 xv = x_shared[j * LM_PIECES + piece];
        const unsigned int xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // dot8_half's order
          const float2 xf = half2_to_float2(xs[k]);
          sums[j] = fmaf(wf[k].x, xf.x, sums[j]);
          sums[j] = fmaf(wf[k].y, xf.y, sums[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < VERIFY_ROWS; ++j) {
      if (j >= tokens) break;
      const float sum = warp_sum(sums[j]);
      if (lane == 0) logits[(long long)j * NQ_VOCAB + row] = sum;
      if (!(sum < POSITIVE_INFINITY)) non_finite |= 1u << j;
      const float key = temperature > 0 ? noisy_key(sum, scaled_noise(temperature, steps[j], row)) : sum;
      if (better_candidate(key, row, best_value[j], best_index[j])) {
        best_value[j] = key;
        best_index[j] = row;
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < VERIFY_ROWS; ++j) warp_values[j][warp] = best_value[j], warp_indices[j][warp] = best_index[j];
    warp_non_finite[warp] = non_finite;
  }
  __syncthreads();
  if (warp != 0) return;
  unsigned int block_non_finite = lane < LM_WARPS ? warp_non_finite[lane] : 0u;
#pragma unroll
  for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) block_non_finite |= __shfl_xor_sync(FULL_MASK, block_non_finite, offset);
  for (int j = 0; j < tokens; ++j) {
    float value = lane < LM_WARPS ? warp_values[j][lane] : NEGATIVE_INFINITY;
    int index = lane < LM_WARPS ? warp_indices[j][lane] : 0;
    warp_argmax(value, index);
    if (lane == 0) {
      candidate_values[j * gridDim.x + blockIdx.x] = block_non_finite >> j & 1u ? __int_as_float(0x7fc00000) : value;
      candidate_indices[j * gridDim.x + blockIdx.x] = index;
    }
  }
}

// The pass's last kernel: row j's token from its candidates (argmax_select_next's reduction), and
// the verdict: rows are accepted up to and including the first whose token differs from the next
// row's input (its draft). The state advances past the accepted tokens, with the last of them as
// the next step's input, and verdict (mapped host memory) receives [accepted, status, tokens...].
// A row with non-finite logits ends the pass with STATUS_NOT_FINITE.
// grid (1), block (ARGMAX_THREADS); candidates [tokens, num_candidates]; row_tokens int32 [tokens]
// (the pass's input: token, drafts); state as argmax_select_next's; verdict int32 [2 + VERIFY_ROWS]
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
verify_select(const float* candidate_values, const int* candidate_indices, int num_candidates, int tokens,
              const int* __restrict__ row_tokens, int* __restrict__ state, int* __restrict__ verdict) {
  __shared__ int chosen[VERIFY_ROWS];
  let_next_kernel_launch();
  const int position = state[STATE_POSITION], seq_len = state[STATE_SEQ_LEN];
  wait_for_previous_kernel();
  int accepted = 0, status = 0;
  for (int j = 0; j < tokens; ++j) {
    float value;
    int index;
    const bool flagged = reduce_candidates(candidate_values + (long long)j * num_candidates,
                                           candidate_indices + (long long)j * num_candidates, num_candidates, value,
                                           index);
    if (threadIdx.x == 0) chosen[j] = index;
    accepted = j + 1;
    if (flagged || value == NEGATIVE_INFINITY) {
      status = STATUS_NOT_FINITE;
      break;
    }
    if (j + 1 == tokens || index != row_tokens[j + 1]) break;  // the same for every thread
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int head[STATE_PAGE_TABLE] = {chosen[accepted - 1], position + accepted, seq_len + accepted, status};
#pragma unroll
    for (int i = 0; i < STATE_PAGE_TABLE; ++i) state[i] = head[i];
    verdict[0] = accepted;
    verdict[1] = status;
    for (int j = 0; j < accepted; ++j) verdict[2 + j] = chosen[j];
  }
}
