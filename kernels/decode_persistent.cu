// decode_persistent.cu: every layer of a decode step in one kernel launch.
//
// Reference: the launch sequence of nanoqwen/cuda/step.py (decode_step_launches), whose kernels
// compute, layer by layer, norm -> q|k|v + RoPE -> attention -> combine -> o -> norm -> gate+up ->
// down. Each of those kernels ends before the next begins; even started early (programmatic
// dependent launch) a kernel boundary costs a few microseconds, and a layer has eight. At the 7B's
// shapes the chain between the two big MLP GEMVs costs about 20 us a layer for under 4 us of bytes;
// at 0.5B, most of the step is such boundaries.
//
// Here one block per SM walks the same operations in the same order, and an operation waits for
// exactly what it reads, on counters in global memory, instead of for a kernel boundary:
//   done[layer][op]   tiles (attention: units) the operation has finished; the next operation's
//                     blocks spin on it (thread 0, acquire) and release it with one atomic per tile.
// While it waits, a block has already asked for its next weights: its warps' rings are full before
// the operation's input exists.
//
// Every number is the multi-kernel step's bits (tests/test_persistent_cuda.py compares the logits):
// - a GEMV's work is its kernel's (tile, split) pairs with the same split ranges, computed with the
//   same group arithmetic (gemv_int4.cu, group_mma); a warp takes pairs one after another through one
//   ring. The splits of a tile may land in different blocks, so each pair leaves its 16 sums in
//   global memory and the last of a tile's splits to arrive adds them in split order, as the block
//   of the GEMV kernel does (add_splits), and finishes the tile (RoPE and the cache write, the
//   residual update, or SwiGLU);
// - the norm is add_rmsnorm_cluster's: every block that needs the normalized residual computes it,
//   playing the cluster's 8 blocks' threads to add the squares in that kernel's order (norm_into,
//   rmsnorm.cu's normalize_row_in_block);
// - attention is the decode kernel's units (split, KV head), four consumer warps each, with the same
//   pages per consumer and the same merges (paged_attention.cuh), and the combine is its kernel's.
#include "rmsnorm.cu"
#include "gemv_int4.cu"
#include "paged_attention.cuh"

// 12 warps: with 168 registers each, the attention's consumer warps (decode_page's accumulators) and
// the GEMV rings' bookkeeping fit without spilling; 16 warps would leave 128.
constexpr int PERSIST_WARPS = 12;
constexpr int PERSIST_THREADS = 384;
static_assert(PERSIST_THREADS == PERSIST_WARPS * WARP_SIZE, "a persistent block is PERSIST_WARPS warps");
NQ_EXPORT_INT(PERSIST_THREADS)

// The operations of a layer, in the order every block walks them: done[layer * OPS_PER_LAYER + op].
constexpr int OP_QKV = 0;
constexpr int OP_ATTENTION = 1;
constexpr int OP_COMBINE = 2;
constexpr int OP_O = 3;
constexpr int OP_GATE_UP = 4;
constexpr int OP_DOWN = 5;
constexpr int OPS_PER_LAYER = 6;
NQ_EXPORT_INT(OPS_PER_LAYER)

// A layer's device pointers, one row of the layer table (nanoqwen/cuda/persistent.py fills it).
constexpr int LAYER_QKV_QWEIGHT = 0;
constexpr int LAYER_QKV_SCALES = 1;
constexpr int LAYER_QKV_BIAS = 2;
constexpr int LAYER_O_QWEIGHT = 3;
constexpr int LAYER_O_SCALES = 4;
constexpr int LAYER_GATE_UP_QWEIGHT = 5;
constexpr int LAYER_GATE_UP_SCALES = 6;
constexpr int LAYER_DOWN_QWEIGHT = 7;
constexpr int LAYER_DOWN_SCALES = 8;
constexpr int LAYER_INPUT_NORM = 9;
constexpr int LAYER_POST_NORM = 10;
constexpr int LAYER_KV = 11;
constexpr int LAYER_POINTERS = 12;
NQ_EXPORT_INT(LAYER_POINTERS)

constexpr int QKV_TILES = NQ_QKV_DIM / TILE_ROWS;  // RoPE-ordered tiles (gemv_int4_qkv_rope's blocks)
constexpr int HIDDEN_TILES = (NQ_HIDDEN + TILE_ROWS - 1) / TILE_ROWS;
constexpr int MLP_TILES = (NQ_INTERMEDIATE + TILE_ROWS - 1) / TILE_ROWS;
static_assert(NQ_QKV_DIM % TILE_ROWS == 0, "q|k|v tiles are whole RoPE pairs of 8 dims");
NQ_EXPORT_INT(QKV_TILES)  // nanoqwen/cuda/persistent.py sizes the split sums and arrival counters by them
NQ_EXPORT_INT(HIDDEN_TILES)
NQ_EXPORT_INT(MLP_TILES)

// A spin that outlasts this means a counter will never reach its target (a bug, or blocks that are
// not all resident): the kernel traps, and the launch fails, instead of hanging the GPU.
constexpr unsigned long long WAIT_TIMEOUT_NS = 10ull * 1000 * 1000 * 1000;

// ---------------------------------------------------------------- shared memory

