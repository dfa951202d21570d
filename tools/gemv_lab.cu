// gemv_lab.cu: candidate INT4 GEMV structures, timed against the engine's by tools/gemv_lab.py.
// Same math as kernels/gemv_int4.cu (lop3 unpack, mma.m16n8k16, fp32 group sums scaled per
// row); what differs is how the weights reach the registers and how many warps share a tile.
//
// "reg": no shared-memory ring. Each warp streams its rows straight into registers, DEPTH groups
// ahead, and a block of SLICES warps splits one 16-row tile's input groups between them, adding
// the slices in shared memory at the end (fixed order: deterministic). More warps per tile means
// more loads in flight per SM without more partial sums in global memory.
#include "gemv_int4.cu"

#ifndef NQ_LAB_DEPTH
#define NQ_LAB_DEPTH 4
#endif
constexpr int LAB_DEPTH = NQ_LAB_DEPTH;
#ifndef NQ_LAB_MAX_THREADS
#define NQ_LAB_MAX_THREADS 512
#endif
#ifndef NQ_LAB_MIN_BLOCKS
#define NQ_LAB_MIN_BLOCKS 1
#endif
constexpr int LAB_MAX_WARPS = NQ_LAB_MAX_THREADS / 32;

// Lane (g, t) of a warp: rows row0 = g, row1 = g + 8 of its tile; in each group it reads the
// t-th 16-byte chunk of both rows. Returns the two rows' dot products over [group_begin, group_end).
template <int K>
__device__ __forceinline__ void lab_tile_dot(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                                             const unsigned short* __restrict__ x, int row0, int row1,
                                             int group_begin, int group_end, float& acc0, float& acc1) {
  constexpr int CHUNKS_PER_ROW = K / 32;
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE, t = lane % 4;
  const uint4* w_row0 = qweight + (long long)row0 * CHUNKS_PER_ROW + t;
  const uint4* w_row1 = qweight + (long long)row1 * CHUNKS_PER_ROW + t;
  const unsigned short* s_row0 = scales + (long long)row0 * GROUPS;
  const unsigned short* s_row1 = scales + (long long)row1 * GROUPS;
  const int count = group_end - group_begin;
  uint4 ring0[LAB_DEPTH], ring1[LAB_DEPTH];
  unsigned short sring0[LAB_DEPTH], sring1[LAB_DEPTH];
#pragma unroll
  for (int u = 0; u < LAB_DEPTH; ++u) {
    if (u < count) {
      const int group = group_begin + u;
      ring0[u] = load_weights_16B(w_row0 + 4 * group);
      ring1[u] = load_weights_16B(w_row1 + 4 * group);
      sring0[u] = __ldg(s_row0 + group);
      sring1[u] = __ldg(s_row1 + group);
    }
  }
  wait_for_previous_kernel();  // x is the previous kernel's output; the weights above are not
  for (int first = 0; first < count; first += LAB_DEPTH) {
#pragma unroll
    for (int u = 0; u < LAB_DEPTH; ++u) {
      const int i = first + u;
      if (i < count) {  // warp-uniform
        const uint4 w0 = ring0[u], w1 = ring1[u];
        const float scale0 = half_to_float(sring0[u]), scale1 = half_to_float(sring1[u]);
        if (i + LAB_DEPTH < count) {
          const int group = group_begin + i + LAB_DEPTH;
          ring0[u] = load_weights_16B(w_row0 + 4 * group);
          ring1[u] = load_weights_16B(w_row1 + 4 * group);
          sring0[u] = __ldg(s_row0 + group);
          sring1[u] = __ldg(s_row1 + group);
        }
        const unsigned short* xg = x + (group_begin + i) * NQ_GROUP_SIZE + 32 * t;
        uint4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = load_activations_16B(xg + 8 * j);
        const unsigned int xs[4][4] = {{xv[0].x, xv[0].y, xv[0].z, xv[0].w},
                                       {xv[1].x, xv[1].y, xv[1].z, xv[1].w},
                                       {xv[2].x, xv[2].y, xv[2].z, xv[2].w},
                                       {xv[3].x, xv[3].y, xv[3].z, xv[3].w}};
        const unsigned int words0[4] = {w0.x, w0.y, w0.z, w0.w}, words1[4] = {w1.x, w1.y, w1.z, w1.w};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          unsigned int p0[4], p1[4];
          unpack_int4_word(words0[j], p0);
          unpack_int4_word(words1[j], p1);
          mma_16x8x16(d, p0[0], p1[0], p0[1], p1[1], xs[j][0], xs[j][1]);
          mma_16x8x16(d, p0[2], p1[2], p0[3], p1[3], xs[j][2], xs[j][3]);
        }
        acc0 = fmaf(scale0, d[0], acc0);
        acc1 = fmaf(scale1, d[2], acc1);
      }
    }
  }
}

