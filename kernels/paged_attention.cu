// paged_attention.cu: causal GQA attention over the paged KV cache, decode and prefill.
//
// The cache of one layer, as the kernels see it (ARCHITECTURE.md, "Paged KV cache"):
//
//     kv  fp16 [num_pages, 2, NQ_NUM_KV_HEADS, 16, NQ_HEAD_DIM]     (index 1: 0 = K, 1 = V)
//
// so one page slice (one page, K or V, one KV head) is 16 x head_dim contiguous halves: 4 KiB
// at head_dim 128, one bulk copy. Position p of a sequence lives in page table[p / 16], row
// p % 16. The CPU reference is nanoqwen.ops_numpy.paged_attention.
//
// Decode (one new token, `paged_attention_decode`) is warp-specialized. Block (split, kv
// head) has one producer warp, which asks the copy engine for the K and V slices of its pages
// (cp.async.bulk, completing on an mbarrier), and DECODE_CONSUMER_WARPS consumer warps, which
// compute scores, an online softmax and the weighted sum of V for all GQA query heads that
// share the KV head, from that one copy. DECODE_STAGES shared-memory stages let the copies of
// the next pages fly while the consumers work. Long sequences are cut into page ranges, one
// per block, and a second small kernel, `paged_attention_combine`, merges the ranges
// (flash-decoding), one block per query head so the merge itself is spread over the GPU.
//
// The hand-off of a stage between the producer and a consumer is four hooks, below. The
// deliberately broken kernels/paged_attention_broken.cu redefines only them.
//
// Prefill (`paged_attention_prefill`) is a tiled kernel on the tensor cores (mma.sync): a block
// takes 16 tokens and one KV head, one warp per query head of the group, and walks 64-position
// K/V tiles double-buffered in shared memory.
#include "common.cuh"

#ifndef PA_DECODE_KERNEL
#define PA_DECODE_KERNEL paged_attention_decode
#endif

constexpr int PA_PAGE = NQ_PAGE_SIZE;
constexpr int PA_D = NQ_HEAD_DIM;
constexpr int PA_KVH = NQ_NUM_KV_HEADS;
constexpr int PA_GQA = NQ_NUM_HEADS / NQ_NUM_KV_HEADS;  // query heads per KV head
constexpr int PA_SLICE = PA_PAGE * PA_D;                // halves in one page slice
constexpr int PA_SLICE_BYTES = PA_SLICE * 2;
constexpr long long PA_PAGE_STRIDE = 2LL * PA_KVH * PA_SLICE;  // halves from one page to the next

static_assert(PA_PAGE == 16, "the decode kernel maps a page's 16 rows onto 16 lane pairs");
static_assert(PA_D % 32 == 0 && PA_D <= 128, "head_dim must be a multiple of 32, at most 128");
static_assert(NQ_NUM_HEADS % NQ_NUM_KV_HEADS == 0, "query heads must split evenly among KV heads");
static_assert(PA_SLICE_BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");

// ====================================================================== PTX helpers

__device__ __forceinline__ unsigned smem_address(const void* pointer) {
  unsigned address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
}

// mbarriers, the bulk copy and named barriers, shared with tools/sanitizer_probe.cu, which tests
// these mechanisms one at a time.
#include "mbarrier.cuh"

// Two floats to an fp16 pair, round to nearest even; `lo` is the first element in memory.
__device__ __forceinline__ unsigned pack_half2_rn(float lo, float hi) {
  unsigned packed;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Load N consecutive halves as floats, 16 bytes at a time where N allows (src aligned to
// 2 N bytes, or to 2 bytes for odd N).
template <int N>
__device__ __forceinline__ void load_halves(const unsigned short* src, float (&dst)[N]) {
  if constexpr (N % 2 == 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = half_to_float(src[i]);
  } else if constexpr (N % 8 == 0) {
#pragma unroll
    for (int c = 0; c < N / 8; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * c);
      const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = half2_to_float2(w[i]);
        dst[8 * c + 2 * i] = f.x;
        dst[8 * c + 2 * i + 1] = f.y;
      }
    }
  } else if constexpr (N % 4 == 0) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
      const uint2 v = *reinterpret_cast<const uint2*>(src + 4 * c);
      const float2 a = half2_to_float2(v.x), b = half2_to_float2(v.y);
      dst[4 * c] = a.x, dst[4 * c + 1] = a.y, dst[4 * c + 2] = b.x, dst[4 * c + 3] = b.y;
    }
  } else {
#pragma unroll
    for (int c = 0; c < N / 2; ++c) {
      const float2 a = half2_to_float2(*reinterpret_cast<const unsigned*>(src + 2 * c));
      dst[2 * c] = a.x, dst[2 * c + 1] = a.y;
    }
  }
}

// ====================================================================== decode

