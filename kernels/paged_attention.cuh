// paged_attention.cuh: the device pieces of decode attention over the paged KV cache, shared by
// the attention kernels (paged_attention.cu) and the persistent decode kernel (decode_persistent.cu).
//
// The cache of one layer: kv fp16 [num_pages, 2, NQ_NUM_KV_HEADS, 16, NQ_HEAD_DIM] (index 1: 0 = K,
// 1 = V); paged_attention.cu's header says how the kernels walk it.
#pragma once
#include "common.cuh"

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

// mbarriers, the bulk copy and named barriers.
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

// Tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulate) and the shared-memory loads that
// feed them: used by decode and prefill alike.
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

// ====================================================================== decode

constexpr int DECODE_CONSUMER_WARPS = 4;
constexpr int DECODE_STAGES = 8;
constexpr int DECODE_THREADS = WARP_SIZE * (1 + DECODE_CONSUMER_WARPS);
constexpr int DECODE_CONSUMER_THREADS = WARP_SIZE * DECODE_CONSUMER_WARPS;
// A page's arithmetic runs on the tensor cores with the query heads as the 16 rows of the mma's A
// operand (rows 0-7, and 8-15 only where a KV head serves more than 8 query heads), so the GQA
// group must fit in them.
constexpr int DECODE_HEAD_ROWS = 16;
static_assert(PA_GQA <= DECODE_HEAD_ROWS, "the decode kernel serves at most 16 query heads per KV head");
// A stage's K (or V) slice in shared memory: the page's 16 rows in runs of DECODE_COPY_ROWS, one
// bulk copy each, with 16 bytes of padding after every run. An ldmatrix reads 8 rows at one
// column; rows 256 bytes apart all start in the same bank, so unpadded (one 4 KiB copy) the 8
// reads are an 8-way bank conflict. Padding after every row removes it but needs 16 copies per
// slice, and many small copies cost the copy engine more than the conflicts: runs of 4 rows
// leave a 2-way conflict for 4 copies per slice.
constexpr int DECODE_COPY_ROWS = 4;
constexpr int DECODE_COPIES = PA_PAGE / DECODE_COPY_ROWS;  // per slice
constexpr int DECODE_RUN = DECODE_COPY_ROWS * PA_D + 8;    // halves from one run to the next
constexpr int DECODE_SLICE = DECODE_COPIES * DECODE_RUN;   // halves of a slice in shared memory
constexpr int DECODE_COPY_BYTES = DECODE_COPY_ROWS * PA_D * 2;
static_assert(PA_PAGE % DECODE_COPY_ROWS == 0 && DECODE_COPIES <= WARP_SIZE, "a page splits into whole runs, one per lane");
static_assert((DECODE_RUN * 2) % 16 == 0, "bulk copies land on 16-byte boundaries");
__device__ __forceinline__ int stage_row(int row) {  // halves from the slice's start to page row `row`
  return row / DECODE_COPY_ROWS * DECODE_RUN + row % DECODE_COPY_ROWS * PA_D;
}
// The query of one consumer warp as mma A fragments (A's rows are heads, its k axis head_dim),
// pre-scaled by head_dim^-0.5 * log2(e) so that scores come out in base 2, and split in two fp16
// terms, q = hi + lo, so that the scores carry q's fp32 precision (as in prefill). Fragment
// notation (PTX mma.m16n8k16): lane = 4 g + t; a thread holds rows g and g + 8. With at most 8
// heads per KV head (the 7B has 7), row g holds head g's hi term and row g + 8 its lo term, so one
// mma gives both halves of a score in the same lane (DECODE_LO_ROWS); with more, rows g and g + 8
// are heads g and g + 8, and the lo terms take a second set of fragments and a second mma.
constexpr bool DECODE_LO_ROWS = PA_GQA <= 8;
constexpr int DECODE_Q_TERMS = DECODE_LO_ROWS ? 1 : 2;  // fragment sets: hi|lo, or hi and lo
constexpr int DECODE_HEAD_HALVES = DECODE_LO_ROWS ? 1 : 2;  // rows g (and g + 8) are heads
// Fragment r (0-3) of term `term` at k step ks is query.at(term, ks, r, lane): in registers
// (DecodeQuery, the decode kernel's), or in shared memory, a warp's fragments a word per lane
// (SharedDecodeQuery: the persistent kernel's consumer warps keep registers for everything else).
struct DecodeQuery {
  unsigned a[DECODE_Q_TERMS][PA_D / 16][4];
  __device__ __forceinline__ unsigned& at(int term, int ks, int r, int) { return a[term][ks][r]; }
  __device__ __forceinline__ unsigned at(int term, int ks, int r, int) const { return a[term][ks][r]; }
};
struct SharedDecodeQuery {
  unsigned a[DECODE_Q_TERMS][PA_D / 16][4][WARP_SIZE];
  __device__ __forceinline__ unsigned& at(int term, int ks, int r, int lane) { return a[term][ks][r][lane]; }
  __device__ __forceinline__ unsigned at(int term, int ks, int r, int lane) const { return a[term][ks][r][lane]; }
};

