// paged_attention.cu: causal GQA attention over the paged KV cache, decode and prefill.
//
// The cache of one layer, as the kernels see it (ARCHITECTURE.md, "Paged KV cache"):
//
//     kv  fp16 [num_pages, 2, NQ_NUM_KV_HEADS, 16, NQ_HEAD_DIM]     (index 1: 0 = K, 1 = V)
//
// so one page slice (one page, K or V, one KV head) is 16 x head_dim contiguous halves: 4 KiB
// at head_dim 128, one bulk copy. Position p of a sequence lives in page table[p / 16], row
// p % 16. The CPU reference is nanoqwen.reference.ops.paged_attention.
//
// Decode (one new token, `paged_attention_decode`) is warp-specialized. Block (split, kv
// head) has one producer warp, which asks the copy engine for the K and V slices of its pages
// (cp.async.bulk, completing on an mbarrier), and DECODE_CONSUMER_WARPS consumer warps, which
// compute scores, an online softmax and the weighted sum of V for all GQA query heads that
// share the KV head, from that one copy, on the tensor cores (decode_page). DECODE_STAGES
// shared-memory stages let the copies of the next pages fly while the consumers work. Long
// sequences are cut into page ranges, one per block, and a second small kernel,
// `paged_attention_combine`, merges the ranges (flash-decoding), one block per query head so
// the merge itself is spread over the GPU.
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
  unsigned short kv[DECODE_STAGES][2][DECODE_SLICE];  // bulk-copy destinations (offset 0: 128-byte aligned)
  unsigned long long full[DECODE_STAGES];             // "stage holds its page": expect_tx + copy bytes
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
// Why not a second mbarrier, as full[s] is: it works on the hardware, but compute-sanitizer's
// racecheck (2025.3) does not see that ordering: it reports a WAR on a ring that releases its
// stages that way (a consumer lane's read, then the refill's write), so it could not tell this
// kernel from the broken one. bar.arrive/bar.sync are the hardware barriers __syncthreads is
// made of, which racecheck models.
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
// a __syncwarp follows decode_page): every lane's reads are ordered before the refill by the
// warp's arrival.
#define CONSUMER_RELEASE_STAGE(stage) named_barrier_arrive<DECODE_STAGE_BARRIER_THREADS>(DECODE_EMPTY_BARRIER0 + (stage))
#endif

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
struct DecodeQuery {
  unsigned a[DECODE_Q_TERMS][PA_D / 16][4];
};