constexpr int DECODE_CONSUMER_WARPS = 4;
constexpr int DECODE_STAGES = 8;
constexpr int DECODE_THREADS = WARP_SIZE * (1 + DECODE_CONSUMER_WARPS);
constexpr int DECODE_CONSUMER_THREADS = WARP_SIZE * DECODE_CONSUMER_WARPS;
// Scores: a consumer warp is two half-warps of 16 lanes; lane l owns dims [(l % 16) * DPL,
// +DPL) and reads the rows of its half: rows 0-7 for lanes 0-15, rows 8-15 for lanes 16-31.
// So a warp reads two whole rows per load, 16 bytes per lane at head_dim 128, no bank conflict.
constexpr int DECODE_DPL = PA_D / 16;
// Weighted V sum: lane l owns dims [l * DPV, +DPV) of every row.
constexpr int DECODE_DPV = PA_D / 32;
constexpr int DECODE_GQA_PAD = (PA_GQA + 3) / 4 * 4;  // rows of the probability buffer: float4 reads
static_assert(DECODE_STAGES % DECODE_CONSUMER_WARPS == 0,
              "stage s is always read by consumer warp s % DECODE_CONSUMER_WARPS, so no warp waits "
              "on a phase two ahead of the one it last saw (mbarrier parity would alias), and the "
              "stage's named barrier is met by the producer and that one warp");
// Named barriers: 0 is __syncthreads, 1 gathers the consumer warps after their pages, and stage
// s is released on DECODE_EMPTY_BARRIER0 + s by its consumer warp to the producer warp.
constexpr int DECODE_CONSUMERS_BARRIER = 1;
constexpr int DECODE_EMPTY_BARRIER0 = 2;
constexpr int DECODE_STAGE_BARRIER_THREADS = 2 * WARP_SIZE;
static_assert(DECODE_EMPTY_BARRIER0 + DECODE_STAGES <= 16, "a block has 16 named barriers: too many stages");

struct DecodeShared {
  unsigned short kv[DECODE_STAGES][2][PA_SLICE];  // bulk-copy destinations (offset 0: 128-byte aligned)
  unsigned long long full[DECODE_STAGES];         // "stage holds its page": expect_tx + copy bytes
  float probabilities[DECODE_CONSUMER_WARPS][PA_PAGE][DECODE_GQA_PAD];
  float warp_max[DECODE_CONSUMER_WARPS][PA_GQA];
  float warp_sum[DECODE_CONSUMER_WARPS][PA_GQA];
  float warp_acc[DECODE_CONSUMER_WARPS][PA_GQA][PA_D];
};
static_assert(sizeof(DecodeShared) <= 227 * 1024, "decode shared memory exceeds a Hopper SM's");

// Read by the host (cupy RawModule.get_global) to size the launches.
__device__ int paged_attention_decode_smem_bytes = sizeof(DecodeShared);
__device__ int paged_attention_decode_threads = DECODE_THREADS;

// ---------------------------------------------------------------- the stage hand-off
// Page i of a block goes to stage i % DECODE_STAGES in round i / DECODE_STAGES. "Stage s holds
// its page" is the mbarrier full[s]: it completes when the producer has armed it and the copy's
// bytes have landed, and parity (round & 1) names the phase to wait for. "Stage s was read" is
// the named barrier DECODE_EMPTY_BARRIER0 + s, met by two warps: the consumer warp that read the
// stage arrives (bar.arrive, no wait) and the producer warp syncs (bar.sync) before refilling it.
// A named barrier has no phases to name, it completes at DECODE_STAGE_BARRIER_THREADS arrivals,
// so every arrival is matched by exactly one sync: the producer skips round 0 (a fresh stage is
// free) and a consumer releases only a stage that will be refilled.
//
// Why not a second mbarrier, as full[s] was: it works on the hardware, but compute-sanitizer's
// racecheck (2025.3) does not see that ordering. It reported races between this kernel's bulk
// copies and its consumers' reads, as on the broken kernel, and in tools/sanitizer_probe.py a WAR
// on every ring that released its stages that way (a consumer lane's read, then the refill's
// write), so it could not tell the fixed kernel from the broken one. bar.arrive/bar.sync are the
// hardware barriers __syncthreads is made of, which racecheck models; the probe's
// bulk_named_empty is this hand-off in small, the check that racecheck follows it here too.
// Cost: the consumer's bar.arrive does not wait; the producer warp waits in bar.sync where its
// lane 0 spun on the mbarrier and the other lanes waited at __syncwarp; 64 bytes of shared
// memory fewer. The ids are in registers, so ptxas reserves all 16 named barriers; a Hopper SM
// has 64 (cuda_occupancy.h), enough for 4 blocks, and shared memory already holds it to 2.
#ifndef PRODUCER_WAIT_STAGE_FREE
// Producer, whole warp, before it overwrites a stage: has round - 1's page been read? (The
// warp is converged: the previous page ended with PRODUCER_AFTER_ISSUE.)
#define PRODUCER_WAIT_STAGE_FREE(stage, round) \
  do {                                         \
    if ((round) > 0) named_barrier_sync<DECODE_STAGE_BARRIER_THREADS>(DECODE_EMPTY_BARRIER0 + (stage)); \
  } while (0)