// One ring slot of a warp's GEMV: for each of TILES tiles, lane (g, t)'s two 16-byte pieces of
// weights (rows g and g + 8) and the 4-byte words that hold their two scales (a scale is 2 bytes
// at any even address: the aligned word around it is copied, and the half picked at use).
template <int TILES>
struct GemvSlot {
  uint4 weights[TILES][2][WARP_SIZE];
  unsigned int scales[TILES][2][WARP_SIZE];
};

constexpr int X_HALVES = NQ_INTERMEDIATE > NQ_HIDDEN ? (NQ_INTERMEDIATE > NQ_Q_DIM ? NQ_INTERMEDIATE : NQ_Q_DIM)
                                                     : (NQ_HIDDEN > NQ_Q_DIM ? NQ_HIDDEN : NQ_Q_DIM);
constexpr int SHARED_LIMIT = 227 * 1024;  // a Hopper block's dynamic shared memory
constexpr int FIXED_BYTES = X_HALVES * 2 + NQ_HIDDEN * 4 + NORM_VIRTUAL_WARPS * 4 + 64;

// Attention: ATTENTION_QUADS units (split, KV head) at once, four consumer warps each, every warp
// with KV_STAGES pages of K and V in flight and its query fragments in shared memory (in registers
// they would leave too few for the rest). After its pages a quad's consumers merge through
// warp_acc, which lies over the quad's page stages (they are no longer read by then).
constexpr int ATTENTION_QUADS = 2;
template <int KV_STAGES>
struct AttentionQuadOf {
  unsigned short kv[DECODE_CONSUMER_WARPS][KV_STAGES][2][DECODE_SLICE];
  SharedDecodeQuery query[DECODE_CONSUMER_WARPS];
  float warp_max[DECODE_CONSUMER_WARPS][PA_GQA];
  float warp_sum[DECODE_CONSUMER_WARPS][PA_GQA];
};
// Two pages in flight per consumer warp where they fit beside the largest input vector, else one.
constexpr int KV_STAGES = ATTENTION_QUADS * sizeof(AttentionQuadOf<2>) <= SHARED_LIMIT - FIXED_BYTES ? 2 : 1;
using AttentionQuad = AttentionQuadOf<KV_STAGES>;
static_assert(sizeof(AttentionQuad::kv) >= sizeof(float) * DECODE_CONSUMER_WARPS * PA_GQA * PA_D,
              "a quad's merge lies over its page stages");
constexpr int COMBINE_GROUPS = PERSIST_WARPS / COMBINE_WARPS;  // heads merged at once
static_assert(ATTENTION_QUADS * DECODE_CONSUMER_WARPS <= PERSIST_WARPS, "quads are the block's warps");

constexpr int RING_BUDGET = (SHARED_LIMIT - FIXED_BYTES) / PERSIST_WARPS;  // bytes per warp
constexpr int min_int(int a, int b) { return a < b ? a : b; }
// Groups in a warp's ring: 12 for the one-tile GEMVs, 6 for gate+up's two tiles (15 KB a warp), fewer
// where the largest input vector leaves less room (the 32B's MLP, 27648 wide).
constexpr int SPLIT_STAGES = min_int(12, RING_BUDGET / (int)sizeof(GemvSlot<1>));
constexpr int PAIR_STAGES = min_int(6, RING_BUDGET / (int)sizeof(GemvSlot<2>));
static_assert(SPLIT_STAGES >= 2 && PAIR_STAGES >= 2, "the largest input vector leaves no room for the rings");

// The step's inputs, read from the decode state once by thread 0 and from shared memory where used.
struct StepInputs {
  int position, seq_len;
  int pages_per_split, active_splits;  // the attention's division of the sequence
};

struct PersistentShared {
  uint4 x[X_HALVES / 8];  // the operation's input vector, fp16
  float4 residual[RMS_VECTORS];  // the norm's row, read from L2 in one round trip
  float norm_sums[NORM_VIRTUAL_WARPS];
  StepInputs step;
  union {
    GemvSlot<1> split_rings[PERSIST_WARPS][SPLIT_STAGES];
    GemvSlot<2> pair_rings[PERSIST_WARPS][PAIR_STAGES];
    AttentionQuad quads[ATTENTION_QUADS];
    CombineShared combines[COMBINE_GROUPS];
  } work;
};
static_assert(sizeof(PersistentShared) <= SHARED_LIMIT, "the persistent kernel's shared memory exceeds an SM's");
__device__ int decode_persistent_smem_bytes = sizeof(PersistentShared);  // read by the host to launch

// Named barriers: 0 is __syncthreads; 1 + q gathers attention quad q, 1 + ATTENTION_QUADS + c
// combine group c.
constexpr int QUAD_BARRIER0 = 1;
constexpr int COMBINE_BARRIER0 = QUAD_BARRIER0 + ATTENTION_QUADS;
static_assert(COMBINE_BARRIER0 + COMBINE_GROUPS <= 16, "a block has 16 named barriers");

// ---------------------------------------------------------------- counters

// A value read again at each use (a volatile load): the compiler keeps no register for it across
// the code between, where the attention's consumers need every register.
__device__ __forceinline__ int step_value(const int& field) { return *reinterpret_cast<const volatile int*>(&field); }

// Column `column` of the layer table's row `layer`, loaded where it is used, for the same reason.
template <typename T>
__device__ __forceinline__ T* layer_pointer(const unsigned long long* __restrict__ table, int layer, int column) {
  unsigned long long value;
  asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(value) : "l"(table + (long long)layer * LAYER_POINTERS + column));
  return reinterpret_cast<T*>(value);
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* address) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void add_release(unsigned* address) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(address) : "memory");
}