// Block (tile, split): SLICES = blockDim.x / 32 warps divide the split's groups; partials[split][row].
template <int K>
__device__ __forceinline__ void lab_partials(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                                             const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                                             float* __restrict__ partials, int n_rows, int splits) {
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  __shared__ float slice_sums[LAB_MAX_WARPS][TILE_ROWS];
  let_next_kernel_launch();
  const int slices = blockDim.x / WARP_SIZE, warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int tile = blockIdx.x / splits, split = blockIdx.x % splits;
  const int split_begin = split * GROUPS / splits, split_end = (split + 1) * GROUPS / splits;
  const int begin = split_begin + warp * (split_end - split_begin) / slices;
  const int end = split_begin + (warp + 1) * (split_end - split_begin) / slices;
  const int row0 = tile * TILE_ROWS + lane / 4, row1 = row0 + 8;
  float acc0 = 0.0f, acc1 = 0.0f;
  lab_tile_dot<K>(qweight, scales, x, min(row0, n_rows - 1), min(row1, n_rows - 1), begin, end, acc0, acc1);
  if (lane % 4 == 0) {
    slice_sums[warp][lane / 4] = acc0;
    slice_sums[warp][lane / 4 + 8] = acc1;
  }
  __syncthreads();
  if (threadIdx.x < TILE_ROWS) {
    const int row = tile * TILE_ROWS + threadIdx.x;
    float sum = 0.0f;
    for (int w = 0; w < slices; ++w) sum += slice_sums[w][threadIdx.x];
    if (row < n_rows) {
      if (bias != nullptr && split == 0) sum += half_to_float(bias[row]);
      partials[(long long)split * n_rows + row] = sum;
    }
  }
}

extern "C" __global__ void __launch_bounds__(NQ_LAB_MAX_THREADS, NQ_LAB_MIN_BLOCKS)
lab_from_hidden(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                float* __restrict__ partials, int n_rows, int splits) {
  lab_partials<NQ_HIDDEN>(qweight, scales, bias, x, partials, n_rows, splits);
}

extern "C" __global__ void __launch_bounds__(NQ_LAB_MAX_THREADS, NQ_LAB_MIN_BLOCKS)
lab_from_q_dim(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
               const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
               float* __restrict__ partials, int n_rows, int splits) {
  lab_partials<NQ_Q_DIM>(qweight, scales, bias, x, partials, n_rows, splits);
}

extern "C" __global__ void __launch_bounds__(NQ_LAB_MAX_THREADS, NQ_LAB_MIN_BLOCKS)
lab_from_intermediate(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                      const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                      float* __restrict__ partials, int n_rows, int splits) {
  lab_partials<NQ_INTERMEDIATE>(qweight, scales, bias, x, partials, n_rows, splits);
}

// gate+up with SwiGLU: block = 2 * SLICES warps on one 16-row tile; warps [0, SLICES) take the
// gate rows, [SLICES, 2 SLICES) the up rows, each a slice of the 28 groups.
extern "C" __global__ void __launch_bounds__(NQ_LAB_MAX_THREADS, NQ_LAB_MIN_BLOCKS)
lab_gate_up_silu(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                 const unsigned short* __restrict__ x, unsigned short* __restrict__ h) {
  constexpr int GROUPS = NQ_HIDDEN / NQ_GROUP_SIZE;
  __shared__ float slice_sums[LAB_MAX_WARPS][TILE_ROWS];
  let_next_kernel_launch();
  const int slices = blockDim.x / WARP_SIZE / 2, warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int half = warp / slices, slice = warp % slices;
  const int tile = blockIdx.x;
  const int row0 = min(tile * TILE_ROWS + lane / 4, NQ_INTERMEDIATE - 1);
  const int row1 = min(tile * TILE_ROWS + lane / 4 + 8, NQ_INTERMEDIATE - 1);
  const int offset = half * NQ_INTERMEDIATE;
  float acc0 = 0.0f, acc1 = 0.0f;
  lab_tile_dot<NQ_HIDDEN>(qweight, scales, x, offset + row0, offset + row1, slice * GROUPS / slices,
                          (slice + 1) * GROUPS / slices, acc0, acc1);
  if (lane % 4 == 0) {
    slice_sums[warp][lane / 4] = acc0;
    slice_sums[warp][lane / 4 + 8] = acc1;
  }
  __syncthreads();
  if (threadIdx.x < TILE_ROWS) {
    const int row = tile * TILE_ROWS + threadIdx.x;
    float gate = 0.0f, up = 0.0f;
    for (int w = 0; w < slices; ++w) {
      gate += slice_sums[w][threadIdx.x];
      up += slice_sums[slices + w][threadIdx.x];
    }
    if (row < NQ_INTERMEDIATE) h[row] = float_to_half(gate / (1.0f + expf(-gate)) * up);
  }
}

