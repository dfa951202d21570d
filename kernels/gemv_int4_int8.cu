// Path A of chapter 8: INT8 activations and __dp4a for the INT4 projections.
//
// The engine's default GEMV (gemv_int4.cu, "Path B") keeps the activations in fp16, unpacks
// each INT4 weight to fp16 and accumulates in fp32. This file is the alternative the chapter
// measures it against: quantize the activation vector to INT8 once per projection, then let
// one __dp4a multiply four INT4 weights by four INT8 activations and add them to an int32.
//
//   quantize_activations_int8   x fp16 [K]  ->  xq int8 [K] (in PAIR ORDER, below),
//                                               xscale f32 [K/128] (one per group of 128)
//   gemv_int4_int8              y[n] = sum over groups g of
//                                      (sum_{k in g} q[n,k] * xq[k]) * (wscale[n,g] * xscale[g])
//                                      (+ bias[n])                               -> y f32 [N]
//
// K is a template parameter: one pair of entry points per input width of the model
// (`_hidden`, `_q_dim`, `_intermediate`, from common.cuh's -D constants, which
// nanoqwen/cuda/build.py sets), so every loop has a compile-time trip count. N is an argument.
//
// The CPU reference is nanoqwen/cuda/int8.py: quantize_activations_int8 and int4_int8_linear
// compute the same bits (every float operation here is an explicit round-to-nearest intrinsic,
// so no fused multiply-add or fast-math flag can change a result), and
// tests/test_int8_path.py compares the two on random inputs with assert_array_equal.
//
// Which activation byte meets which nibble
// ----------------------------------------
// Word j of a weight row holds elements 8j..8j+7, element e in nibble NIBBLE_OF_ELEMENT[e] =
// (0,4,1,5,2,6,3,7)[e], as the unsigned value q + 8 (ARCHITECTURE.md). Read as four bytes,
// each byte carries two elements:
//
//     byte          3         2         1         0
//     nibble      7    6    5    4    3    2    1    0
//     element    e7   e5   e3   e1   e6   e4   e2   e0
//
// Keep only the high nibble of every byte and flip the byte's top bit:
//
//     hi = ( w       & 0xF0F0F0F0) ^ 0x80808080   ->  signed bytes 16*(q2, q6, q3, q7)
//     lo = ((w << 4) & 0xF0F0F0F0) ^ 0x80808080   ->  signed bytes 16*(q0, q4, q1, q5)
//
// A nibble q + 8 in the high half of a byte is the byte 16q + 128; flipping bit 7 subtracts
// 128 modulo 256, leaving exactly the two's-complement byte 16q. So one lop3 (and one shift
// for lo) turns four nibbles into four signed bytes: no per-byte subtract, no borrow between
// bytes. The factor 16 is taken out once per group, by an exact arithmetic shift of the int32
// sum (every product is a multiple of 16).
//
// __dp4a multiplies byte i of one operand by byte i of the other, so the activations must be
// stored in the same order. The quantize kernel writes each chunk of eight as
//
//     PAIR ORDER:  x0 x4 x1 x5 | x2 x6 x3 x7        (bytes 8j .. 8j+7)
//
// and the GEMV pairs activation int32 number 2j with lo of word j, 2j+1 with hi of word j.
//
// Sizes: |16 q x| <= 16 * 8 * 127, times 128 per group = 2,080,768 < 2^31; after the shift
// the group sum is below 2^17, so its conversion to float is exact.

#include "common.cuh"

// Everything but the entry points lives in a namespace, so that this file can share a module
// with the engine's kernels without its constants colliding with theirs.
namespace int8_path {

// ------------------------------------------------------------------------------------------
// Kernel 1: quantize the activation vector, symmetric, one fp32 scale per group of 128.
//     scale = max|x| / 127,  q = clamp(rint(x / scale), -127, 127)   (q = 0 when scale = 0)
// One warp per group; lane l holds elements 4l .. 4l+3 of it.
// grid (ceil(K / 128 / QUANT_WARPS)), block (QUANT_WARPS * 32)
// ------------------------------------------------------------------------------------------
constexpr int QUANT_WARPS = 4;

template <int K>
__device__ __forceinline__ void quantize_activations_int8(const uint2* x,  // fp16 [K], 4 per uint2
                                                          unsigned int* __restrict__ xq,  // int8 [K], pair order
                                                          float* __restrict__ xscale) {   // [K/128]
  static_assert(K % NQ_GROUP_SIZE == 0 && NQ_GROUP_SIZE == 4 * WARP_SIZE, "one warp per group, 4 per lane");
  let_next_kernel_launch();
  wait_for_previous_kernel();  // before the early exit: x is the kernel before's output
  const int lane = threadIdx.x % WARP_SIZE;
  const int group = blockIdx.x * QUANT_WARPS + threadIdx.x / WARP_SIZE;
  if (group >= K / NQ_GROUP_SIZE) return;  // a whole warp leaves together: its shuffles stay full

  const uint2 raw = x[group * WARP_SIZE + lane];
  const float v[4] = {half_to_float(raw.x & 0xFFFFu), half_to_float(raw.x >> 16),
                      half_to_float(raw.y & 0xFFFFu), half_to_float(raw.y >> 16)};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  // Non-negative floats order like their bit patterns read as unsigned integers, so the
  // warp's integer max-reduction (one redux.sync) finds the largest magnitude.
  amax = __uint_as_float(__reduce_max_sync(FULL_MASK, __float_as_uint(amax)));
  const float scale = __fdiv_rn(amax, 127.0f);

  unsigned int mine = 0;  // this lane's four int8, in element order
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    int q = 0;
    if (scale > 0.0f) q = max(-127, min(127, __float2int_rn(__fdiv_rn(v[i], scale))));
    mine |= (static_cast<unsigned int>(q) & 0xFFu) << (8 * i);
  }
  // An even lane holds x0..x3 of its chunk of eight, the odd lane beside it x4..x7.
  // __byte_perm(a, b, s) picks result byte i from the eight bytes {b:a} by nibble i of s.
  const unsigned int partner = __shfl_xor_sync(FULL_MASK, mine, 1);
  xq[group * WARP_SIZE + lane] = (lane & 1) ? __byte_perm(partner, mine, 0x7362)   // x2 x6 x3 x7
                                            : __byte_perm(mine, partner, 0x5140);  // x0 x4 x1 x5
  if (lane == 0) xscale[group] = scale;
}