template <typename Query>
__device__ __forceinline__ void load_decode_query(const float* q_group, int lane, Query& query) {
  const int g = lane >> 2, t = lane & 3;
  const float q_scale = 1.4426950408889634f * rsqrtf((float)PA_D);  // log2(e): softmax in base 2
#pragma unroll
  for (int ks = 0; ks < PA_D / 16; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a0: row g, dims 16ks + 2t; a1: row g + 8; a2, a3: dims + 8
      const int head = DECODE_LO_ROWS ? g : g + 8 * (r & 1), dim = 16 * ks + 8 * (r >> 1) + 2 * t;
      float2 x = make_float2(0.0f, 0.0f);  // rows past the group's heads multiply as zeros
      if (head < PA_GQA) x = __ldcg(reinterpret_cast<const float2*>(q_group + head * PA_D + dim));  // an earlier kernel's (block's)
      x.x *= q_scale, x.y *= q_scale;
      const unsigned hi = pack_half2_rn(x.x, x.y);
      const float2 back = half2_to_float2(hi);
      const unsigned lo = pack_half2_rn(x.x - back.x, x.y - back.y);
      if constexpr (DECODE_LO_ROWS) {
        query.at(0, ks, r, lane) = r & 1 ? lo : hi;
      } else {
        query.at(0, ks, r, lane) = hi;
        query.at(1, ks, r, lane) = lo;
      }
    }
  }
}

// One consumer warp's page on the tensor cores: S = q K^T for the 16 rows (heads x rows), the
// online-softmax update, O += P V (heads x head_dim). Lane (g, t) holds, for head g (and g + 8):
// the scores of rows 2t, 2t + 1, 8 + 2t, 8 + 2t + 1; m, the running max (the same in the 4 lanes
// of a head); l, the running sum over its own 4 rows of every page; o[n], the running weighted
// sum at dims 8n + 2t, 8n + 2t + 1. The score fragments are, packed to fp16, exactly P's A
// fragments, so the probabilities never leave registers. `k_slice`, `v_slice`: the stage's slices
// (rows at stage_row); rows from `valid_rows` on are past the sequence and may hold anything, NaN
// included: their scores are replaced by -inf (a selection, never arithmetic) and their V by
// zeros before the multiply, since 0 x NaN would be NaN.
template <typename Query>
__device__ __forceinline__ void decode_page(const unsigned short* k_slice, const unsigned short* v_slice, int valid_rows,
                                            const Query& query, float (&m)[2], float (&l)[2],
                                            float (&o)[PA_D / 8][4], int lane) {
  const int t = lane & 3, matrix = lane >> 3, matrix_row = lane & 7;
  // This lane's row address for the ldmatrix: K's matrices are rows 0-7 and 8-15 (matrix >> 1),
  // V's (transposed) the same rows by matrix & 1.
  const unsigned short* k_row = k_slice + stage_row(matrix_row + 8 * (matrix >> 1)) + 8 * (matrix & 1);
  const unsigned short* v_row = v_slice + stage_row(matrix_row + 8 * (matrix & 1)) + 8 * (matrix >> 1);
  float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};  // rows 0-7, rows 8-15
