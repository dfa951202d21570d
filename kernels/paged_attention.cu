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
#include "paged_attention.cuh"

#ifndef PA_DECODE_KERNEL
#define PA_DECODE_KERNEL paged_attention_decode
#endif

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
  const int splits = gridDim.x;
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
  const auto [num_pages, pages_per_split, active_splits] = divide_sequence(seq_len, splits);
  // The busy blocks are the grid's first KVH x active_splits in launch order (x fastest): the
  // block scheduler deals consecutive blocks to different SMs, so they spread over all of them.
  // Numbered (split, KV head) = (x, y) instead, the busy splits of each head are the first of
  // its row, and the later heads' land on the SMs the earlier heads' took.
  const int block = blockIdx.x + blockIdx.y * splits;
  if (seq_len <= 0 || block >= PA_KVH * active_splits) {
    wait_for_previous_kernel();  // an idle block waits too, or the chain of completions breaks
    return;  // the whole block: no barrier yet
  }
  const int kv_head = block / active_splits, split = block % active_splits;
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

  // Producer: page i of the block into stage i % DECODE_STAGES (round i / DECODE_STAGES).
  const unsigned short* head_base = kv + (long long)kv_head * PA_SLICE;
  auto copy_page = [&](int i) {
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
  };
  // The pages wholly before the step's first new position were written by earlier steps, never by a
  // kernel of this one (which writes only the new rows): the first stages' worth of them are
  // requested before the wait, so that at long contexts the cache streams in while q|k|v finishes.
  int pages_ahead = 0;
  if (warp == 0) {
    const int finished_pages = (seq_len - row - 1) / PA_PAGE;  // pages before row 0's new token
    pages_ahead = max(0, min(min(block_pages, DECODE_STAGES), finished_pages - first_page));
    for (int i = 0; i < pages_ahead; ++i) copy_page(i);
  }
  wait_for_previous_kernel();  // q and the new token's K/V are rope_write_kv's

  if (warp == 0) {  // ------------------------------------------------ producer
    for (int i = pages_ahead; i < block_pages; ++i) copy_page(i);
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

  store_consumer_totals(consumer, lane, one_page, active_splits, kv_head, split_row_of(kv_head, split, splits), m, l, o,
                        sh.warp_max, sh.warp_sum, sh.warp_acc, out, partial_max_sum, partial_acc);
  if (one_page) {
    trace_block_done(TRACED_ATTENTION, WARP_SIZE);  // consumer warp 0, the block's last
    return;
  }
  named_barrier_sync<DECODE_CONSUMER_THREADS>(DECODE_CONSUMERS_BARRIER);  // the producer, maybe gone, is not waited for
  for (int e = threadIdx.x - WARP_SIZE; e < PA_GQA * PA_D; e += DECODE_CONSUMER_THREADS)
    merge_consumer_element(e, active_splits, kv_head, split_row_of(kv_head, split, splits), sh.warp_max, sh.warp_sum,
                           sh.warp_acc, out, partial_max_sum, partial_acc);
  trace_block_done(TRACED_ATTENTION, WARP_SIZE);
}

// ---------------------------------------------------------------- combine

constexpr int COMBINE_THREADS = COMBINE_WARPS * WARP_SIZE;
constexpr int COMBINE_MAX_SPLITS = 4096;
__device__ int paged_attention_combine_threads = COMBINE_THREADS;
__device__ int paged_attention_combine_max_splits = COMBINE_MAX_SPLITS;

// Grid (GQA, num_kv_heads): block (h, kv head) merges query head kv_head * GQA + h over the
// splits the decode kernel left (combine_head). Launched right after the decode kernel with the
// same seq_len; nothing to do if one split held the whole sequence.
// (The minimum of one block per SM lets ptxas hold several splits' loads in registers at once:
// with the default it kept to 32 registers and waited for each split's loads before the next's.)
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS, 1)
paged_attention_combine(const int* seq_len_ptr, const float* partial_max_sum,
                        const float* partial_acc, int splits, unsigned short* __restrict__ out) {
  __shared__ CombineShared sh;
  let_next_kernel_launch();
  const int row = blockIdx.z;  // a verify pass's row, as in the decode kernel
  partial_max_sum += (long long)row * PA_KVH * splits * PA_GQA * 2;
  partial_acc += (long long)row * PA_KVH * splits * PA_GQA * PA_D;
  out += (long long)row * PA_KVH * PA_GQA * PA_D;
  const int seq_len = *seq_len_ptr + row;  // a step input, as in the decode kernel: read before the wait
  const int active_splits = divide_sequence(seq_len, splits).active_splits;
  wait_for_previous_kernel();  // before the early exits: the partials are the decode kernel's
  if (seq_len <= 0) return;
  if (active_splits == 1) return;  // the decode kernel wrote the output itself
  combine_head(blockIdx.x, blockIdx.y, threadIdx.x / WARP_SIZE, threadIdx.x % WARP_SIZE, splits, active_splits,
               partial_max_sum, partial_acc, out, sh, [] { __syncthreads(); });
  trace_block_done(TRACED_COMBINE, 0);
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