// Producer, all lanes, after lane 0 issued the copies: a warp-scope barrier. The other 31
// lanes wait for lane 0 here, so the warp meets the next stage's named barrier converged.
#define PRODUCER_AFTER_ISSUE(stage, round) __syncwarp()
// Consumer, every lane, before it reads a stage: wait until its bytes have landed.
#define CONSUMER_WAIT_STAGE_FULL(stage, round) mbar_wait(&sh.full[stage], (round) & 1)
// Consumer, whole warp, after reading a stage that the producer will refill (converged:
// decode_page ends with __syncwarp): every lane's reads are ordered before the refill by the
// warp's arrival.
#define CONSUMER_RELEASE_STAGE(stage) named_barrier_arrive<DECODE_STAGE_BARRIER_THREADS>(DECODE_EMPTY_BARRIER0 + (stage))
#endif

// One consumer warp's page: scores for the 16 rows, online-softmax update, weighted V sum.
// `q` is pre-scaled by head_dim^-0.5 * log2(e), so scores are in base 2. m: running max
// (same in every lane); l: running sum over this lane's rows; acc: this lane's dims of the
// weighted V sum, every head.
__device__ __forceinline__ void decode_page(const unsigned short* k_slice, const unsigned short* v_slice, int valid_rows,
                                            const float (&q)[PA_GQA][DECODE_DPL], float (&m)[PA_GQA],
                                            float (&l)[PA_GQA], float (&acc)[PA_GQA][DECODE_DPV],
                                            float (*probabilities)[DECODE_GQA_PAD], int lane) {
  const int half = lane >> 4, dims = (lane & 15) * DECODE_DPL;
  // Lane l ends up holding the scores of rows {0, 4} + ((l >> 2) & 3) + 8 * half, every head.
  float score[2][PA_GQA];
#pragma unroll
  for (int group = 0; group < 2; ++group) {
    // Partial dot products of this lane's dims: s[h][j] is head h against row 4*group + j + 8*half.
    float s[PA_GQA][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float k[DECODE_DPL];
      load_halves(k_slice + (4 * group + j + 8 * half) * PA_D + dims, k);
#pragma unroll
      for (int h = 0; h < PA_GQA; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < DECODE_DPL; ++i) dot = fmaf(q[h][i], k[i], dot);
        s[h][j] = dot;
      }
    }
    // Sum over the 16 lanes of a half while spreading the rows out: at each step a lane keeps
    // half of its rows and sends the other half to its partner, so 4 rows cost 2+1+1+1
    // shuffles per head instead of 4 x 4.
#pragma unroll
    for (int h = 0; h < PA_GQA; ++h) {
      const bool upper8 = lane & 8, upper4 = lane & 4;
      const float r0 = (upper8 ? s[h][2] : s[h][0]) + __shfl_xor_sync(FULL_MASK, upper8 ? s[h][0] : s[h][2], 8);
      const float r1 = (upper8 ? s[h][3] : s[h][1]) + __shfl_xor_sync(FULL_MASK, upper8 ? s[h][1] : s[h][3], 8);
      float dot = (upper4 ? r1 : r0) + __shfl_xor_sync(FULL_MASK, upper4 ? r0 : r1, 4);
      dot += __shfl_xor_sync(FULL_MASK, dot, 2);
      dot += __shfl_xor_sync(FULL_MASK, dot, 1);
      score[group][h] = dot;
    }
  }
  const int row0 = ((lane >> 2) & 3) + 8 * half, row1 = row0 + 4;