__device__ __forceinline__ unsigned add_acquire_release(unsigned* address) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(address) : "memory");
  return old;
}

#ifdef NQ_TRACE
// tools/step_timeline.py: thread 0 of every block records, for each operation of each layer it
// takes part in, when it began (its first weights requested), when its wait returned and when it
// finished (%globaltimer, ns); 0 where the block had no part in the operation.
__device__ unsigned long long* nq_persistent_trace;  // [blocks][layers][OPS_PER_LAYER][TRACE_MOMENTS], or null
#endif
constexpr int TRACE_BEGUN = 0;
constexpr int TRACE_WAITED = 1;
constexpr int TRACE_DONE = 2;
constexpr int TRACE_MOMENTS = 3;
NQ_EXPORT_INT(TRACE_MOMENTS)

__device__ __forceinline__ void trace_moment(int num_layers, int layer, int op, int moment) {
#ifdef NQ_TRACE
  if (threadIdx.x == 0 && nq_persistent_trace != nullptr)
    nq_persistent_trace[((blockIdx.x * num_layers + layer) * OPS_PER_LAYER + op) * TRACE_MOMENTS + moment] =
        global_time_ns();
#endif
}

// The whole block waits until *counter >= target. Thread 0 spins with acquire loads; the barrier
// then orders every thread's reads after the writes that the counter's releases published.
__device__ __forceinline__ void wait_count(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    const unsigned long long start = global_time_ns();
    for (unsigned spins = 1; load_acquire(counter) < target; ++spins) {
      if (spins % 1024 == 0 && global_time_ns() - start > WAIT_TIMEOUT_NS) {
        __trap();
      }
    }
  }
  __syncthreads();
}

// A warp publishes what its lanes wrote, then counts one more on *counter: the warp barrier orders
// every lane's writes before lane 0's fence, whose release covers them (one fence a warp, not 32).
__device__ __forceinline__ void warp_signal(unsigned* counter) {
  __syncwarp();
  if (threadIdx.x % WARP_SIZE == 0) {
    __threadfence();
    add_release(counter);
  }
}

// Units [begin, end) of an operation's `units` that block blockIdx.x takes: equal runs in block order.
struct Share {
  int begin, end;
};
__device__ __forceinline__ Share block_share(int units) {
  return {(int)((long long)blockIdx.x * units / gridDim.x), (int)((long long)(blockIdx.x + 1) * units / gridDim.x)};
}

__device__ __forceinline__ void copy_async_4B(void* shared_destination, const void* global_source) {
  const unsigned int destination = (unsigned int)__cvta_generic_to_shared(shared_destination);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(destination), "l"(global_source) : "memory");
}

// ---------------------------------------------------------------- the norm

// COUNT 16-byte pieces of global `source` (other blocks' output) into shared `destination`, in rounds
// in which every thread has STAGE_BATCH loads in flight before it stores any: fewer round trips to
// L2 for the MLP's 37 KB vector, not one per piece. (More at once would hold registers that the
// rings' bookkeeping, live across this, needs.)
constexpr int STAGE_BATCH = 2;
template <int COUNT, typename T>
__device__ __forceinline__ void stage_pieces(T* destination, const T* source) {
  for (int first = 0; first < COUNT; first += STAGE_BATCH * PERSIST_THREADS) {
    T pieces[STAGE_BATCH];
#pragma unroll
    for (int k = 0; k < STAGE_BATCH; ++k) {
      const int i = first + threadIdx.x + k * PERSIST_THREADS;
      if (i < COUNT) pieces[k] = __ldcg(source + i);
    }
#pragma unroll
    for (int k = 0; k < STAGE_BATCH; ++k) {
      const int i = first + threadIdx.x + k * PERSIST_THREADS;
      if (i < COUNT) destination[i] = pieces[k];
    }
  }
}

// out = norm(residual) * weight, fp16 [H], as add_rmsnorm_cluster computes it (the residual already
// holds the delta: the GEMV tiles before added it): the row staged in shared memory, then
// normalized there (rmsnorm.cu). Every thread of the block calls it.
__device__ __forceinline__ void norm_into(const float* residual, const unsigned short* __restrict__ weight,
                                          uint2* out, PersistentShared& sh) {
  stage_pieces<RMS_VECTORS>(sh.residual, reinterpret_cast<const float4*>(residual));
  __syncthreads();
  normalize_row_in_block(sh.residual, weight, out, sh.norm_sums);
}

// ---------------------------------------------------------------- GEMV tiles

// The splits of tile `tile` leave their sums in `partials` ([tile][split][TILES][16], fp32); the
// warp of the last to arrive (counted in arrivals[tile]) returns true and finishes the tile. With
// one split there is no one to wait for.
template <int TILES>
__device__ __forceinline__ bool arrive_split(float* partials, unsigned* arrivals, int tile, int split, int splits,
                                             const float (&acc)[TILES][2]) {
  const int lane = threadIdx.x % WARP_SIZE, g = lane / 4;
  float* mine = partials + ((size_t)tile * splits + split) * TILES * TILE_ROWS;
  if (lane % 4 == 0) {
#pragma unroll
    for (int m = 0; m < TILES; ++m) mine[m * TILE_ROWS + g] = acc[m][0], mine[m * TILE_ROWS + g + 8] = acc[m][1];
  }
  if (splits == 1) {
    __syncwarp();
    return true;
  }
  __syncwarp();
  unsigned arrived = 0;
  if (lane == 0) {
    __threadfence();
    arrived = add_acquire_release(arrivals + tile);
  }
  arrived = __shfl_sync(FULL_MASK, arrived, 0);
  if (arrived != (unsigned)splits - 1) return false;
  if (lane == 0) arrivals[tile] = 0;  // this tile's next use (the next layer) counts from zero
  return true;
}