#pragma unroll
  for (int ks = 0; ks < PA_D / 16; ++ks) {
    unsigned b[4];  // four 8x8 matrices: rows 0-7 and 8-15 at dims 16ks.. and 16ks + 8..
    ldmatrix_x4(b, k_row + 16 * ks);
#pragma unroll
    for (int term = DECODE_Q_TERMS - 1; term >= 0; --term) {  // the small lo terms first
      const unsigned a[4] = {query.at(term, ks, 0, lane), query.at(term, ks, 1, lane), query.at(term, ks, 2, lane),
                             query.at(term, ks, 3, lane)};
      mma_16816(s[0], a, b[0], b[1]);
      mma_16816(s[1], a, b[2], b[3]);
    }
  }
  if constexpr (DECODE_LO_ROWS) {  // head g's score: its hi row's sum plus its lo row's
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] += s[n][2], s[n][1] += s[n][3], s[n][2] = s[n][3] = 0.0f;
  }
  float rescale[2] = {1.0f, 1.0f};
#pragma unroll
  for (int half = 0; half < DECODE_HEAD_HALVES; ++half) {  // head g (fragment elements 0, 1), head g + 8 (2, 3)
    float page_max = NEGATIVE_INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& score = s[n][2 * half + e];
        score = 8 * n + 2 * t + e < valid_rows ? score : NEGATIVE_INFINITY;
        page_max = fmaxf(page_max, score);
      }
    page_max = fmaxf(page_max, __shfl_xor_sync(FULL_MASK, page_max, 1));
    page_max = fmaxf(page_max, __shfl_xor_sync(FULL_MASK, page_max, 2));
    const float new_max = fmaxf(m[half], page_max);  // finite: row 0 of a page is always valid
    rescale[half] = fast_exp2(m[half] - new_max);
    m[half] = new_max;
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& score = s[n][2 * half + e];
        score = fast_exp2(score - new_max);
        sum += score;
      }
    l[half] = l[half] * rescale[half] + sum;
  }
#pragma unroll
  for (int n = 0; n < PA_D / 8; ++n) {
    o[n][0] *= rescale[0], o[n][1] *= rescale[0];
    if constexpr (!DECODE_LO_ROWS) o[n][2] *= rescale[1], o[n][3] *= rescale[1];  // else rows of no head: zeros
  }
  const unsigned p[4] = {pack_half2_rn(s[0][0], s[0][1]), pack_half2_rn(s[0][2], s[0][3]),
                         pack_half2_rn(s[1][0], s[1][1]), pack_half2_rn(s[1][2], s[1][3])};
  // V's B fragments hold rows 2t, 2t + 1 (b0) and 8 + 2t, 8 + 2t + 1 (b1), one per 16-bit half.
  auto keep = [&](int row) { return row < valid_rows ? 0xFFFFu : 0u; };
  const unsigned keep_low = keep(2 * t) | keep(2 * t + 1) << 16, keep_high = keep(8 + 2 * t) | keep(9 + 2 * t) << 16;
#pragma unroll
  for (int n = 0; n < PA_D / 8; n += 2) {
    unsigned b[4];  // transposed: rows 0-7 and 8-15 at dims 8n.. and 8n + 8..
    ldmatrix_x4_trans(b, v_row + 8 * n);
    mma_16816(o[n], p, b[0] & keep_low, b[1] & keep_high);
    mma_16816(o[n + 1], p, b[2] & keep_low, b[3] & keep_high);
  }
}

// ---------------------------------------------------------------- the division of a sequence
// How a decode grid of `splits` blocks per KV head, which nanoqwen.cuda.attention (decode_splits)
// sizes for two blocks per SM, divides a sequence of `seq_len` positions. While its pages fit the
// grid, each gets a block: short contexts are latency-bound, and a one-page block skips the merge of
// its consumer warps. A longer sequence is cut into equal runs for half the grid, one block per SM:
// fewer, longer blocks leave the combine half the partials, and at 4K and 16K positions they beat
// two blocks per SM, even two whose shallower rings fit an SM beside the GEMVs' blocks (chapter 5
// and the experiments appendix give the figures). The decode kernel, the combine and the persistent
// kernel all divide with it; nanoqwen.cuda.attention.split_pages is the same rule on the host.
struct SequenceDivision {
  int num_pages;        // pages the sequence touches
  int pages_per_split;  // pages of every block but the last busy one
  int active_splits;    // blocks with pages
};