#pragma unroll
  for (int h = 0; h < PA_GQA; ++h) {
    // Rows past the sequence's end hold whatever the pool held: mask by selection, never by
    // arithmetic, so a NaN there cannot leak in.
    const float s0 = row0 < valid_rows ? score[0][h] : NEGATIVE_INFINITY;
    const float s1 = row1 < valid_rows ? score[1][h] : NEGATIVE_INFINITY;
    float page_max = fmaxf(s0, s1);
#pragma unroll
    for (int offset = 4; offset < WARP_SIZE; offset <<= 1)
      page_max = fmaxf(page_max, __shfl_xor_sync(FULL_MASK, page_max, offset));
    const float new_max = fmaxf(m[h], page_max);  // finite: row 0 of a page is always valid
    const float rescale = fast_exp2(m[h] - new_max);
    const float p0 = fast_exp2(s0 - new_max), p1 = fast_exp2(s1 - new_max);
    m[h] = new_max;
    l[h] = l[h] * rescale + (p0 + p1);
#pragma unroll
    for (int i = 0; i < DECODE_DPV; ++i) acc[h][i] *= rescale;
    if ((lane & 3) == 0) probabilities[row0][h] = p0, probabilities[row1][h] = p1;
  }
  __syncwarp();  // the probabilities are written by 8 lanes and read by every lane
  // Weighted sum of V: lane l owns dims [l * DPV, +DPV) and walks the valid rows.
  const int v_dims = lane * DECODE_DPV;
  for (int r = 0; r < valid_rows; ++r) {  // skipping, not multiplying by 0: rows past the end may hold NaN
    float v[DECODE_DPV];
    load_halves(v_slice + r * PA_D + v_dims, v);
    float p[DECODE_GQA_PAD];
#pragma unroll
    for (int h4 = 0; h4 < DECODE_GQA_PAD; h4 += 4) {
      const float4 four = *reinterpret_cast<const float4*>(&probabilities[r][h4]);
      p[h4] = four.x, p[h4 + 1] = four.y, p[h4 + 2] = four.z, p[h4 + 3] = four.w;
    }
#pragma unroll
    for (int h = 0; h < PA_GQA; ++h)
#pragma unroll
      for (int i = 0; i < DECODE_DPV; ++i) acc[h][i] = fmaf(p[h], v[i], acc[h][i]);
  }
  __syncwarp();  // every lane has read the probabilities before the next page rewrites them
}

// Grid (splits, num_kv_heads), DECODE_THREADS threads, sizeof(DecodeShared) dynamic shared
// memory. seq_len is read from device memory so one captured graph serves every step: the
// grid is sized for the longest sequence and blocks beyond the work exit at once.
// A sequence of one block's pages is finished here; otherwise each block leaves its share in
// partial_* ([num_kv_heads, splits, GQA, ...]) for paged_attention_combine.
// What earlier kernels of the step write (q, the new K/V) comes through pointers without
// __restrict__, so it is read with coherent loads that stay below the wait (kernels/common.cuh,
// programmatic dependent launch); seq_len and the page table, which no kernel of the step writes,
// are read above it.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 2)
PA_DECODE_KERNEL(const float* q,                              // [num_heads * D] fp32, RoPE'd
                 const unsigned short* kv,                    // one layer's pool, fp16
                 const int* __restrict__ page_table,          // [max_pages_per_seq]
                 const int* seq_len_ptr,                      // [1] positions to attend to
                 unsigned short* __restrict__ out,            // [num_heads * D] fp16
                 float* __restrict__ partial_max_sum,         // [KVH, splits, GQA, 2]
                 float* __restrict__ partial_acc) {           // [KVH, splits, GQA, D]
  extern __shared__ __align__(128) unsigned char shared_raw[];
  DecodeShared& sh = *reinterpret_cast<DecodeShared*>(shared_raw);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int split = blockIdx.x, kv_head = blockIdx.y, splits = gridDim.x;
  let_next_kernel_launch();
  // The sequence length and the page table are the step's inputs, set before the step began (by
  // the host, or by the previous step's argmax_select_next) and written by no kernel of this
  // step: the block reads them, picks its pages and sets up its barriers while rope_write_kv
  // still runs, so that after the wait the first copies and q are one round trip away.
  const int seq_len = *seq_len_ptr;
  const int num_pages = (seq_len + PA_PAGE - 1) / PA_PAGE;
  const int pages_per_split = (num_pages + splits - 1) / splits;
  if (seq_len <= 0 || split * pages_per_split >= num_pages) {
    wait_for_previous_kernel();  // an idle block waits too, or the chain of completions breaks
    return;  // the whole block: no barrier yet
  }
  const int active_splits = (num_pages + pages_per_split - 1) / pages_per_split;
  const int first_page = split * pages_per_split;
  const int block_pages = min(pages_per_split, num_pages - first_page);
  // Producer lane l holds the id of the block's page 32 r + l while the producer is at round r
  // of 32 pages; the first 32 are loaded here.
  int page_id = warp == 0 && lane < block_pages ? page_table[first_page + lane] : 0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < DECODE_STAGES; ++s) mbar_init(&sh.full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the copy engine
  }
  // The block's one __syncthreads, before the roles part: every thread reaches it, and after
  // it every thread sees initialized barriers.
  __syncthreads();
  wait_for_previous_kernel();  // q and the new token's K/V are rope_write_kv's

  if (warp == 0) {  // ------------------------------------------------ producer
    const unsigned short* head_base = kv + (long long)kv_head * PA_SLICE;
    for (int i = 0; i < block_pages; ++i) {
      const int stage = i % DECODE_STAGES, round = i / DECODE_STAGES;
      if (i > 0 && i % WARP_SIZE == 0 && i + lane < block_pages) page_id = page_table[first_page + i + lane];
      const int page = __shfl_sync(FULL_MASK, page_id, i % WARP_SIZE);
      PRODUCER_WAIT_STAGE_FREE(stage, round);
      if (lane == 0) {
        const unsigned short* k_slice = head_base + page * PA_PAGE_STRIDE;
        const unsigned short* v_slice = k_slice + PA_KVH * PA_SLICE;
        mbar_arrive_expect_tx(&sh.full[stage], 2 * PA_SLICE_BYTES);
        bulk_copy_to_shared(sh.kv[stage][0], k_slice, PA_SLICE_BYTES, &sh.full[stage]);
        bulk_copy_to_shared(sh.kv[stage][1], v_slice, PA_SLICE_BYTES, &sh.full[stage]);
      }
      PRODUCER_AFTER_ISSUE(stage, round);
    }
    return;  // the copies land on their own; the consumers wait for them
  }

  // ---------------------------------------------------------------- consumers
  const int consumer = warp - 1;
  const int dims = (lane & 15) * DECODE_DPL;
  const float q_scale = 1.4426950408889634f * rsqrtf((float)PA_D);  // log2(e): softmax in base 2
  float qr[PA_GQA][DECODE_DPL], m[PA_GQA], l[PA_GQA], acc[PA_GQA][DECODE_DPV];