// ------------------------------------------------------------------------------------------
// "lite": the engine's cp.async ring and one warp per (tile, split), with a cheaper unpack.
// Two lop3 per nibble pair and no subtraction: (w & 0x000F000F) | 0x64006400 is the fp16 pair
// 1024 + n, (w & 0x00F000F0) | 0x64006400 is 1024 + 16 n, and w >> 8 gives the other two
// pairs: 1 shift + 4 lop3 per word instead of 3 shifts + 4 lop3 + 4 subtractions. The MMAs then
// multiply x by 1024 + n (low nibbles, accumulator lo) and 1024 + 16 n (high nibbles, hi), and
// the group's sum over q = n - 8 is  lo + hi / 16 - (1032 X_lo + 72 X_hi),  where X_lo, X_hi
// sum x over the low- and high-nibble elements. That correction does not depend on the row: two
// MMAs per word with constant A (1032, 72) compute it once per group for the whole warp.
// NQ_LAB_LITE = 0 keeps the engine's unpack but still splits the MMA chain in two accumulators.
#ifndef NQ_LAB_LITE
#define NQ_LAB_LITE 1
#endif

template <int K, int TILES, int STAGES>
__device__ __forceinline__ void lite_tile_dot(const unsigned int* __restrict__ qweight,
                                              const unsigned short* __restrict__ scales,
                                              const unsigned short* __restrict__ x, const int (&rows)[TILES][2],
                                              int group_begin, int group_end, float (&acc)[TILES][2]) {
  constexpr int WORDS_PER_ROW = K / 8;
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  __shared__ uint4 ring[STAGES][TILES][2][WARP_SIZE];
  const int lane = threadIdx.x % WARP_SIZE, t = lane % 4;
  const int count = group_end - group_begin;
  float scale_ring[STAGES][TILES][2];
#define NQ_LITE_FETCH(i, SLOT)                                                                            \
  do {                                                                                                    \
    const int group = group_begin + (i);                                                                  \
    _Pragma("unroll") for (int tile = 0; tile < TILES; ++tile) {                                          \
      _Pragma("unroll") for (int r = 0; r < 2; ++r) {                                                     \
        const long long row = rows[tile][r];                                                              \
        copy_async_16B(&ring[SLOT][tile][r][lane], qweight + row * WORDS_PER_ROW + group * WORDS_PER_GROUP + 4 * t); \
        scale_ring[SLOT][tile][r] = half_to_float(__ldg(scales + row * GROUPS + group));                  \
      }                                                                                                   \
    }                                                                                                     \
  } while (0)
#pragma unroll
  for (int u = 0; u < STAGES - 1; ++u) {
    if (u < count) NQ_LITE_FETCH(u, u);
    copy_async_commit();
  }
  wait_for_previous_kernel();
  for (int first = 0; first < count; first += STAGES) {
#pragma unroll
    for (int u = 0; u < STAGES; ++u) {
      const int i = first + u;
      if (i + STAGES - 1 < count) NQ_LITE_FETCH(i + STAGES - 1, (u + STAGES - 1) % STAGES);
      copy_async_commit();
      copy_async_wait<STAGES - 1>();
      if (i < count) {
        const unsigned short* xg = x + (group_begin + i) * NQ_GROUP_SIZE + 32 * t;
        uint4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = load_activations_16B(xg + 8 * j);
        const unsigned int xs[4][4] = {{xv[0].x, xv[0].y, xv[0].z, xv[0].w},
                                       {xv[1].x, xv[1].y, xv[1].z, xv[1].w},
                                       {xv[2].x, xv[2].y, xv[2].z, xv[2].w},
                                       {xv[3].x, xv[3].y, xv[3].z, xv[3].w}};
#if NQ_LAB_LITE
        float corr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          mma_16x8x16(corr, 0x64086408u, 0x64086408u, 0x64086408u, 0x64086408u, xs[j][0], xs[j][2]);
          mma_16x8x16(corr, 0x54805480u, 0x54805480u, 0x54805480u, 0x54805480u, xs[j][1], xs[j][3]);
        }
#endif
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
          const uint4 w0 = ring[u][tile][0][lane], w1 = ring[u][tile][1][lane];
          const unsigned int words0[4] = {w0.x, w0.y, w0.z, w0.w}, words1[4] = {w1.x, w1.y, w1.z, w1.w};
          float lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#if NQ_LAB_LITE
            const unsigned int a = words0[j], b = words1[j], a8 = a >> 8, b8 = b >> 8;
            mma_16x8x16(lo, and_or(a, 0x000F000Fu, 0x64006400u), and_or(b, 0x000F000Fu, 0x64006400u),
                        and_or(a8, 0x000F000Fu, 0x64006400u), and_or(b8, 0x000F000Fu, 0x64006400u), xs[j][0], xs[j][2]);
            mma_16x8x16(hi, and_or(a, 0x00F000F0u, 0x64006400u), and_or(b, 0x00F000F0u, 0x64006400u),
                        and_or(a8, 0x00F000F0u, 0x64006400u), and_or(b8, 0x00F000F0u, 0x64006400u), xs[j][1], xs[j][3]);
#else
            unsigned int p0[4], p1[4];
            unpack_int4_word(words0[j], p0);
            unpack_int4_word(words1[j], p1);
            mma_16x8x16(lo, p0[0], p1[0], p0[1], p1[1], xs[j][0], xs[j][1]);
            mma_16x8x16(hi, p0[2], p1[2], p0[3], p1[3], xs[j][2], xs[j][3]);
#endif
          }
#if NQ_LAB_LITE
          const float sum0 = fmaf(0.0625f, hi[0], lo[0]) - corr[0], sum1 = fmaf(0.0625f, hi[2], lo[2]) - corr[2];
#else
          const float sum0 = lo[0] + hi[0], sum1 = lo[2] + hi[2];
#endif
          acc[tile][0] = fmaf(scale_ring[u][tile][0], sum0, acc[tile][0]);
          acc[tile][1] = fmaf(scale_ring[u][tile][1], sum1, acc[tile][1]);
        }
      }
    }
  }
