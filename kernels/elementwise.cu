// elementwise.cu: the small kernels around the projections. Each reads its inputs once and
// writes its outputs once; their cost in decode is the launch, not the bytes.
#include "common.cuh"

// ---------------------------------------------------------------- embedding
// Reference: reference/ops.py embed: residual[t] = table[token_ids[t]] as fp32.
// grid (T), block (EMBED_THREADS); token_ids int32 [T] (decode: the step state's token),
// table fp16 [V, H], residual fp32 [T, H]. Ids are checked on the host (or come from argmax).
// What an earlier kernel of the step wrote is read with ordinary loads: no __restrict__ on its
// pointer and no __ldg, see nanoqwen/cuda/launch.py ("the read-only path").
constexpr int EMBED_VECTORS = NQ_HIDDEN / 8;  // 16-byte pieces of a table row
constexpr int EMBED_THREADS = EMBED_VECTORS < 1024 ? EMBED_VECTORS : 1024;

extern "C" __global__ void __launch_bounds__(EMBED_THREADS)
embed_tokens(const int* token_ids, const uint4* __restrict__ table, float4* __restrict__ residual) {
  let_next_kernel_launch();
  wait_for_previous_kernel();  // the token id comes from the step before (argmax_select_next)
  const long long token = token_ids[blockIdx.x];
  const uint4* source = table + token * EMBED_VECTORS;
  float4* destination = residual + (long long)blockIdx.x * (NQ_HIDDEN / 4);
  for (int v = threadIdx.x; v < EMBED_VECTORS; v += EMBED_THREADS) {
    const uint4 halves = __ldg(source + v);
    const float2 a = half2_to_float2(halves.x), b = half2_to_float2(halves.y);
    const float2 c = half2_to_float2(halves.z), d = half2_to_float2(halves.w);
    destination[2 * v] = make_float4(a.x, a.y, b.x, b.y);
    destination[2 * v + 1] = make_float4(c.x, c.y, d.x, d.y);
  }
}

// ---------------------------------------------------------------- RoPE and the cache write
// Reference: reference/ops.py apply_rope on q and k, then reference/ops.py write_kv.
// The fused q|k|v projection arrives in fp32, its bias already added; token t sits at position positions_base[0] + t, read from device memory
// so the same launch serves every decode step. Query heads are rotated into q_out (fp32, for
// attention); each KV head's rotated K and plain V go as fp16 straight into the token's page:
// page_table[pos / 16], row pos % 16.
// grid (T, NUM_HEADS + NUM_KV_HEADS), block (HEAD_DIM / 2): thread i rotates dims i, i + D/2.
//   qkv          fp32 [T, QKV]
//   inv_freq     fp32 [D/2]   (reference/ops.py rope_inv_freq, computed once on the host)
//   page_table   int32 [pages of the sequence]
//   kv_layer     fp16 [num_pages, 2, KVH, 16, D]   (one layer of the pool)
//   q_out        fp32 [T, Q_DIM]
constexpr int ROPE_THREADS = NQ_HEAD_DIM / 2;

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_write_kv(const float* qkv, const int* positions_base, const float* __restrict__ inv_freq,
              const int* __restrict__ page_table, unsigned short* __restrict__ kv_layer, float* __restrict__ q_out) {
  let_next_kernel_launch();
  const int token = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
  const bool is_query = head < NQ_NUM_HEADS;
  const int kv_head = head - NQ_NUM_HEADS;
  // The position and the page table are the step's inputs, set before it began (by the host, or
  // by the previous step's argmax_select_next), never by a kernel before this one: read them and
  // compute the rotation while the projection still runs, so that after the wait only the
  // projection's output is loaded. Decode's fp16 path does all of this inside its q|k|v GEMV
  // (gemv_int4_qkv_rope); this kernel serves prefill and the INT8 path.
  const int position = positions_base[0] + token;
  float c, s;
  rope_cos_sin(position, inv_freq[i], c, s);
  const long long page = is_query ? 0 : page_table[position / NQ_PAGE_SIZE];
  wait_for_previous_kernel();  // qkv is the projection's output

  const long long row = (long long)token * NQ_QKV_DIM;
  const long long first = row + (is_query ? head * NQ_HEAD_DIM : NQ_Q_DIM + kv_head * NQ_HEAD_DIM);
  const float x1 = qkv[first + i], x2 = qkv[first + i + NQ_HEAD_DIM / 2];
  float v1 = 0.0f, v2 = 0.0f;  // a KV head's V, loaded with its K: one round trip to L2, not two
  if (!is_query) {
    const long long v_first = row + NQ_Q_DIM + NQ_KV_DIM + kv_head * NQ_HEAD_DIM;
    v1 = qkv[v_first + i];
    v2 = qkv[v_first + i + NQ_HEAD_DIM / 2];
  }
  const float rotated1 = rope_rotate(x1, x2, c, s, true), rotated2 = rope_rotate(x2, x1, c, s, false);

  if (is_query) {
    float* q = q_out + (long long)token * NQ_Q_DIM + head * NQ_HEAD_DIM;
    q[i] = rotated1;
    q[i + NQ_HEAD_DIM / 2] = rotated2;
    return;
  }
  const int slot = position % NQ_PAGE_SIZE;
  unsigned short* k = kv_layer + kv_index(page, 0, kv_head, slot, 0);
  unsigned short* v = kv_layer + kv_index(page, 1, kv_head, slot, 0);
  k[i] = float_to_half(rotated1);
  k[i + NQ_HEAD_DIM / 2] = float_to_half(rotated2);
  v[i] = float_to_half(v1);
  v[i + NQ_HEAD_DIM / 2] = float_to_half(v2);
}

// ---------------------------------------------------------------- SwiGLU for prefill
// Reference: reference/ops.py silu_mul. Decode fuses this into gemv_int4_gate_up_silu; prefill's GEMM
// leaves gate|up rows [T, 2 I] in fp32 and this makes h fp16 [T, I].
// grid-stride over T * I elements
extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)
silu_mul_rows(const float* gate_up, unsigned short* __restrict__ h, int num_tokens) {
  let_next_kernel_launch();
  wait_for_previous_kernel();
  const long long total = (long long)num_tokens * NQ_INTERMEDIATE;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
    const long long token = e / NQ_INTERMEDIATE, j = e % NQ_INTERMEDIATE;
    const float gate = gate_up[token * 2 * NQ_INTERMEDIATE + j];
    const float up = gate_up[token * 2 * NQ_INTERMEDIATE + NQ_INTERMEDIATE + j];
    h[e] = float_to_half(gate / (1.0f + expf(-gate)) * up);
  }
}