#pragma unroll
  for (int h = 0; h < PA_GQA; ++h) {
    const float* qh = q + (kv_head * PA_GQA + h) * PA_D + dims;
#pragma unroll
    for (int i = 0; i < DECODE_DPL; ++i) qr[h][i] = qh[i] * q_scale;
#pragma unroll
    for (int i = 0; i < DECODE_DPV; ++i) acc[h][i] = 0.0f;
    m[h] = NEGATIVE_INFINITY;
    l[h] = 0.0f;
  }
  for (int i = consumer; i < block_pages; i += DECODE_CONSUMER_WARPS) {
    const int stage = i % DECODE_STAGES, round = i / DECODE_STAGES;
    CONSUMER_WAIT_STAGE_FULL(stage, round);
    const int valid_rows = min(PA_PAGE, seq_len - (first_page + i) * PA_PAGE);
    decode_page(sh.kv[stage][0], sh.kv[stage][1], valid_rows, qr, m, l, acc, sh.probabilities[consumer], lane);
    if (i + DECODE_STAGES < block_pages) CONSUMER_RELEASE_STAGE(stage);  // only a stage that will be refilled
  }

  // This warp's totals: l over the 16 rows (4 lanes hold the same two rows).
#pragma unroll
  for (int h = 0; h < PA_GQA; ++h) {
#pragma unroll
    for (int offset = 4; offset < WARP_SIZE; offset <<= 1) l[h] += __shfl_xor_sync(FULL_MASK, l[h], offset);
#pragma unroll
    for (int i = 0; i < DECODE_DPV; ++i) sh.warp_acc[consumer][h][lane * DECODE_DPV + i] = acc[h][i];
    if (lane == 0) sh.warp_max[consumer][h] = m[h], sh.warp_sum[consumer][h] = l[h];
  }
  named_barrier_sync<DECODE_CONSUMER_THREADS>(DECODE_CONSUMERS_BARRIER);  // the producer, maybe gone, is not waited for

  // Combine the consumer warps (a warp without pages has max -inf and weighs 0), then either
  // finish (one block holds the whole sequence) or leave this split's share for the combine.
  const int t = threadIdx.x - WARP_SIZE;
  const size_t split_row = ((size_t)kv_head * splits + split) * PA_GQA;
  for (int e = t; e < PA_GQA * PA_D; e += DECODE_CONSUMER_THREADS) {
    const int h = e / PA_D, d = e % PA_D;
    float block_max = NEGATIVE_INFINITY;
#pragma unroll
    for (int c = 0; c < DECODE_CONSUMER_WARPS; ++c) block_max = fmaxf(block_max, sh.warp_max[c][h]);
    float sum = 0.0f, value = 0.0f;
#pragma unroll
    for (int c = 0; c < DECODE_CONSUMER_WARPS; ++c) {
      const float w = fast_exp2(sh.warp_max[c][h] - block_max);
      sum = fmaf(sh.warp_sum[c][h], w, sum);
      value = fmaf(sh.warp_acc[c][h][d], w, value);
    }
    if (active_splits == 1) {
      out[(kv_head * PA_GQA + h) * PA_D + d] = float_to_half(value / sum);
    } else {
      partial_acc[(split_row + h) * PA_D + d] = value;
      if (d == 0) partial_max_sum[2 * (split_row + h)] = block_max, partial_max_sum[2 * (split_row + h) + 1] = sum;
    }
  }
}