#undef NQ_LITE_FETCH
}

template <int K>
__device__ __forceinline__ void lite_partials(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                                              const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                                              float* __restrict__ partials, int n_rows, int splits) {
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  let_next_kernel_launch();
  const int unit = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
  const int tiles = (n_rows + TILE_ROWS - 1) / TILE_ROWS;
  const int tile = min(unit / splits, tiles - 1), split = unit % splits;
  const int lane = threadIdx.x % WARP_SIZE;
  const int row0 = tile * TILE_ROWS + lane / 4, row1 = row0 + 8;
  const int rows[1][2] = {{min(row0, n_rows - 1), min(row1, n_rows - 1)}};
  float acc[1][2] = {{0.0f, 0.0f}};
  lite_tile_dot<K, 1, GEMV_STAGES>(qweight, scales, x, rows, split * GROUPS / splits, (split + 1) * GROUPS / splits, acc);
  if (lane % 4 == 0 && unit < tiles * splits) {
    float* out = partials + (long long)split * n_rows;
    const bool add_bias = bias != nullptr && split == 0;
    if (row0 < n_rows) out[row0] = acc[0][0] + (add_bias ? half_to_float(bias[row0]) : 0.0f);
    if (row1 < n_rows) out[row1] = acc[0][1] + (add_bias ? half_to_float(bias[row1]) : 0.0f);
  }
}

extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 16)
lite_from_hidden(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                 const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                 float* __restrict__ partials, int n_rows, int splits) {
  lite_partials<NQ_HIDDEN>(qweight, scales, bias, x, partials, n_rows, splits);
}

extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 16)
lite_from_q_dim(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                float* __restrict__ partials, int n_rows, int splits) {
  lite_partials<NQ_Q_DIM>(qweight, scales, bias, x, partials, n_rows, splits);
}

extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 16)
lite_from_intermediate(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                       const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                       float* __restrict__ partials, int n_rows, int splits) {
  lite_partials<NQ_INTERMEDIATE>(qweight, scales, bias, x, partials, n_rows, splits);
}