// ------------------------------------------------------------------------------------------
// Kernel 2: INT4 x INT8 GEMV.
// A row is read by 16 lanes (half a warp). At each step a lane loads one 16-byte chunk of
// the row (4 words = 32 elements), so the half warp covers 512 contiguous elements, four
// groups, and each group belongs to a quad of lanes: lanes 4s..4s+3 own "slot" s.
// The quad adds its int32 partials with two xor-shuffles, so every group's dot product is a
// whole int32 before any float touches it; all four lanes of the quad then add the same
// fp32 term to their slot sum. Slot s thus sums groups s, s+4, s+8, ... in that order, and
// the row's result is (slot0 + slot1) + (slot2 + slot3). int4_int8_linear follows this order.
// grid (ceil(N / ROWS_PER_BLOCK)), block (GEMV_THREADS)
// ------------------------------------------------------------------------------------------
constexpr int LANES_PER_ROW = 16;
constexpr int GEMV_THREADS = 128;
constexpr int ROWS_PER_BLOCK = GEMV_THREADS / LANES_PER_ROW;
constexpr int ELEMENTS_PER_CHUNK = 32;                                // one uint4 of packed weights
constexpr int CHUNKS_PER_GROUP = NQ_GROUP_SIZE / ELEMENTS_PER_CHUNK;  // lanes per quad
constexpr int LOAD_BATCH = 8;  // chunks a lane has in flight before it starts multiplying
static_assert(CHUNKS_PER_GROUP == 4 && LANES_PER_ROW / CHUNKS_PER_GROUP == 4,
              "int4_int8_linear assumes 4 lanes per group and 4 slots per row");

constexpr unsigned int SIGN_FLIP = 0x80808080u;

// (w & 0xF0F0F0F0) ^ 0x80808080 in one lop3. Written in C++, ptxas emits two LOP3s (an
// instruction holds only one immediate); with the flip constant in a register it is one.
__device__ __forceinline__ int high_nibbles_to_signed_bytes(unsigned int w) {
  unsigned int r;
  asm("lop3.b32 %0, %1, 0xF0F0F0F0, %2, 0x6A;" : "=r"(r) : "r"(w), "r"(SIGN_FLIP));
  return static_cast<int>(r);
}

// 16 * (dot of the word's eight INT4 weights with their eight INT8 activations).
__device__ __forceinline__ int dot_word(unsigned int w, unsigned int act_lo, unsigned int act_hi, int acc) {
  const int lo = high_nibbles_to_signed_bytes(w << 4);  // 16*(q0, q4, q1, q5)
  const int hi = high_nibbles_to_signed_bytes(w);       // 16*(q2, q6, q3, q7)
  return __dp4a(hi, static_cast<int>(act_hi), __dp4a(lo, static_cast<int>(act_lo), acc));
}