__host__ __device__ __forceinline__ SequenceDivision divide_sequence(int seq_len, int splits) {
  const int num_pages = (seq_len + PA_PAGE - 1) / PA_PAGE;
  const int half_grid = (splits + 1) / 2;
  const int pages_per_split = num_pages <= splits ? 1 : (num_pages + half_grid - 1) / half_grid;
  return {num_pages, pages_per_split, (num_pages + pages_per_split - 1) / pages_per_split};
}

// ---------------------------------------------------------------- a block's result
// Row of a split's partials for KV head kv_head: [num_kv_heads, splits, GQA, ...].
__device__ __forceinline__ size_t split_row_of(int kv_head, int split, int splits) {
  return ((size_t)kv_head * splits + split) * PA_GQA;
}

// A consumer warp's totals after its pages (decode_page's m, l, o). l is summed over the 16 rows
// (the 4 lanes of a head hold 4 rows each). Rows g and g + 8 of the fragments are heads g and g + 8;
// the rows past the group's heads are not kept. A block of one page has its whole result in
// consumer warp 0, which writes it from registers (the finished output where one split holds the
// sequence, else this split's partials); otherwise each warp parks its share in the block's
// warp_max, warp_sum and warp_acc for merge_consumer_element.
__device__ __forceinline__ void store_consumer_totals(int consumer, int lane, bool one_page, int active_splits,
                                                      int kv_head, size_t split_row, const float (&m)[2], float (&l)[2],
                                                      const float (&o)[PA_D / 8][4], float (*warp_max)[PA_GQA],
                                                      float (*warp_sum)[PA_GQA], float (*warp_acc)[PA_GQA][PA_D],
                                                      unsigned short* out, float* partial_max_sum, float* partial_acc) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < DECODE_HEAD_HALVES; ++half) {
    l[half] += __shfl_xor_sync(FULL_MASK, l[half], 1);
    l[half] += __shfl_xor_sync(FULL_MASK, l[half], 2);
    const int h = g + 8 * half;
    if (h >= PA_GQA) continue;
#pragma unroll
    for (int n = 0; n < PA_D / 8; ++n) {
      const int d = 8 * n + 2 * t;
      const float2 value = make_float2(o[n][2 * half], o[n][2 * half + 1]);
      if (!one_page) {
        *reinterpret_cast<float2*>(&warp_acc[consumer][h][d]) = value;
      } else if (active_splits == 1) {
        *reinterpret_cast<unsigned*>(out + (kv_head * PA_GQA + h) * PA_D + d) =
            pack_half2_rn(value.x / l[half], value.y / l[half]);
      } else {
        *reinterpret_cast<float2*>(partial_acc + (split_row + h) * PA_D + d) = value;
      }
    }
    if (t == 0) {
      if (!one_page) {
        warp_max[consumer][h] = m[half], warp_sum[consumer][h] = l[half];
      } else if (active_splits > 1) {
        partial_max_sum[2 * (split_row + h)] = m[half], partial_max_sum[2 * (split_row + h) + 1] = l[half];
      }
    }
  }
}

// Element e (head e / head_dim, dim e % head_dim) of a block's result, merged over its consumer
// warps (a warp without pages has max -inf and weighs 0): finished where one split holds the
// sequence, else left as this split's share for the combine.
__device__ __forceinline__ void merge_consumer_element(int e, int active_splits, int kv_head, size_t split_row,
                                                       const float (*warp_max)[PA_GQA], const float (*warp_sum)[PA_GQA],
                                                       const float (*warp_acc)[PA_GQA][PA_D], unsigned short* out,
                                                       float* partial_max_sum, float* partial_acc) {
  const int h = e / PA_D, d = e % PA_D;
  float block_max = NEGATIVE_INFINITY;
#pragma unroll
  for (int c = 0; c < DECODE_CONSUMER_WARPS; ++c) block_max = fmaxf(block_max, warp_max[c][h]);
  float sum = 0.0f, value = 0.0f;
#pragma unroll
  for (int c = 0; c < DECODE_CONSUMER_WARPS; ++c) {
    const float w = fast_exp2(warp_max[c][h] - block_max);
    sum = fmaf(warp_sum[c][h], w, sum);
    value = fmaf(warp_acc[c][h][d], w, value);
  }
  if (active_splits == 1) {
    out[(kv_head * PA_GQA + h) * PA_D + d] = float_to_half(value / sum);
  } else {
    partial_acc[(split_row + h) * PA_D + d] = value;
    if (d == 0) partial_max_sum[2 * (split_row + h)] = block_max, partial_max_sum[2 * (split_row + h) + 1] = sum;
  }
}