// gate+up: TILES = 2 (gate and up rows of the same 16-row tile) in one warp, as in the engine.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 12)
lite_gate_up_silu(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                  const unsigned short* __restrict__ x, unsigned short* __restrict__ h) {
  constexpr int GROUPS = NQ_HIDDEN / NQ_GROUP_SIZE;
  constexpr int TILES = (NQ_INTERMEDIATE + TILE_ROWS - 1) / TILE_ROWS;
  let_next_kernel_launch();
  const int tile = min((int)(blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE), TILES - 1);
  const int lane = threadIdx.x % WARP_SIZE;
  const int row0 = tile * TILE_ROWS + lane / 4, row1 = row0 + 8;
  const int gate0 = min(row0, NQ_INTERMEDIATE - 1), gate1 = min(row1, NQ_INTERMEDIATE - 1);
  const int rows[2][2] = {{gate0, gate1}, {NQ_INTERMEDIATE + gate0, NQ_INTERMEDIATE + gate1}};
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  lite_tile_dot<NQ_HIDDEN, 2, GEMV_STAGES>(qweight, scales, x, rows, 0, GROUPS, acc);
  if (lane % 4 == 0) {
    if (row0 < NQ_INTERMEDIATE) h[row0] = float_to_half(acc[0][0] / (1.0f + expf(-acc[0][0])) * acc[1][0]);
    if (row1 < NQ_INTERMEDIATE) h[row1] = float_to_half(acc[0][1] / (1.0f + expf(-acc[0][1])) * acc[1][1]);
  }
}

// ------------------------------------------------------------------------------------------
// "coal": every load instruction of a warp reads 512 contiguous bytes of ONE row.
// A warp works on a pair of rows (r0, r1) in steps of 8 groups. Lane (g, t) loads the t-th
// 16-byte chunk of group 8 s + g of both rows, so the warp's 32 chunks of a row are adjacent.
// The MMA still multiplies a 16x16 A by a 16x8 B, but with a different reading: A's row g is
// r0's group g (and row g + 8 is r1's), B's column n is x over group n, so the diagonal
// D[g][g] (and D[g + 8][g]) is exactly group g's dot product for r0 (r1); the off-diagonal
// products are discarded. Lane (g, t) supplies both A's and B's k-slots from its own chunk,
// which is the consistency the MMA needs. D[g][g] lives in lane (g, g / 2), register g % 2
// (D[g + 8][g] in register 2 + g % 2).
// ------------------------------------------------------------------------------------------
constexpr int GROUPS_PER_STEP = 8;
#ifndef NQ_COAL_DEPTH
#define NQ_COAL_DEPTH 4
#endif
constexpr int COAL_DEPTH = NQ_COAL_DEPTH;

// The same load as load_weights_16B, but volatile: the compiler must issue the loads in program
// order with the other volatile statements, so a batch written before the arithmetic stays in
// flight together instead of being sunk next to its first use (which a register-thrifty
// schedule otherwise does, leaving two loads in flight per warp).
__device__ __forceinline__ uint4 load_weights_16B_now(const void* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}
__device__ __forceinline__ unsigned short load_scale_now(const unsigned short* address) {
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(address));
  return v;
}

// Dot products of rows r0 and r1 with x over groups [group_begin, group_end); every lane returns
// both totals.
template <int K>
__device__ __forceinline__ float2 coal_pair_dot(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                                                const unsigned short* __restrict__ x, int r0, int r1,
                                                int group_begin, int group_end) {
  constexpr int CHUNKS_PER_ROW = K / 32;
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
  const bool holder = t == g / 2;
  const uint4* w0 = qweight + (long long)r0 * CHUNKS_PER_ROW + 4 * group_begin + lane;
  const uint4* w1 = qweight + (long long)r1 * CHUNKS_PER_ROW + 4 * group_begin + lane;
  const unsigned short* s0 = scales + (long long)r0 * GROUPS + group_begin + g;
  const unsigned short* s1 = scales + (long long)r1 * GROUPS + group_begin + g;
  const int steps = (group_end - group_begin + GROUPS_PER_STEP - 1) / GROUPS_PER_STEP;
  uint4 ring0[COAL_DEPTH], ring1[COAL_DEPTH];
  unsigned short sring0[COAL_DEPTH], sring1[COAL_DEPTH];
  const uint4 zero = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);  // q = 0