// ---------------------------------------------------------------- combine

constexpr int COMBINE_THREADS = 256;
constexpr int COMBINE_WARPS = COMBINE_THREADS / WARP_SIZE;  // warp w merges splits w, w + 8, ...
constexpr int COMBINE_MAX_SPLITS = 4096;
static_assert(PA_D / 4 <= WARP_SIZE, "a warp covers a head's dims 4 at a time");
__device__ int paged_attention_combine_threads = COMBINE_THREADS;
__device__ int paged_attention_combine_max_splits = COMBINE_MAX_SPLITS;

// Grid (GQA, num_kv_heads): block (h, kv head) merges query head kv_head * GQA + h over the
// splits the decode kernel left, softmax in base 2: with M the largest split max, split s weighs
// 2^(max_s - M), the denominator is sum_s l_s 2^(max_s - M) and the output sum_s acc_s 2^(max_s - M)
// over it. Each warp merges its splits in one pass, rescaling its running share whenever a
// larger max arrives (as decode_page does across pages), so a split's (max, sum) and its acc
// are loaded together, a few splits' loads in flight at once; then the eight warps' shares are
// merged the same way. Launched right after the decode kernel with the same seq_len; nothing to
// do if one split held the whole sequence.
// (The minimum of one block per SM lets ptxas hold several splits' loads in registers at once:
// with the default it kept to 32 registers and waited for each split's loads before the next's.)
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS, 1)
paged_attention_combine(const int* seq_len_ptr, const float* partial_max_sum,
                        const float* partial_acc, int splits, unsigned short* __restrict__ out) {
  __shared__ float warp_max[COMBINE_WARPS], warp_sum[COMBINE_WARPS];
  __shared__ float4 warp_acc[COMBINE_WARPS][WARP_SIZE];
  let_next_kernel_launch();
  const int seq_len = *seq_len_ptr;  // a step input, as in the decode kernel: read before the wait
  const int num_pages = (seq_len + PA_PAGE - 1) / PA_PAGE;
  const int pages_per_split = (num_pages + splits - 1) / splits;
  wait_for_previous_kernel();  // before the early exits: the partials are the decode kernel's
  if (seq_len <= 0) return;
  const int active_splits = (num_pages + pages_per_split - 1) / pages_per_split;
  if (active_splits == 1) return;  // the decode kernel wrote the output itself
  const int h = blockIdx.x, kv_head = blockIdx.y;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const bool has_dims = lane < PA_D / 4;
  const size_t row0 = (size_t)kv_head * splits * PA_GQA + h;  // split s: row0 + s * GQA

  float m = NEGATIVE_INFINITY, l = 0.0f;  // a warp without splits keeps m = -inf: weight 0 below
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
  for (int s = warp; s < active_splits; s += COMBINE_WARPS) {
    const size_t r = row0 + (size_t)s * PA_GQA;
    const float2 max_sum = *reinterpret_cast<const float2*>(partial_max_sum + 2 * r);  // every lane, one broadcast
    const float4 v = has_dims ? *reinterpret_cast<const float4*>(partial_acc + r * PA_D + 4 * lane) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float new_max = fmaxf(m, max_sum.x);  // finite: a split with pages has a finite max
    const float keep = fast_exp2(m - new_max), weight = fast_exp2(max_sum.x - new_max);
    m = new_max;
    l = fmaf(l, keep, max_sum.y * weight);
    acc.x = fmaf(acc.x, keep, v.x * weight), acc.y = fmaf(acc.y, keep, v.y * weight);
    acc.z = fmaf(acc.z, keep, v.z * weight), acc.w = fmaf(acc.w, keep, v.w * weight);
  }
  if (lane == 0) warp_max[warp] = m, warp_sum[warp] = l;
  warp_acc[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && has_dims) {
    float total_max = NEGATIVE_INFINITY;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) total_max = fmaxf(total_max, warp_max[w]);
    float denominator = 0.0f;
    float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) {
      const float weight = fast_exp2(warp_max[w] - total_max);  // 0 for a warp without splits
      const float4 g = warp_acc[w][lane];
      denominator = fmaf(warp_sum[w], weight, denominator);
      total.x = fmaf(g.x, weight, total.x), total.y = fmaf(g.y, weight, total.y);
      total.z = fmaf(g.z, weight, total.z), total.w = fmaf(g.w, weight, total.w);
    }
    const float inv = 1.0f / denominator;
    unsigned* dst = reinterpret_cast<unsigned*>(out + (kv_head * PA_GQA + h) * PA_D + 4 * lane);
    dst[0] = pack_half2_rn(total.x * inv, total.y * inv);
    dst[1] = pack_half2_rn(total.z * inv, total.w * inv);
  }
}

// ====================================================================== prefill