// Row r of tile m's total, begun from `start` and the splits added in split order (add_splits).
template <int TILES>
__device__ __forceinline__ float split_total(const float* partials, int tile, int splits, int m, int r, float start) {
  const float* sums = partials + (size_t)tile * splits * TILES * TILE_ROWS + m * TILE_ROWS + r;
  float total = __ldcg(sums) + start;
  for (int s = 1; s < splits; ++s) total += __ldcg(sums + (size_t)s * TILES * TILE_ROWS);
  return total;
}

// o's and down's finish: the last split of tile `tile` to arrive adds the tile's sums into its 16
// rows of the residual, and its warp counts the tile on *counter.
__device__ __forceinline__ void add_to_residual(float* residual, float* split_partials, unsigned* tile_arrivals, int tile,
                                                int split, int splits, const float (&acc)[1][2], unsigned* counter) {
  if (!arrive_split<1>(split_partials, tile_arrivals, tile, split, splits, acc)) return;
  const int lane = threadIdx.x % WARP_SIZE, row = tile * TILE_ROWS + lane;
  if (lane < TILE_ROWS && row < NQ_HIDDEN)
    residual[row] = __ldcg(residual + row) + split_total<1>(split_partials, tile, splits, 0, lane, 0.0f);
  warp_signal(counter);
}

// A warp's (tile, split) pairs of one GEMV: pairs first, first + PERSIST_WARPS, ... < end of the
// operation's tiles x splits, tile = pair / splits, each split's input groups as the GEMV kernel
// cuts them. All of them stream through one ring of STAGES groups: the weights and scale words of
// a group by cp.async, STAGES - 1 groups ahead of the multiply, across pair boundaries. x (the
// operation's whole input vector) is in shared memory by the time `run` starts.
//   rows_of(tile, rows): lane (g, t)'s rows of the tile, as the GEMV kernel's lane holds them
//   finish(tile, split, acc): the pair's sums (int4_tile_dot's layout), once its last group is in
template <int K, int TILES, int STAGES>
struct GemvStream {
  static constexpr int GROUPS = K / NQ_GROUP_SIZE;
  const unsigned int* qweight;
  const unsigned short* scales;
  GemvSlot<TILES>* ring;
  int splits, end;
  int total = 0, fetched = 0;
  int fetch_pair, fetch_group, fetch_end;  // the next group to fetch
  int fetch_rows[TILES][2];

  __device__ __forceinline__ int range_begin(int pair) const { return pair % splits * GROUPS / splits; }
  __device__ __forceinline__ int range_end(int pair) const { return (pair % splits + 1) * GROUPS / splits; }

  // The fetch moves on to `pair`, or the first pair after it that has groups (a split may have none
  // where K has fewer groups than splits, as gate+up at hidden 128 does).
  template <typename RowsOf>
  __device__ __forceinline__ void enter_fetch(int pair, RowsOf rows_of) {
    while (pair < end && range_end(pair) == range_begin(pair)) pair += PERSIST_WARPS;
    fetch_pair = pair;
    if (pair >= end) return;
    fetch_group = range_begin(pair), fetch_end = range_end(pair);
    rows_of(pair / splits, fetch_rows);
  }

  // Count the warp's groups and request the first STAGES - 1: weights and scales are no
  // operation's output, so this runs before the wait.
  template <typename RowsOf>
  __device__ __forceinline__ void start(int first, RowsOf rows_of) {
    for (int pair = first; pair < end; pair += PERSIST_WARPS) total += range_end(pair) - range_begin(pair);
    enter_fetch(first, rows_of);
#pragma unroll
    for (int u = 0; u < STAGES - 1; ++u) {
      fetch(rows_of);
      copy_async_commit();  // possibly empty: the group count must not depend on the data
    }
  }