#pragma unroll
  for (int u = 0; u < COAL_DEPTH; ++u) {
    const bool live = u < steps && group_begin + GROUPS_PER_STEP * u + g < group_end;
    ring0[u] = live ? load_weights_16B_now(w0 + 32 * u) : zero;
    ring1[u] = live ? load_weights_16B_now(w1 + 32 * u) : zero;
    sring0[u] = live ? load_scale_now(s0 + GROUPS_PER_STEP * u) : (unsigned short)0;
    sring1[u] = live ? load_scale_now(s1 + GROUPS_PER_STEP * u) : (unsigned short)0;
  }
  wait_for_previous_kernel();
  float acc0 = 0.0f, acc1 = 0.0f;
  for (int first = 0; first < steps; first += COAL_DEPTH) {
#pragma unroll
    for (int u = 0; u < COAL_DEPTH; ++u) {
      const int step = first + u;
      if (step < steps) {  // warp-uniform
        const uint4 a = ring0[u], b = ring1[u];
        const float scale0 = half_to_float(sring0[u]), scale1 = half_to_float(sring1[u]);
        const int group = group_begin + GROUPS_PER_STEP * step + g;
        const bool live = group < group_end;
        const int next = step + COAL_DEPTH;
        const bool next_live = next < steps && group + GROUPS_PER_STEP * COAL_DEPTH < group_end;
        ring0[u] = next_live ? load_weights_16B_now(w0 + 32 * next) : zero;
        ring1[u] = next_live ? load_weights_16B_now(w1 + 32 * next) : zero;
        sring0[u] = next_live ? load_scale_now(s0 + GROUPS_PER_STEP * next) : (unsigned short)0;
        sring1[u] = next_live ? load_scale_now(s1 + GROUPS_PER_STEP * next) : (unsigned short)0;
        uint4 xv[4];
        const unsigned short* xg = x + min(group, GROUPS - 1) * NQ_GROUP_SIZE + 32 * t;
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = live ? load_activations_16B(xg + 8 * j) : make_uint4(0, 0, 0, 0);
        const unsigned int xs[4][4] = {{xv[0].x, xv[0].y, xv[0].z, xv[0].w},
                                       {xv[1].x, xv[1].y, xv[1].z, xv[1].w},
                                       {xv[2].x, xv[2].y, xv[2].z, xv[2].w},
                                       {xv[3].x, xv[3].y, xv[3].z, xv[3].w}};
        const unsigned int words0[4] = {a.x, a.y, a.z, a.w}, words1[4] = {b.x, b.y, b.z, b.w};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          unsigned int p0[4], p1[4];
          unpack_int4_word(words0[j], p0);
          unpack_int4_word(words1[j], p1);
          mma_16x8x16(d, p0[0], p1[0], p0[1], p1[1], xs[j][0], xs[j][1]);
          mma_16x8x16(d, p0[2], p1[2], p0[3], p1[3], xs[j][2], xs[j][3]);
        }
        acc0 = fmaf(scale0, (g & 1) ? d[1] : d[0], acc0);
        acc1 = fmaf(scale1, (g & 1) ? d[3] : d[2], acc1);
      }
    }
  }
  return make_float2(warp_sum(holder ? acc0 : 0.0f), warp_sum(holder ? acc1 : 0.0f));
}

// One warp per (row pair, split): rows 2p and 2p + 1. grid (ceil(pairs * splits / warps per block)).
template <int K>
__device__ __forceinline__ void coal_partials(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                                              const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                                              float* __restrict__ partials, int n_rows, int splits) {
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  let_next_kernel_launch();
  const int pairs = (n_rows + 1) / 2;
  const int unit = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
  const int pair = min(unit / splits, pairs - 1), split = unit % splits;
  const int r0 = 2 * pair, r1 = min(r0 + 1, n_rows - 1);
  const float2 sums = coal_pair_dot<K>(qweight, scales, x, r0, r1, split * GROUPS / splits, (split + 1) * GROUPS / splits);
  if (threadIdx.x % WARP_SIZE == 0 && unit < pairs * splits) {
    float* out = partials + (long long)split * n_rows;
    const bool add_bias = bias != nullptr && split == 0;
    out[r0] = sums.x + (add_bias ? half_to_float(bias[r0]) : 0.0f);
    if (r0 + 1 < n_rows) out[r0 + 1] = sums.y + (add_bias ? half_to_float(bias[r0 + 1]) : 0.0f);
  }
}

extern "C" __global__ void __launch_bounds__(128)
coal_from_hidden(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                 const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                 float* __restrict__ partials, int n_rows, int splits) {
  coal_partials<NQ_HIDDEN>(qweight, scales, bias, x, partials, n_rows, splits);
}

extern "C" __global__ void __launch_bounds__(128)
coal_from_q_dim(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                float* __restrict__ partials, int n_rows, int splits) {
  coal_partials<NQ_Q_DIM>(qweight, scales, bias, x, partials, n_rows, splits);
}