constexpr int PREFILL_TOKENS = 16;    // query rows of a block: one mma tile
constexpr int PREFILL_KV_TILE = 64;   // K/V positions per shared-memory tile (4 pages)
constexpr int PREFILL_THREADS = WARP_SIZE * PA_GQA;  // one warp per query head of the group
constexpr int PREFILL_ROW = PA_D + 8;  // padded row (halves): 8 rows of a fragment hit 32 banks
constexpr int PREFILL_CHUNKS = PA_D / 8;  // 16-byte chunks in a row

struct PrefillShared {
  unsigned short k[2][PREFILL_KV_TILE][PREFILL_ROW];
  unsigned short v[2][PREFILL_KV_TILE][PREFILL_ROW];
};
static_assert(sizeof(PrefillShared) <= 227 * 1024, "prefill shared memory exceeds a Hopper SM's");
__device__ int paged_attention_prefill_smem_bytes = sizeof(PrefillShared);
__device__ int paged_attention_prefill_threads = PREFILL_THREADS;

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  // src-size 0 fills the 16 bytes with zeros: rows past the sequence never reach the math.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(row_address)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(row_address)));
}

// D += A (16x16 fp16, row-major fragments) * B (16x8 fp16, column fragments), fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Grid (ceil(T / 16), num_kv_heads), PREFILL_THREADS threads, sizeof(PrefillShared) bytes.
// Token t of the prompt is at position start_pos + t and sees positions 0..start_pos + t, whose
// K/V are already in the cache. Fragment notation (PTX mma.m16n8k16): lane = 4 g + c; a thread
// holds rows g and g + 8 of a tile and columns 2c, 2c + 1 of each 8-wide slab.
//
// Numerics: K, V and the probabilities enter the tensor cores as fp16 and every product is
// accumulated in fp32. q is fp32; it goes in as two fp16 terms, q = hi + lo, so the scores
// carry q's full precision (error ~2^-22 relative instead of fp16's 2^-11).
extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)
paged_attention_prefill(const float* q,                         // [T, num_heads * D] fp32, RoPE'd
                        const unsigned short* kv,               // one layer's pool, fp16
                        const int* __restrict__ page_table,
                        int start_pos, int num_tokens,
                        unsigned short* __restrict__ out) {     // [T, num_heads * D] fp16
  extern __shared__ __align__(128) unsigned char shared_raw[];
  PrefillShared& sh = *reinterpret_cast<PrefillShared*>(shared_raw);
  let_next_kernel_launch();
  wait_for_previous_kernel();  // q and the prompt's K/V are rope_write_kv's output
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane >> 2, c = lane & 3;
  // The last token tiles see the most positions: launch them first.
  const int tile = gridDim.x - 1 - blockIdx.x, kv_head = blockIdx.y;
  const int head = kv_head * PA_GQA + warp;
  const int t0 = tile * PREFILL_TOKENS;
  const int kv_len = start_pos + min(t0 + PREFILL_TOKENS, num_tokens);  // positions this block needs
  const int kv_tiles = (kv_len + PREFILL_KV_TILE - 1) / PREFILL_KV_TILE;

  auto load_tile = [&](int kv_tile, int buffer) {
    for (int e = threadIdx.x; e < PREFILL_KV_TILE * PREFILL_CHUNKS; e += PREFILL_THREADS) {
      const int row = e / PREFILL_CHUNKS, chunk = e % PREFILL_CHUNKS;
      const int pos = kv_tile * PREFILL_KV_TILE + row;
      const bool valid = pos < kv_len;
      const unsigned short* src = kv;
      if (valid)
        src = kv + page_table[pos / PA_PAGE] * PA_PAGE_STRIDE + (long long)kv_head * PA_SLICE + (pos % PA_PAGE) * PA_D +
              chunk * 8;
      cp_async_16(&sh.k[buffer][row][chunk * 8], src, valid);
      cp_async_16(&sh.v[buffer][row][chunk * 8], src + (valid ? PA_KVH * PA_SLICE : 0), valid);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  load_tile(0, 0);

  // q fragments as hi + lo fp16 pairs, pre-scaled so scores come out in base 2.
  const float q_scale = 1.4426950408889634f * rsqrtf((float)PA_D);
  unsigned q_hi[PA_D / 16][4], q_lo[PA_D / 16][4];
#pragma unroll
  for (int ks = 0; ks < PA_D / 16; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int token = t0 + g + 8 * (r & 1), col = 16 * ks + 8 * (r >> 1) + 2 * c;
      float2 x = make_float2(0.0f, 0.0f);
      if (token < num_tokens) x = *reinterpret_cast<const float2*>(q + (size_t)token * NQ_NUM_HEADS * PA_D + head * PA_D + col);
      x.x *= q_scale, x.y *= q_scale;
      q_hi[ks][r] = pack_half2_rn(x.x, x.y);
      const float2 back = half2_to_float2(q_hi[ks][r]);
      q_lo[ks][r] = pack_half2_rn(x.x - back.x, x.y - back.y);
    }
  }

  float o[PA_D / 8][4];
#pragma unroll
  for (int n = 0; n < PA_D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float row_max[2] = {NEGATIVE_INFINITY, NEGATIVE_INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int query_pos[2] = {start_pos + t0 + g, start_pos + t0 + g + 8};

  for (int j = 0; j < kv_tiles; ++j) {
    const int buffer = j & 1;
    if (j + 1 < kv_tiles) {
      load_tile(j + 1, buffer ^ 1);
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();  // every thread's copies of tile j have landed

    // Scores: s[n] is the 16 x 8 slab of positions j*64 + 8n .. +7.
    float s[PREFILL_KV_TILE / 8][4];
#pragma unroll
    for (int n = 0; n < PREFILL_KV_TILE / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < PA_D / 16; ++ks) {
#pragma unroll
      for (int n = 0; n < PREFILL_KV_TILE / 8; n += 2) {
        // Four 8x8 matrices: positions 8n.. and 8n+8.., dims 16ks.. and 16ks+8..
        const int m = lane >> 3;
        unsigned b[4];
        ldmatrix_x4(b, &sh.k[buffer][8 * n + (lane & 7) + 8 * (m >> 1)][16 * ks + 8 * (m & 1)]);
        mma_16816(s[n], q_lo[ks], b[0], b[1]);
        mma_16816(s[n], q_hi[ks], b[0], b[1]);
        mma_16816(s[n + 1], q_lo[ks], b[2], b[3]);
        mma_16816(s[n + 1], q_hi[ks], b[2], b[3]);
      }
    }
    // Causal mask, only on tiles that reach past the block's first query position.
    if ((j + 1) * PREFILL_KV_TILE - 1 > start_pos + t0) {
#pragma unroll
      for (int n = 0; n < PREFILL_KV_TILE / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int pos = j * PREFILL_KV_TILE + 8 * n + 2 * c + (r & 1);
          if (pos > query_pos[r >> 1]) s[n][r] = NEGATIVE_INFINITY;
        }
    }
    // Online softmax for the thread's two rows; a row's 64 scores sit in 4 lanes (same g).
    float rescale[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = NEGATIVE_INFINITY;
#pragma unroll
      for (int n = 0; n < PREFILL_KV_TILE / 8; ++n) tile_max = fmaxf(tile_max, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 2));
      const float new_max = fmaxf(row_max[half], tile_max);  // finite: position 0 is in tile 0
      rescale[half] = fast_exp2(row_max[half] - new_max);
      row_max[half] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < PREFILL_KV_TILE / 8; ++n) {
        s[n][2 * half] = fast_exp2(s[n][2 * half] - new_max);
        s[n][2 * half + 1] = fast_exp2(s[n][2 * half + 1] - new_max);
        sum += s[n][2 * half] + s[n][2 * half + 1];
      }
      row_sum[half] = row_sum[half] * rescale[half] + sum;
    }
#pragma unroll
    for (int n = 0; n < PA_D / 8; ++n) {
      o[n][0] *= rescale[0], o[n][1] *= rescale[0];
      o[n][2] *= rescale[1], o[n][3] *= rescale[1];
    }
    // o += p V. The score slabs 2kk and 2kk+1 are exactly the A fragment of positions
    // 16kk..16kk+15, so p never leaves registers.
#pragma unroll
    for (int kk = 0; kk < PREFILL_KV_TILE / 16; ++kk) {
      const unsigned a[4] = {pack_half2_rn(s[2 * kk][0], s[2 * kk][1]), pack_half2_rn(s[2 * kk][2], s[2 * kk][3]),
                             pack_half2_rn(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_half2_rn(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < PA_D / 8; n += 2) {
        // Transposed loads: positions 16kk.. and 16kk+8.., dims 8n.. and 8n+8..
        const int m = lane >> 3;
        unsigned b[4];
        ldmatrix_x4_trans(b, &sh.v[buffer][16 * kk + (lane & 7) + 8 * (m & 1)][8 * n + 8 * (m >> 1)]);
        mma_16816(o[n], a, b[0], b[1]);
        mma_16816(o[n + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this buffer before the next load refills it
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(FULL_MASK, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(FULL_MASK, row_sum[half], 2);
    const int token = t0 + g + 8 * half;
    if (token < num_tokens) {
      const float inv = 1.0f / row_sum[half];
      unsigned* dst = reinterpret_cast<unsigned*>(out + (size_t)token * NQ_NUM_HEADS * PA_D + head * PA_D + 2 * c);
#pragma unroll
      for (int n = 0; n < PA_D / 8; ++n) dst[4 * n] = pack_half2_rn(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
    }
  }
}