  template <typename RowsOf>
  __device__ __forceinline__ void fetch(RowsOf rows_of) {
    if (fetched >= total) return;
    const int lane = threadIdx.x % WARP_SIZE, t = lane % 4;
    GemvSlot<TILES>& slot = ring[fetched % STAGES];
#pragma unroll
    for (int m = 0; m < TILES; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = fetch_rows[m][r];
        const int tiled_row = (row / TILE_ROWS * GROUPS + fetch_group) * TILE_ROWS + row % TILE_ROWS;
        copy_async_16B(&slot.weights[m][r][lane], qweight + (long long)tiled_row * WORDS_PER_GROUP + 4 * t);
        const unsigned short* scale = scales + row * GROUPS + fetch_group;
        copy_async_4B(&slot.scales[m][r][lane], reinterpret_cast<const void*>((unsigned long long)scale & ~3ull));
      }
    }
    ++fetched;
    if (++fetch_group == fetch_end) enter_fetch(fetch_pair + PERSIST_WARPS, rows_of);
  }

  // Multiply every group in order, and finish each pair after its last group (a pair without
  // groups at once, with zero sums).
  template <typename RowsOf, typename Finish>
  __device__ __forceinline__ void run(int first, const uint4* x, RowsOf rows_of, Finish finish) {
    const int lane = threadIdx.x % WARP_SIZE, t = lane % 4;
    int i = 0;  // groups multiplied so far: group i sits in ring slot i % STAGES
    for (int pair = first; pair < end; pair += PERSIST_WARPS) {
      int rows[TILES][2];
      rows_of(pair / splits, rows);
      float acc[TILES][2] = {};
      for (int group = range_begin(pair); group < range_end(pair); ++group, ++i) {
        fetch(rows_of);
        copy_async_commit();
        copy_async_wait<STAGES - 1>();  // this lane's copies of group i have landed (each lane reads only its own)
        const GemvSlot<TILES>& slot = ring[i % STAGES];
        uint4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = x[group * X_PIECES_PER_GROUP + 4 * t + j];
#pragma unroll
        for (int m = 0; m < TILES; ++m) {
          float d[1][4] = {};
          group_mma(slot.weights[m][0][lane], slot.weights[m][1][lane], [&](int, int j) { return xv[j]; }, 1, d);
          const unsigned int word0 = slot.scales[m][0][lane], word1 = slot.scales[m][1][lane];
          const unsigned short scale0 = (rows[m][0] * GROUPS + group) & 1 ? word0 >> 16 : word0 & 0xffffu;
          const unsigned short scale1 = (rows[m][1] * GROUPS + group) & 1 ? word1 >> 16 : word1 & 0xffffu;
          acc[m][0] = fmaf(half_to_float(scale0), d[0][0], acc[m][0]);
          acc[m][1] = fmaf(half_to_float(scale1), d[0][2], acc[m][1]);
        }
      }
      finish(pair / splits, pair % splits, acc);
    }
  }

};

// One GEMV operation of the block: its share of the tiles x splits pairs, the warps' rings filled
// before the wait for `counter` to reach `target` (no wait with a null counter), then prepare_x()
// (every thread: the input vector into sh.x), then every pair. The ring and sh.x are free again
// when it returns.
template <int K, int TILES, int STAGES, typename RowsOf, typename Prepare, typename Finish, typename Trace>
__device__ __forceinline__ void gemv_operation(const unsigned int* qweight, const unsigned short* scales, int tiles,
                                               int splits, const unsigned* counter, unsigned target,
                                               GemvSlot<TILES>* warp_ring, PersistentShared& sh, RowsOf rows_of,
                                               Prepare prepare_x, Finish finish, Trace trace) {
  const Share share = block_share(tiles * splits);
  if (share.begin == share.end) return;
  trace(TRACE_BEGUN);
  const int first = share.begin + threadIdx.x / WARP_SIZE;
  GemvStream<K, TILES, STAGES> stream{qweight, scales, warp_ring, splits, share.end};
  stream.start(first, rows_of);
  if (counter != nullptr) wait_count(counter, target);
  trace(TRACE_WAITED);
  prepare_x();
  __syncthreads();
  stream.run(first, sh.x, rows_of, finish);
  copy_async_wait<0>();  // the ring's last commit groups are empty; nothing lands after this
  __syncthreads();
  trace(TRACE_DONE);
}

// Lane (g, t)'s rows of a tile, as the GEMV kernel's lane holds them.
// A plain tile of N_ROWS rows (the last tile's rows past the end read the last row).
template <int N_ROWS>
struct PlainTileRows {
  __device__ __forceinline__ void operator()(int tile, int (&rows)[1][2]) const {
    const int row0 = tile * TILE_ROWS + threadIdx.x % WARP_SIZE / 4;
    rows[0][0] = min(row0, N_ROWS - 1), rows[0][1] = min(row0 + 8, N_ROWS - 1);
  }
};

// gate+up: the tile's gate rows and the same rows of up (gemv_int4_gate_up_silu's).
struct GateUpTileRows {
  __device__ __forceinline__ void operator()(int tile, int (&rows)[2][2]) const {
    const int row0 = tile * TILE_ROWS + threadIdx.x % WARP_SIZE / 4;
    const int gate0 = min(row0, NQ_INTERMEDIATE - 1), gate1 = min(row0 + 8, NQ_INTERMEDIATE - 1);
    rows[0][0] = gate0, rows[0][1] = gate1, rows[1][0] = NQ_INTERMEDIATE + gate0, rows[1][1] = NQ_INTERMEDIATE + gate1;
  }
};

// q|k|v: a RoPE tile's rotation pairs (gemv_int4_qkv_rope's).
struct QkvTileRows {
  __device__ __forceinline__ void operator()(int tile, int (&rows)[1][2]) const {
    int head_slot, first_dim;
    rope_tile_rows(tile, rows, head_slot, first_dim);
  }
};

// The operation's input vector, HALVES fp16 of global memory (another block's output), into sh.x.
template <int HALVES>
__device__ __forceinline__ void load_x(PersistentShared& sh, const unsigned short* x) {
  stage_pieces<HALVES / 8>(sh.x, reinterpret_cast<const uint4*>(x));
}

// ---------------------------------------------------------------- attention