extern "C" __global__ void __launch_bounds__(128)
coal_from_intermediate(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                       const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                       float* __restrict__ partials, int n_rows, int splits) {
  coal_partials<NQ_INTERMEDIATE>(qweight, scales, bias, x, partials, n_rows, splits);
}

// gate+up: warp i takes gate row i and up row I + i as its pair. grid (ceil(I / warps per block)).
extern "C" __global__ void __launch_bounds__(128)
coal_gate_up_silu(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                  const unsigned short* __restrict__ x, unsigned short* __restrict__ h) {
  let_next_kernel_launch();
  const int unit = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
  const int row = min(unit, NQ_INTERMEDIATE - 1);
  const float2 sums = coal_pair_dot<NQ_HIDDEN>(qweight, scales, x, row, NQ_INTERMEDIATE + row, 0, NQ_HIDDEN / NQ_GROUP_SIZE);
  if (threadIdx.x % WARP_SIZE == 0 && unit < NQ_INTERMEDIATE)
    h[row] = float_to_half(sums.x / (1.0f + expf(-sums.x)) * sums.y);
}

// ------------------------------------------------------------------------------------------
// "coalring": the coal layout (512 contiguous bytes of one row per warp load) with the weights
// travelling by cp.async into a shared-memory ring, STAGES - 1 steps ahead. ptxas sinks plain
// loads next to their first use when registers are tight (the SASS of coal_gate_up_silu has
// two weight loads in flight per warp, not eight); an asynchronous copy cannot be sunk that
// way, and the bytes in flight cost no registers.
// ------------------------------------------------------------------------------------------
#ifndef NQ_COALRING_STAGES
#define NQ_COALRING_STAGES 5
#endif
constexpr int COALRING_STAGES = NQ_COALRING_STAGES;
constexpr int COALRING_WARPS = 4;  // warps per block

template <int K>
__device__ __forceinline__ float2 coalring_pair_dot(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                                                    const unsigned short* __restrict__ x, int r0, int r1,
                                                    int group_begin, int group_end) {
  constexpr int CHUNKS_PER_ROW = K / 32;
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  constexpr int STAGES = COALRING_STAGES;
  __shared__ uint4 ring_all[COALRING_WARPS][STAGES][2][WARP_SIZE];
  uint4 (&ring)[STAGES][2][WARP_SIZE] = ring_all[threadIdx.x / WARP_SIZE];
  const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
  const bool holder = t == g / 2;
  const uint4* w0 = qweight + (long long)r0 * CHUNKS_PER_ROW + 4 * group_begin + lane;
  const uint4* w1 = qweight + (long long)r1 * CHUNKS_PER_ROW + 4 * group_begin + lane;
  const unsigned short* s0 = scales + (long long)r0 * GROUPS + group_begin + g;
  const unsigned short* s1 = scales + (long long)r1 * GROUPS + group_begin + g;
  const int steps = (group_end - group_begin + GROUPS_PER_STEP - 1) / GROUPS_PER_STEP;
  const int live_steps_of_lane = (group_end - group_begin - g + GROUPS_PER_STEP - 1) / GROUPS_PER_STEP;  // steps where this lane's group exists
  unsigned short scale_ring[STAGES][2];  // raw fp16: converting at fetch would wait for the load
#define NQ_COALRING_FETCH(STEP, SLOT)                                  \
  do {                                                                 \
    if ((STEP) < live_steps_of_lane) {                                 \
      copy_async_16B(&ring[SLOT][0][lane], w0 + 32 * (STEP));          \
      copy_async_16B(&ring[SLOT][1][lane], w1 + 32 * (STEP));          \
      scale_ring[SLOT][0] = __ldg(s0 + GROUPS_PER_STEP * (STEP));                 \
      scale_ring[SLOT][1] = __ldg(s1 + GROUPS_PER_STEP * (STEP));                 \
    }                                                                  \
  } while (0)
#pragma unroll
  for (int u = 0; u < STAGES - 1; ++u) {
    NQ_COALRING_FETCH(u, u);
    copy_async_commit();
  }
  wait_for_previous_kernel();
  float acc0 = 0.0f, acc1 = 0.0f;
  for (int first = 0; first < steps; first += STAGES) {
#pragma unroll
    for (int u = 0; u < STAGES; ++u) {
      const int step = first + u;
      NQ_COALRING_FETCH(step + STAGES - 1, (u + STAGES - 1) % STAGES);
      copy_async_commit();
      copy_async_wait<STAGES - 1>();
      if (step < steps) {  // warp-uniform
        const bool live = step < live_steps_of_lane;
        const int group = min(group_begin + GROUPS_PER_STEP * step + g, GROUPS - 1);
        const uint4 zero = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);  // q = 0
        const uint4 a = live ? ring[u][0][lane] : zero, b = live ? ring[u][1][lane] : zero;
        uint4 xv[4];
        const unsigned short* xg = x + group * NQ_GROUP_SIZE + 32 * t;
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = load_activations_16B(xg + 8 * j);
        const unsigned int xs[4][4] = {{xv[0].x, xv[0].y, xv[0].z, xv[0].w},
                                       {xv[1].x, xv[1].y, xv[1].z, xv[1].w},
                                       {xv[2].x, xv[2].y, xv[2].z, xv[2].w},
                                       {xv[3].x, xv[3].y, xv[3].z, xv[3].w}};
        const unsigned int words0[4] = {a.x, a.y, a.z, a.w}, words1[4] = {b.x, b.y, b.z, b.w};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          unsigned int p0[4], p1[4];
          unpack_int4_word(words0[j], p0);
          unpack_int4_word(words1[j], p1);
          mma_16x8x16(d, p0[0], p1[0], p0[1], p1[1], xs[j][0], xs[j][1]);
          mma_16x8x16(d, p0[2], p1[2], p0[3], p1[3], xs[j][2], xs[j][3]);
        }
        if (live) {
          acc0 = fmaf(half_to_float(scale_ring[u][0]), (g & 1) ? d[1] : d[0], acc0);
          acc1 = fmaf(half_to_float(scale_ring[u][1]), (g & 1) ? d[3] : d[2], acc1);
        }
      }
    }
  }