// ---------------------------------------------------------------- merging the splits
constexpr int COMBINE_WARPS = 8;  // warp w of a head's merge takes splits w, w + 8, ...
static_assert(PA_D / 4 <= WARP_SIZE, "a warp covers a head's dims 4 at a time");
struct CombineShared {
  float warp_max[COMBINE_WARPS], warp_sum[COMBINE_WARPS];
  float4 warp_acc[COMBINE_WARPS][WARP_SIZE];
};

// Query head kv_head * GQA + h merged over the `active_splits` splits' partials, softmax in base 2:
// with M the largest split max, split s weighs 2^(max_s - M), the denominator is
// sum_s l_s 2^(max_s - M) and the output sum_s acc_s 2^(max_s - M) over it. Each of COMBINE_WARPS
// warps (`warp`) merges its splits in one pass, rescaling its running share whenever a larger max
// arrives (as decode_page does across pages), so a split's (max, sum) and its acc are loaded
// together, a few splits' loads in flight at once; after `barrier()`, which gathers the
// COMBINE_WARPS warps, the first warp merges their shares the same way.
template <typename Barrier>
__device__ __forceinline__ void combine_head(int h, int kv_head, int warp, int lane, int splits, int active_splits,
                                             const float* partial_max_sum, const float* partial_acc,
                                             unsigned short* out, CombineShared& sh, Barrier barrier) {
  const bool has_dims = lane < PA_D / 4;
  const size_t row0 = (size_t)kv_head * splits * PA_GQA + h;  // split s: row0 + s * GQA

  float m = NEGATIVE_INFINITY, l = 0.0f;  // a warp without splits keeps m = -inf: weight 0 below
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
  for (int s = warp; s < active_splits; s += COMBINE_WARPS) {
    const size_t r = row0 + (size_t)s * PA_GQA;
    const float2 max_sum = __ldcg(reinterpret_cast<const float2*>(partial_max_sum + 2 * r));  // every lane, one broadcast
    const float4 v = has_dims ? __ldcg(reinterpret_cast<const float4*>(partial_acc + r * PA_D + 4 * lane)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float new_max = fmaxf(m, max_sum.x);  // finite: a split with pages has a finite max
    const float keep = fast_exp2(m - new_max), weight = fast_exp2(max_sum.x - new_max);
    m = new_max;
    l = fmaf(l, keep, max_sum.y * weight);
    acc.x = fmaf(acc.x, keep, v.x * weight), acc.y = fmaf(acc.y, keep, v.y * weight);
    acc.z = fmaf(acc.z, keep, v.z * weight), acc.w = fmaf(acc.w, keep, v.w * weight);
  }
  if (lane == 0) sh.warp_max[warp] = m, sh.warp_sum[warp] = l;
  sh.warp_acc[warp][lane] = acc;
  barrier();
  if (warp == 0 && has_dims) {
    float total_max = NEGATIVE_INFINITY;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) total_max = fmaxf(total_max, sh.warp_max[w]);
    float denominator = 0.0f;
    float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) {
      const float weight = fast_exp2(sh.warp_max[w] - total_max);  // 0 for a warp without splits
      const float4 g = sh.warp_acc[w][lane];
      denominator = fmaf(sh.warp_sum[w], weight, denominator);
      total.x = fmaf(g.x, weight, total.x), total.y = fmaf(g.y, weight, total.y);
      total.z = fmaf(g.z, weight, total.z), total.w = fmaf(g.w, weight, total.w);
    }
    const float inv = 1.0f / denominator;
    unsigned* dst = reinterpret_cast<unsigned*>(out + (kv_head * PA_GQA + h) * PA_D + 4 * lane);
    dst[0] = pack_half2_rn(total.x * inv, total.y * inv);
    dst[1] = pack_half2_rn(total.z * inv, total.w * inv);
  }
}
