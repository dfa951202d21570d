// rmsnorm.cu: the residual update fused with the RMSNorm that follows it.
//
// Reference (nanoqwen/ops_numpy.py, add_rmsnorm):
//     residual = residual + delta                                  fp32 [T, H]
//     out      = residual / sqrt(mean(residual**2) + eps) * weight  fp32 math, fp16 [T, H]
//
// One block per token row; each thread owns RMS_ITEMS float4 of the row and keeps them in
// registers between the two passes, so the row is read once and written once.
//
// `delta` arrives as `num_partials` slices that are summed first: the decode GEMVs split
// their input dimension across warps and leave one fp32 partial sum per split (see
// gemv_int4.cu), and this kernel is where those partials meet. Prefill passes its single
// GEMM output (num_partials = 1); the first layer passes none (the residual is the embedding).
#include "common.cuh"

constexpr int RMS_VECTORS = NQ_HIDDEN / 4;                       // float4 per row
constexpr int RMS_THREADS = RMS_VECTORS < 1024 ? RMS_VECTORS : 1024;  // a multiple of 32
constexpr int RMS_ITEMS = (RMS_VECTORS + RMS_THREADS - 1) / RMS_THREADS;

// grid (T), block (RMS_THREADS)
//   residual  fp32 [T, H], updated in place
//   partials  fp32 [num_partials][T, H]: slice p of row t starts at p * partial_stride + t * H
//   weight    fp16 [H]
//   out       fp16 [T, H]
// What an earlier kernel of the step wrote is read with ordinary loads: no __restrict__ on its
// pointer and no __ldg, see nanoqwen/cuda_launch.py ("the read-only path").
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
add_rmsnorm(float* __restrict__ residual, const float* partials, int num_partials, int partial_stride,
            const unsigned short* __restrict__ weight, unsigned short* __restrict__ out) {
  __shared__ float scratch[RMS_THREADS / WARP_SIZE];
  let_next_kernel_launch();
  const long long row = blockIdx.x;
  float4* residual_row = reinterpret_cast<float4*>(residual + row * NQ_HIDDEN);
  // The norm's weights are no kernel's output: fetch them while the kernel before finishes.
  const uint2* weight4 = reinterpret_cast<const uint2*>(weight);
  uint2 w[RMS_ITEMS];
#pragma unroll
  for (int item = 0; item < RMS_ITEMS; ++item) {
    const int v = threadIdx.x + item * RMS_THREADS;
    if (v < RMS_VECTORS) w[item] = __ldg(weight4 + v);
  }
  wait_for_previous_kernel();  // residual and partials are the earlier kernels' output

  float4 x[RMS_ITEMS];
  float sum_squares = 0.0f;
#pragma unroll
  for (int item = 0; item < RMS_ITEMS; ++item) {
    const int v = threadIdx.x + item * RMS_THREADS;
    if (v < RMS_VECTORS) {
      float4 delta = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int p = 0; p < num_partials; ++p) {
        const float4 d = reinterpret_cast<const float4*>(partials + (long long)p * partial_stride + row * NQ_HIDDEN)[v];
        delta.x += d.x;
        delta.y += d.y;
        delta.z += d.z;
        delta.w += d.w;
      }
      float4 r = residual_row[v];
      r.x += delta.x;
      r.y += delta.y;
      r.z += delta.z;
      r.w += delta.w;
      x[item] = r;
      sum_squares += r.x * r.x + r.y * r.y + r.z * r.z + r.w * r.w;
    }
  }
  const float mean_square = block_sum<RMS_THREADS>(sum_squares, scratch) / (float)NQ_HIDDEN;
  const float inv_rms = 1.0f / sqrtf(mean_square + NQ_RMS_EPS);  // IEEE sqrt and division, like numpy

  uint2* out_row = reinterpret_cast<uint2*>(out + row * NQ_HIDDEN);
#pragma unroll
  for (int item = 0; item < RMS_ITEMS; ++item) {
    const int v = threadIdx.x + item * RMS_THREADS;
    if (v < RMS_VECTORS) {
      residual_row[v] = x[item];
      const float2 w01 = half2_to_float2(w[item].x), w23 = half2_to_float2(w[item].y);
      out_row[v] = make_uint2(float2_to_half2(x[item].x * inv_rms * w01.x, x[item].y * inv_rms * w01.y),
                              float2_to_half2(x[item].z * inv_rms * w23.x, x[item].w * inv_rms * w23.y));
    }
  }
}