#undef NQ_COALRING_FETCH
  return make_float2(warp_sum(holder ? acc0 : 0.0f), warp_sum(holder ? acc1 : 0.0f));
}

template <int K>
__device__ __forceinline__ void coalring_partials(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                                                  const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,
                                                  float* __restrict__ partials, int n_rows, int splits) {
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  let_next_kernel_launch();
  const int pairs = (n_rows + 1) / 2;
  const int unit = blockIdx.x * COALRING_WARPS + threadIdx.x / WARP_SIZE;
  const int pair = min(unit / splits, pairs - 1), split = unit % splits;
  const int r0 = 2 * pair, r1 = min(r0 + 1, n_rows - 1);
  const float2 sums = coalring_pair_dot<K>(qweight, scales, x, r0, r1, split * GROUPS / splits, (split + 1) * GROUPS / splits);
  if (threadIdx.x % WARP_SIZE == 0 && unit < pairs * splits) {
    float* out = partials + (long long)split * n_rows;
    const bool add_bias = bias != nullptr && split == 0;
    out[r0] = sums.x + (add_bias ? half_to_float(bias[r0]) : 0.0f);
    if (r0 + 1 < n_rows) out[r0 + 1] = sums.y + (add_bias ? half_to_float(bias[r0 + 1]) : 0.0f);
  }
}

#define NQ_COALRING_PARTIALS(NAME, K)                                                                           \
  extern "C" __global__ void __launch_bounds__(COALRING_WARPS * WARP_SIZE)                                      \
      NAME(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,                       \
           const unsigned short* __restrict__ bias, const unsigned short* __restrict__ x,                      \
           float* __restrict__ partials, int n_rows, int splits) {                                              \
    coalring_partials<K>(qweight, scales, bias, x, partials, n_rows, splits);                                  \
  }
NQ_COALRING_PARTIALS(coalring_from_hidden, NQ_HIDDEN)
NQ_COALRING_PARTIALS(coalring_from_q_dim, NQ_Q_DIM)
NQ_COALRING_PARTIALS(coalring_from_intermediate, NQ_INTERMEDIATE)

extern "C" __global__ void __launch_bounds__(COALRING_WARPS * WARP_SIZE)
coalring_gate_up_silu(const uint4* __restrict__ qweight, const unsigned short* __restrict__ scales,
                      const unsigned short* __restrict__ x, unsigned short* __restrict__ h) {
  let_next_kernel_launch();
  const int unit = blockIdx.x * COALRING_WARPS + threadIdx.x / WARP_SIZE;
  const int row = min(unit, NQ_INTERMEDIATE - 1);
  const float2 sums = coalring_pair_dot<NQ_HIDDEN>(qweight, scales, x, row, NQ_INTERMEDIATE + row, 0, NQ_HIDDEN / NQ_GROUP_SIZE);
  if (threadIdx.x % WARP_SIZE == 0 && unit < NQ_INTERMEDIATE)
    h[row] = float_to_half(sums.x / (1.0f + expf(-sums.x)) * sums.y);
}