__device__ __forceinline__ void load_decode_query(const float* q_group, int lane, DecodeQuery& query) {
  const int g = lane >> 2, t = lane & 3;
  const float q_scale = 1.4426950408889634f * rsqrtf((float)PA_D);  // log2(e): softmax in base 2
#pragma unroll
  for (int ks = 0; ks < PA_D / 16; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a0: row g, dims 16ks + 2t; a1: row g + 8; a2, a3: dims + 8
      const int head = DECODE_LO_ROWS ? g : g + 8 * (r & 1), dim = 16 * ks + 8 * (r >> 1) + 2 * t;
      float2 x = make_float2(0.0f, 0.0f);  // rows past the group's heads multiply as zeros
      if (head < PA_GQA) x = *reinterpret_cast<const float2*>(q_group + head * PA_D + dim);
      x.x *= q_scale, x.y *= q_scale;
      const unsigned hi = pack_half2_rn(x.x, x.y);
      const float2 back = half2_to_float2(hi);
      const unsigned lo = pack_half2_rn(x.x - back.x, x.y - back.y);
      if constexpr (DECODE_LO_ROWS) {
        query.a[0][ks][r] = r & 1 ? lo : hi;
      } else {
        query.a[0][ks][r] = hi;
        query.a[1][ks][r] = lo;
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
__device__ __forceinline__ void decode_page(const unsigned short* k_slice, const unsigned short* v_slice, int valid_rows,
                                            const DecodeQuery& query, float (&m)[2], float (&l)[2],
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
      mma_16816(s[0], query.a[term][ks], b[0], b[1]);
      mma_16816(s[1], query.a[term][ks], b[2], b[3]);
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
PA_DECODE_KERNEL(const float* q,                              // [rows, num_heads * D] fp32, RoPE'd
                 const unsigned short* kv,                    // one layer's pool, fp16
                 const int* __restrict__ page_table,          // [max_pages_per_seq]
                 const int* seq_len_ptr,                      // [1] positions row 0 attends to
                 unsigned short* __restrict__ out,            // [rows, num_heads * D] fp16
                 float* __restrict__ partial_max_sum,         // [rows, KVH, splits, GQA, 2]
                 float* __restrict__ partial_acc) {           // [rows, KVH, splits, GQA, D]
  extern __shared__ __align__(128) unsigned char shared_raw[];
  DecodeShared& sh = *reinterpret_cast<DecodeShared*>(shared_raw);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int split = blockIdx.x, kv_head = blockIdx.y, splits = gridDim.x;
  // A verify pass (gridDim.z rows, one new token each) attends row r at position seq_len + r - 1,
  // over one position more than row r - 1: causal among the new rows, each row a decode step's.
  const int row = blockIdx.z;
  q += (long long)row * PA_KVH * PA_GQA * PA_D;
  out += (long long)row * PA_KVH * PA_GQA * PA_D;
  partial_max_sum += (long long)row * PA_KVH * splits * PA_GQA * 2;
  partial_acc += (long long)row * PA_KVH * splits * PA_GQA * PA_D;
  let_next_kernel_launch();
  // The sequence length and the page table are the step's inputs, set before the step began (by
  // the host, or by the previous step's argmax_select_next) and written by no kernel of this
  // step: the block reads them, picks its pages and sets up its barriers while rope_write_kv
  // still runs, so that after the wait the first copies and q are one round trip away.
  const int seq_len = *seq_len_ptr + row;
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
      if (lane == 0) mbar_arrive_expect_tx(&sh.full[stage], 2 * PA_SLICE_BYTES);  // armed before any byte lands
      __syncwarp();
      if (lane < DECODE_COPIES) {  // lane r copies run r of K and of V
        const unsigned short* k_run = head_base + page * PA_PAGE_STRIDE + lane * DECODE_COPY_ROWS * PA_D;
        bulk_copy_to_shared(sh.kv[stage][0] + lane * DECODE_RUN, k_run, DECODE_COPY_BYTES, &sh.full[stage]);
        bulk_copy_to_shared(sh.kv[stage][1] + lane * DECODE_RUN, k_run + PA_KVH * PA_SLICE, DECODE_COPY_BYTES,
                            &sh.full[stage]);
      }
      PRODUCER_AFTER_ISSUE(stage, round);
    }
    return;  // the copies land on their own; the consumers wait for them
  }

  // ---------------------------------------------------------------- consumers
  const int consumer = warp - 1;
  // A block of one page (every block, at the benchmark's context) has its whole result in
  // consumer warp 0, which writes it from registers: the other consumers have nothing to add,
  // and the merge through shared memory below is skipped.
  const bool one_page = block_pages == 1;
  if (one_page && consumer > 0) return;
  DecodeQuery query;
  load_decode_query(q + kv_head * PA_GQA * PA_D, lane, query);
  float m[2] = {NEGATIVE_INFINITY, NEGATIVE_INFINITY}, l[2] = {0.0f, 0.0f}, o[PA_D / 8][4] = {};
  for (int i = consumer; i < block_pages; i += DECODE_CONSUMER_WARPS) {
    const int stage = i % DECODE_STAGES, round = i / DECODE_STAGES;
    CONSUMER_WAIT_STAGE_FULL(stage, round);
    const int valid_rows = min(PA_PAGE, seq_len - (first_page + i) * PA_PAGE);
    decode_page(sh.kv[stage][0], sh.kv[stage][1], valid_rows, query, m, l, o, lane);
    __syncwarp();  // every lane has read the stage before the warp releases it, converged
    if (i + DECODE_STAGES < block_pages) CONSUMER_RELEASE_STAGE(stage);  // only a stage that will be refilled
  }

  // This warp's totals: l over the 16 rows (the 4 lanes of a head hold 4 rows each). Rows g and
  // g + 8 of the fragments are heads g and g + 8; the rows past the group's heads are not kept.
  const int g = lane >> 2, t = lane & 3;
  const size_t split_row = ((size_t)kv_head * splits + split) * PA_GQA;
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
        *reinterpret_cast<float2*>(&sh.warp_acc[consumer][h][d]) = value;
      } else if (active_splits == 1) {
        *reinterpret_cast<unsigned*>(out + (kv_head * PA_GQA + h) * PA_D + d) =
            pack_half2_rn(value.x / l[half], value.y / l[half]);
      } else {
        *reinterpret_cast<float2*>(partial_acc + (split_row + h) * PA_D + d) = value;
      }
    }
    if (t == 0) {
      if (!one_page) {
        sh.warp_max[consumer][h] = m[half], sh.warp_sum[consumer][h] = l[half];
      } else if (active_splits > 1) {
        partial_max_sum[2 * (split_row + h)] = m[half], partial_max_sum[2 * (split_row + h) + 1] = l[half];
      }
    }
  }
  if (one_page) return;
  named_barrier_sync<DECODE_CONSUMER_THREADS>(DECODE_CONSUMERS_BARRIER);  // the producer, maybe gone, is not waited for

  // Combine the consumer warps (a warp without pages has max -inf and weighs 0), then either
  // finish (one block holds the whole sequence) or leave this split's share for the combine.
  for (int e = threadIdx.x - WARP_SIZE; e < PA_GQA * PA_D; e += DECODE_CONSUMER_THREADS) {
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
  const int row = blockIdx.z;  // a verify pass's row, as in the decode kernel
  partial_max_sum += (long long)row * PA_KVH * splits * PA_GQA * 2;
  partial_acc += (long long)row * PA_KVH * splits * PA_GQA * PA_D;
  out += (long long)row * PA_KVH * PA_GQA * PA_D;
  const int seq_len = *seq_len_ptr + row;  // a step input, as in the decode kernel: read before the wait
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