// Page `page`'s K and V slices of KV head kv_head into one stage (rows at stage_row), one warp.
__device__ __forceinline__ void copy_page(unsigned short (&stage)[2][DECODE_SLICE], const unsigned short* kv,
                                          long long page, int kv_head) {
  constexpr int PIECES_PER_ROW = PA_D / 8;
  const unsigned short* k = kv + page * PA_PAGE_STRIDE + (long long)kv_head * PA_SLICE;
  for (int p = threadIdx.x % WARP_SIZE; p < PA_PAGE * PIECES_PER_ROW; p += WARP_SIZE) {
    const int row = p / PIECES_PER_ROW, column = p % PIECES_PER_ROW * 8;
    copy_async_16B(&stage[0][stage_row(row) + column], k + row * PA_D + column);
    copy_async_16B(&stage[1][stage_row(row) + column], k + PA_KVH * PA_SLICE + row * PA_D + column);
  }
}

// Unit (split, kv_head) of the decode kernel, run by a quad of four consumer warps (consumer =
// the warp's place in the quad), with that kernel's pages per consumer and its merges; the quad's
// threads meet at named barrier `barrier`.
__device__ __forceinline__ void attention_unit(int split, int kv_head, int splits, int seq_len, int pages_per_split,
                                               int active_splits, const int* page_table, const unsigned short* kv,
                                               const float* q, unsigned short* out, float* partial_max_sum,
                                               float* partial_acc, AttentionQuad& sh, int consumer, int barrier) {
  const int lane = threadIdx.x % WARP_SIZE;
  const int num_pages = (seq_len + PA_PAGE - 1) / PA_PAGE;
  const int first_page = split * pages_per_split;
  const int block_pages = min(pages_per_split, num_pages - first_page);
  const bool one_page = block_pages == 1;
  const size_t split_row = split_row_of(kv_head, split, splits);
  float m[2] = {NEGATIVE_INFINITY, NEGATIVE_INFINITY}, l[2] = {0.0f, 0.0f}, o[PA_D / 8][4] = {};
  if (!(one_page && consumer > 0)) {
    SharedDecodeQuery& query = sh.query[consumer];
    load_decode_query(q + kv_head * PA_GQA * PA_D, lane, query);  // each lane reads back only its own words
    if (consumer < block_pages) copy_page(sh.kv[consumer][0], kv, page_table[first_page + consumer], kv_head);
    copy_async_commit();
    for (int i = consumer, round = 0; i < block_pages; i += DECODE_CONSUMER_WARPS, ++round) {
      const int next = i + DECODE_CONSUMER_WARPS;
      if (next < block_pages) copy_page(sh.kv[consumer][(round + 1) % KV_STAGES], kv, page_table[first_page + next], kv_head);
      copy_async_commit();
      copy_async_wait<1>();
      __syncwarp();  // every lane's copies of page i have landed
      const int valid_rows = min(PA_PAGE, seq_len - (first_page + i) * PA_PAGE);
      decode_page(sh.kv[consumer][round % KV_STAGES][0], sh.kv[consumer][round % KV_STAGES][1], valid_rows, query, m, l,
                  o, lane);
      __syncwarp();  // every lane has read the stage before it is refilled
    }
    copy_async_wait<0>();
  }
  float (*warp_acc)[PA_GQA][PA_D] = reinterpret_cast<float (*)[PA_GQA][PA_D]>(&sh.kv[0][0][0][0]);
  if (one_page) {
    if (consumer == 0)
      store_consumer_totals(0, lane, true, active_splits, kv_head, split_row, m, l, o, sh.warp_max, sh.warp_sum,
                            warp_acc, out, partial_max_sum, partial_acc);
  } else {
    named_barrier_sync<DECODE_CONSUMER_THREADS>(barrier);  // no consumer still reads a stage under warp_acc
    store_consumer_totals(consumer, lane, false, active_splits, kv_head, split_row, m, l, o, sh.warp_max, sh.warp_sum,
                          warp_acc, out, partial_max_sum, partial_acc);
    named_barrier_sync<DECODE_CONSUMER_THREADS>(barrier);
    for (int e = consumer * WARP_SIZE + lane; e < PA_GQA * PA_D; e += DECODE_CONSUMER_THREADS)
      merge_consumer_element(e, active_splits, kv_head, split_row, sh.warp_max, sh.warp_sum, warp_acc, out,
                             partial_max_sum, partial_acc);
  }
  __threadfence();
  named_barrier_sync<DECODE_CONSUMER_THREADS>(barrier);  // the unit's writes are made; its shared memory is free
}

// ---------------------------------------------------------------- the kernel

