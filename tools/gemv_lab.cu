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