template <int K>
__device__ __forceinline__ void gemv_int4_int8(const uint4* __restrict__ qweight,          // [N, K/32] chunks
                                               const unsigned short* __restrict__ wscale,  // fp16 [N, K/128]
                                               const uint4* xq,                    // int8 [K] pair order
                                               const float* xscale,                // [K/128]
                                               const unsigned short* __restrict__ bias,  // fp16 [N] or null
                                               float* __restrict__ y, int rows) {  // [N]
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  constexpr int CHUNKS_PER_ROW = K / ELEMENTS_PER_CHUNK;
  constexpr int STEPS = (CHUNKS_PER_ROW + LANES_PER_ROW - 1) / LANES_PER_ROW;
  static_assert(K % NQ_GROUP_SIZE == 0, "K must be a multiple of the group size");

  let_next_kernel_launch();
  // xq and xscale are the quantize kernel's output. (A first batch of weights loaded before
  // this wait would stay in flight across it only as ld.global, not as ld.global.nc: ptxas
  // moves non-coherent loads freely across griddepcontrol.wait, and here moved the wait up.)
  wait_for_previous_kernel();
  const int lane = threadIdx.x % LANES_PER_ROW;
  const int wanted_row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / LANES_PER_ROW;
  // Lanes past the last row work on a copy of it and store nothing, so that every lane of
  // the warp reaches the full-warp shuffles.
  const int row = min(wanted_row, rows - 1);
  // This lane's first chunk, activations and scales; step s adds constant offsets (16
  // chunks, 512 activation bytes, 4 groups), which fold into the loads' address fields.
  const uint4* my_chunks = qweight + static_cast<long long>(row) * CHUNKS_PER_ROW + lane;
  const uint4* my_act = xq + 2 * lane;
  const unsigned short* my_wscale = wscale + static_cast<long long>(row) * GROUPS + lane / CHUNKS_PER_GROUP;
  const float* my_xscale = xscale + lane / CHUNKS_PER_GROUP;

  float slot_sum = 0.0f;
#pragma unroll
  for (int first = 0; first < STEPS; first += LOAD_BATCH) {
    uint4 w[LOAD_BATCH];
#pragma unroll
    for (int b = 0; b < LOAD_BATCH; ++b) {
      const int step = first + b;
      if (step < STEPS && lane + LANES_PER_ROW * step < CHUNKS_PER_ROW)
        w[b] = load_weights_16B(my_chunks + LANES_PER_ROW * step);
    }
#pragma unroll
    for (int b = 0; b < LOAD_BATCH; ++b) {
      const int step = first + b;
      if (step >= STEPS) break;
      int partial = 0;
      float scale = 0.0f;
      // Whole quads are in or out (K is a multiple of 128): a quad never mixes a real
      // group with padding.
      if (lane + LANES_PER_ROW * step < CHUNKS_PER_ROW) {
        const uint4 a0 = my_act[2 * LANES_PER_ROW * step];
        const uint4 a1 = my_act[2 * LANES_PER_ROW * step + 1];
        partial = dot_word(w[b].x, a0.x, a0.y, partial);
        partial = dot_word(w[b].y, a0.z, a0.w, partial);
        partial = dot_word(w[b].z, a1.x, a1.y, partial);
        partial = dot_word(w[b].w, a1.z, a1.w, partial);
        const int group_step = (LANES_PER_ROW / CHUNKS_PER_GROUP) * step;
        scale = __fmul_rn(half_to_float(__ldg(my_wscale + group_step)), my_xscale[group_step]);
      }
      partial += __shfl_xor_sync(FULL_MASK, partial, 1);
      partial += __shfl_xor_sync(FULL_MASK, partial, 2);
      slot_sum = __fadd_rn(slot_sum, __fmul_rn(__int2float_rn(partial >> 4), scale));
    }
  }
  float row_sum = __fadd_rn(slot_sum, __shfl_xor_sync(FULL_MASK, slot_sum, 4));  // s0+s1, s2+s3
  row_sum = __fadd_rn(row_sum, __shfl_xor_sync(FULL_MASK, row_sum, 8));         // (s0+s1)+(s2+s3)
  if (lane == 0 && wanted_row < rows) {
    if (bias != nullptr) row_sum = __fadd_rn(row_sum, half_to_float(bias[row]));
    y[row] = row_sum;
  }
}

}  // namespace int8_path

// Entry points, one per input width of the model (the names nanoqwen/cuda/int8.py looks up).
// x, xq and xscale are earlier kernels' output, read with ordinary loads: no __restrict__ on
// their pointers and no __ldg, see nanoqwen/cuda/launch.py ("the read-only path").
#define NQ_INT8_PATH_KERNELS(SUFFIX, K)                                                                 \
  extern "C" __global__ void __launch_bounds__(int8_path::QUANT_WARPS * WARP_SIZE)                     \
      quantize_activations_int8_##SUFFIX(const uint2* x, unsigned int* __restrict__ xq,                 \
                                         float* __restrict__ xscale) {                                  \
    int8_path::quantize_activations_int8<K>(x, xq, xscale);                                             \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(int8_path::GEMV_THREADS)                                 \
      gemv_int4_int8_##SUFFIX(const uint4* __restrict__ qweight, const unsigned short* __restrict__ wscale, \
                              const uint4* xq, const float* xscale,                                     \
                              const unsigned short* __restrict__ bias, float* __restrict__ y, int rows) { \
    int8_path::gemv_int4_int8<K>(qweight, wscale, xq, xscale, bias, y, rows);                           \
  }

NQ_INT8_PATH_KERNELS(hidden, NQ_HIDDEN)
NQ_INT8_PATH_KERNELS(q_dim, NQ_Q_DIM)
NQ_INT8_PATH_KERNELS(intermediate, NQ_INTERMEDIATE)