// grid (number of SMs: one block each, all resident), block (PERSIST_THREADS),
// decode_persistent_smem_bytes of dynamic shared memory.
//   layer_table  uint64 [L, LAYER_POINTERS] (the LAYER_* columns)
//   state        int32: the decode state (kernels/common.cuh), read only
//   residual     fp32 [H]: the embedding on entry (embed_tokens), the last layer's residual on exit
//   q fp32 [Q_DIM], attn_out fp16 [Q_DIM], mlp_hidden fp16 [I]: the operations' vectors
//   normed       fp16 [H]: the final norm's output, lm_head_logits' input
//   partial_max_sum, partial_acc, attention_splits: the decode attention's (nanoqwen.cuda.attention)
//   split_partials fp32 [the largest tiles x splits x 2 x 16 of the GEMVs], tile_arrivals uint32
//   [the most tiles], done uint32 [L * OPS_PER_LAYER]: zero on entry, and zero again on exit
//   *_splits: each GEMV's split of K, the decode kernels' (nanoqwen.cuda.plan)
extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, 1)
decode_layers_persistent(const unsigned long long* __restrict__ layer_table, const int* state,
                         const float* __restrict__ inv_freq, const unsigned short* __restrict__ final_norm,
                         float* residual, float* q, unsigned short* attn_out, unsigned short* mlp_hidden,
                         unsigned short* normed, float* partial_max_sum, float* partial_acc, int attention_splits,
                         float* split_partials, unsigned* tile_arrivals, unsigned* done, int num_layers,
                         int qkv_splits, int o_splits, int gate_up_splits, int down_splits) {
  extern __shared__ __align__(128) unsigned char persistent_shared[];
  PersistentShared& sh = *reinterpret_cast<PersistentShared*>(persistent_shared);
  let_next_kernel_launch();
  wait_for_previous_kernel();  // the embedding (embed_tokens) and the state (the step before)
  if (threadIdx.x == 0) {
    StepInputs& step = sh.step;
    step.position = state[STATE_POSITION], step.seq_len = state[STATE_SEQ_LEN];
    // The attention's division of the sequence, as paged_attention_decode makes it.
    const SequenceDivision division = divide_sequence(step.seq_len, attention_splits);
    step.pages_per_split = division.pages_per_split, step.active_splits = division.active_splits;
  }
  __syncthreads();
  const int* page_table = state + STATE_PAGE_TABLE;
  const auto ring_of_warp = [&]() { return sh.work.split_rings[threadIdx.x / WARP_SIZE]; };
  const auto pair_ring_of_warp = [&]() { return sh.work.pair_rings[threadIdx.x / WARP_SIZE]; };

  for (int layer = 0; layer < num_layers; ++layer) {
    // Read where they are used, so that no register holds them across the operations between.
    const auto weights = [&](int column) { return layer_pointer<unsigned int>(layer_table, layer, column); };
    const auto halves = [&](int column) { return layer_pointer<unsigned short>(layer_table, layer, column); };
    unsigned* layer_done = done + layer * OPS_PER_LAYER;
    const auto tracer = [&](int op) { return [=](int moment) { trace_moment(num_layers, layer, op, moment); }; };

    // ---- norm -> q|k|v + RoPE: q, and K, V into the cache at the step's position
    gemv_operation<NQ_HIDDEN, 1, SPLIT_STAGES>(
        weights(LAYER_QKV_QWEIGHT), halves(LAYER_QKV_SCALES), QKV_TILES, qkv_splits,
        layer > 0 ? done + (layer - 1) * OPS_PER_LAYER + OP_DOWN : nullptr, HIDDEN_TILES, ring_of_warp(), sh,
        QkvTileRows{},
        [&] { norm_into(residual, halves(LAYER_INPUT_NORM), reinterpret_cast<uint2*>(sh.x), sh); },
        [&](int tile, int split, const float(&acc)[1][2]) {
          if (!arrive_split<1>(split_partials, tile_arrivals, tile, split, qkv_splits, acc)) return;
          const int lane = threadIdx.x % WARP_SIZE;
          int rows[1][2], head_slot, first_dim;
          rope_tile_rows(tile, rows, head_slot, first_dim);
          const bool finishes = lane < TILE_ROWS;
          const int dim = rope_tile_dim(first_dim, lane % TILE_ROWS);
          const unsigned short* bias = halves(LAYER_QKV_BIAS);
          const float start = finishes && bias != nullptr ? half_to_float(bias[head_slot * NQ_HEAD_DIM + dim]) : 0.0f;
          const float total = finishes ? split_total<1>(split_partials, tile, qkv_splits, 0, lane, start) : 0.0f;
          const float partner = __shfl_xor_sync(FULL_MASK, total, ROPE_PAIRS_PER_TILE);  // rows m and m ^ 8
          if (finishes) {
            const int position = step_value(sh.step.position);
            float c, s;
            rope_cos_sin(position, inv_freq[dim % ROPE_HALF], c, s);
            const long long page = head_slot >= NQ_NUM_HEADS ? page_table[position / NQ_PAGE_SIZE] : 0;
            store_qkv_dim(head_slot, dim, total, rope_rotate(total, partner, c, s, lane < ROPE_PAIRS_PER_TILE), page,
                          position % NQ_PAGE_SIZE, layer_pointer<unsigned short>(layer_table, layer, LAYER_KV), q);
          }
          warp_signal(layer_done + OP_QKV);
        },
        tracer(OP_QKV));

    // ---- attention: units (split, KV head) over the active splits, a quad of warps each
    {
      const int active_splits = step_value(sh.step.active_splits);
      const Share share = block_share(active_splits * PA_KVH);
      if (share.begin < share.end) {
        trace_moment(num_layers, layer, OP_ATTENTION, TRACE_BEGUN);
        wait_count(layer_done + OP_QKV, QKV_TILES);
        trace_moment(num_layers, layer, OP_ATTENTION, TRACE_WAITED);
        const int quad = threadIdx.x / DECODE_CONSUMER_THREADS;
        if (quad < ATTENTION_QUADS) {
          for (int unit = share.begin + quad; unit < share.end; unit += ATTENTION_QUADS) {
            attention_unit(unit % active_splits, unit / active_splits, attention_splits, step_value(sh.step.seq_len),
                           step_value(sh.step.pages_per_split), active_splits, page_table,
                           halves(LAYER_KV), q, attn_out, partial_max_sum, partial_acc, sh.work.quads[quad],
                           threadIdx.x / WARP_SIZE % DECODE_CONSUMER_WARPS, QUAD_BARRIER0 + quad);
            if (threadIdx.x % DECODE_CONSUMER_THREADS == 0) add_release(layer_done + OP_ATTENTION);
          }
        }
        __syncthreads();
        trace_moment(num_layers, layer, OP_ATTENTION, TRACE_DONE);
      }
    }

    // ---- combine the splits, a group of COMBINE_WARPS warps per query head
    if (step_value(sh.step.active_splits) > 1) {
      const Share share = block_share(NQ_NUM_HEADS);
      if (share.begin < share.end) {
        const int active_splits = step_value(sh.step.active_splits);
        trace_moment(num_layers, layer, OP_COMBINE, TRACE_BEGUN);
        wait_count(layer_done + OP_ATTENTION, active_splits * PA_KVH);
        trace_moment(num_layers, layer, OP_COMBINE, TRACE_WAITED);
        const int group = threadIdx.x / (COMBINE_WARPS * WARP_SIZE);  // the warps past the last group wait
        for (int head = share.begin + group; group < COMBINE_GROUPS && head < share.end; head += COMBINE_GROUPS) {
          combine_head(head % PA_GQA, head / PA_GQA, threadIdx.x / WARP_SIZE % COMBINE_WARPS, threadIdx.x % WARP_SIZE,
                       attention_splits, active_splits, partial_max_sum, partial_acc, attn_out, sh.work.combines[group],
                       [&] { named_barrier_sync<COMBINE_WARPS * WARP_SIZE>(COMBINE_BARRIER0 + group); });
          __threadfence();
          named_barrier_sync<COMBINE_WARPS * WARP_SIZE>(COMBINE_BARRIER0 + group);
          if (threadIdx.x % (COMBINE_WARPS * WARP_SIZE) == 0) add_release(layer_done + OP_COMBINE);
        }
        __syncthreads();
        trace_moment(num_layers, layer, OP_COMBINE, TRACE_DONE);
      }
    }

    // ---- o: residual += o attn_out
    const bool combined = step_value(sh.step.active_splits) > 1;
    gemv_operation<NQ_Q_DIM, 1, SPLIT_STAGES>(
        weights(LAYER_O_QWEIGHT), halves(LAYER_O_SCALES), HIDDEN_TILES, o_splits,
        layer_done + (combined ? OP_COMBINE : OP_ATTENTION), combined ? NQ_NUM_HEADS : PA_KVH, ring_of_warp(), sh,
        PlainTileRows<NQ_HIDDEN>{}, [&] { load_x<NQ_Q_DIM>(sh, attn_out); },
        [&](int tile, int split, const float(&acc)[1][2]) {
          add_to_residual(residual, split_partials, tile_arrivals, tile, split, o_splits, acc, layer_done + OP_O);
        },
        tracer(OP_O));

    // ---- norm -> gate+up -> SwiGLU into mlp_hidden
    gemv_operation<NQ_HIDDEN, 2, PAIR_STAGES>(
        weights(LAYER_GATE_UP_QWEIGHT), halves(LAYER_GATE_UP_SCALES), MLP_TILES, gate_up_splits, layer_done + OP_O,
        HIDDEN_TILES, pair_ring_of_warp(), sh, GateUpTileRows{},
        [&] { norm_into(residual, halves(LAYER_POST_NORM), reinterpret_cast<uint2*>(sh.x), sh); },
        [&](int tile, int split, const float(&acc)[2][2]) {
          if (!arrive_split<2>(split_partials, tile_arrivals, tile, split, gate_up_splits, acc)) return;
          const int lane = threadIdx.x % WARP_SIZE, row = tile * TILE_ROWS + lane;
          if (lane < TILE_ROWS && row < NQ_INTERMEDIATE) {
            const float gate = split_total<2>(split_partials, tile, gate_up_splits, 0, lane, 0.0f);
            const float up = split_total<2>(split_partials, tile, gate_up_splits, 1, lane, 0.0f);
            mlp_hidden[row] = float_to_half(silu_times(gate, up));
          }
          warp_signal(layer_done + OP_GATE_UP);
        },
        tracer(OP_GATE_UP));

    // ---- down: residual += down mlp_hidden
    gemv_operation<NQ_INTERMEDIATE, 1, SPLIT_STAGES>(
        weights(LAYER_DOWN_QWEIGHT), halves(LAYER_DOWN_SCALES), HIDDEN_TILES, down_splits, layer_done + OP_GATE_UP,
        MLP_TILES, ring_of_warp(), sh, PlainTileRows<NQ_HIDDEN>{}, [&] { load_x<NQ_INTERMEDIATE>(sh, mlp_hidden); },
        [&](int tile, int split, const float(&acc)[1][2]) {
          add_to_residual(residual, split_partials, tile_arrivals, tile, split, down_splits, acc, layer_done + OP_DOWN);
        },
        tracer(OP_DOWN));
  }

  // ---- the final norm, by block 0, once the last layer's down is in; then every counter back to zero
  if (blockIdx.x == 0) {
    wait_count(done + (num_layers - 1) * OPS_PER_LAYER + OP_DOWN, HIDDEN_TILES);
    norm_into(residual, final_norm, reinterpret_cast<uint2*>(normed), sh);
    // Every other block has passed its last wait: all of its operations were needed for this one.
    for (int i = threadIdx.x; i < num_layers * OPS_PER_LAYER; i += PERSIST_THREADS) done[i] = 0;
  }
}
