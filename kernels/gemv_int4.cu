// gemv_int4.cu: y = W x for one token, W packed INT4 (group 128, fp16 scales), x fp16.
//
// Reference (nanoqwen/reference/ops.py, int4_linear, with nanoqwen/quant.py's dequantize_int4):
//     W = (nibble - 8) * scale   fp32 [N, K]
//     y = x.astype(fp32) @ W.T (+ bias)
//
// Decode reads every weight once per token and does two FLOPs per weight, so the GEMV is a
// pure memory stream: 0.5 byte per weight plus 2 bytes of scale per 128 weights. The work is
// arranged so the arithmetic stays far below what the SM can issue:
//
// 1. Unpack without shifts per nibble. The packer (nanoqwen/quant.py) interleaves nibbles so
//    that (word >> 4i) & 0x000F000F holds elements 2i and 2i+1 in its two 16-bit halves.
//    OR-ing 0x64006400 makes each half the fp16 number 1024 + nibble (0x6400 is 1024, whose
//    fp16 spacing is exactly 1), and one fp16x2 subtraction of 1032 leaves nibble - 8 exactly:
//    one lop3 and one fp16x2 operation per pair, four pairs and one shift per 32-bit word
//    (unpack_int4_word).
// 2. Multiply on the tensor cores. mma.m16n8k16 multiplies a 16x16 fp16 tile of W by a 16x8
//    tile of x and accumulates in fp32. Every product (nibble - 8) * x is exact in fp16 input
//    and fp32 accumulation, so this matches dequantize-then-fp32-dot up to summation order.
//    Only one of the 8 columns is needed; x is simply repeated in all of them.
// 3. Scales once per group: the 8 MMAs of one 128-wide group start from zero, and the group's
//    sum is scaled into the fp32 accumulator with one FMA per row.
//
// The layout the GEMVs read (nanoqwen/quant.py, tile_int4): a warp multiplies a tile of 16 rows,
// so the device keeps the packed weights as [tiles][groups][16 rows][16 words]. The kilobyte a
// warp needs for one group is then one contiguous run, and the groups of its split follow each
// other: one stream per warp instead of 16 rows' 64-byte pieces 1.75-9.25 KB apart, as the file's
// row-major order gives. The scales (3% of the bytes) keep the file's row-major [rows][groups]:
// a warp's scales for a group are 32 bytes, which L1 serves from lines fetched ahead (below).
//
// Thread layout inside a warp (the mma fragment layout): lane = 4 g + t. Lane (g, t) multiplies
// rows g and g + 8 of its tile, and in each group the t-th 16-byte piece of each (32 weights:
// elements 32t .. 32t + 31 of the group). In the tiled layout those two pieces sit at bytes
// 16 lane and 512 + 16 lane of the group's kilobyte, so the warp's copies are two fully
// coalesced 512-byte runs. The MMA's k index is free to relabel: lane (g, t) places its pairs at
// the k slots 2t, 2t+1 (register a0/a1) and 2t+8, 2t+9 (a2/a3) and supplies x for the same
// slots, identical for every g, which is all a dot product needs.
//
// Inside the decode graph each kernel starts while the previous one finishes (programmatic
// dependent launch, common.cuh): the first groups of weights are requested before
// wait_for_previous_kernel(), and x, which the previous kernel writes, is copied after it.
//
// Split K: a 16-row tile of a 3584-wide matrix is only 28 KB, and q/k/v/o have too few tiles to
// give every SM enough bytes in flight. So the input groups are cut into `splits` ranges, and a
// block of `splits` warps takes one tile, one range per warp; the warps add their sums in split
// order through shared memory, and the block writes each row once, in fp32. No atomics: the
// result is deterministic, and the next kernel reads one finished vector instead of adding
// partial sums from L2 on the decode step's critical path.
#pragma once  // verify.cu includes it too, for its multi-row kernels
#include "common.cuh"

constexpr int TILE_ROWS = 16;  // rows of a weight tile (nanoqwen/quant.py, tile_int4, lays them out)
NQ_EXPORT_INT(TILE_ROWS)
constexpr int WORDS_PER_GROUP = NQ_GROUP_SIZE / 8;  // 16 words = 64 bytes per row and group
constexpr int SPLIT_K_MAX_WARPS = 16;  // a split-K block's warps
NQ_EXPORT_INT(SPLIT_K_MAX_WARPS)
// q|k|v and o compile for this many blocks of SPLIT_K_MAX_WARPS warps per SM (64 registers a thread
// on Hopper), so that the plan knows how many of their blocks an SM holds at any split
// (plan.chain_splits) before anything is compiled.
constexpr int CHAIN_GEMV_MIN_BLOCKS = 2;
NQ_EXPORT_INT(CHAIN_GEMV_MIN_BLOCKS)
constexpr int X_PIECES_PER_GROUP = NQ_GROUP_SIZE / 8;  // 16-byte pieces of x per group (16)
// Groups in each warp's shared-memory ring (1 KB of weights per tile and 256 bytes of x per
// group), one depth per kernel. A depth matters inside the decode step, where each GEMV fills its
// ring while the kernel before it still runs: down_proj's 224 blocks of 10 warps keep 6 groups in
// flight per warp, two blocks per SM; q|k|v and o run 3 deep, so that their registers stay within
// CHAIN_GEMV_MIN_BLOCKS' bound whatever their split.
#ifndef NQ_GATE_UP_STAGES
#define NQ_GATE_UP_STAGES 4
#endif
#ifndef NQ_FROM_HIDDEN_STAGES
#define NQ_FROM_HIDDEN_STAGES 3
#endif
#ifndef NQ_FROM_Q_DIM_STAGES
#define NQ_FROM_Q_DIM_STAGES 3
#endif
#ifndef NQ_FROM_INTERMEDIATE_STAGES
#define NQ_FROM_INTERMEDIATE_STAGES 6
#endif

// lop3 with truth table 0xEA computes (a & b) | c.
__device__ __forceinline__ unsigned int and_or(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ unsigned int sub_half2(unsigned int a, unsigned int b) {
  unsigned int d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ unsigned int fma_half2(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// One packed word -> four fp16 pairs (q[2i], q[2i+1]) with q = nibble - 8 in [-8, 7].
// Pair i sits in nibble i of each 16-bit half. Nibbles 0 and 2 (after one shift by 8) become
// 1024 + n as above; nibbles 1 and 3 are masked where they stand, giving 1024 + 16 n, which one
// fp16x2 fma scales back: (1024 + 16 n) / 16 - 72 = n - 8, exact (every step is an integer
// below 2048). One shift per word instead of three: the shifts and the lop3s share the SM's
// integer pipe, which runs at half the rate of the fp16 one.
__device__ __forceinline__ void unpack_int4_word(unsigned int word, unsigned int (&pairs)[4]) {
  constexpr unsigned int MAGIC = 0x64006400u;          // fp16 1024 in both halves
  constexpr unsigned int MINUS_1032 = 0x64086408u;     // subtracted: 1024 + n - 1032
  constexpr unsigned int ONE_SIXTEENTH = 0x2C002C00u;  // fp16 0.0625
  constexpr unsigned int MINUS_72 = 0xD480D480u;       // fp16 -72
  const unsigned int high = word >> 8;
  pairs[0] = sub_half2(and_or(word, 0x000F000Fu, MAGIC), MINUS_1032);
  pairs[1] = fma_half2(and_or(word, 0x00F000F0u, MAGIC), ONE_SIXTEENTH, MINUS_72);
  pairs[2] = sub_half2(and_or(high, 0x000F000Fu, MAGIC), MINUS_1032);
  pairs[3] = fma_half2(and_or(high, 0x00F000F0u, MAGIC), ONE_SIXTEENTH, MINUS_72);
}

// d = A B + d for a 16x16 fp16 A (rows g, g+8), a 16x8 fp16 B, fp32 accumulators.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                            unsigned int a3, unsigned int b0, unsigned int b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Asynchronous 16-byte copy global -> shared (sm_80+), kept out of L1, with the same 256-byte
// L2 prefetch hint as load_weights_16B. Completion is tracked per thread in commit groups.
__device__ __forceinline__ void copy_async_16B(void* shared_destination, const void* global_source) {
  const unsigned int destination = (unsigned int)__cvta_generic_to_shared(shared_destination);
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(destination), "l"(global_source) : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `PENDING` of this thread's most recent commit groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// One group of one tile times x: lane (g, t)'s pieces w0 (row g) and w1 (row g + 8), four words of
// 8 weights each, against its 32 activations of each column block c (x_of(c, j), j = 0..3: elements
// 32 t .. 32 t + 31 of the group), in 8 MMAs a block accumulated into d[c] from zero, for the first
// `blocks` of BLOCKS blocks. Decode (and the persistent decode kernel) has one block, its x the same
// in every column: afterwards d[0][0] is row g's sum and d[0][2] row g + 8's. A verify pass's blocks
// hold 8 tokens each (MMA_COLUMNS).
template <int BLOCKS, typename X>
__device__ __forceinline__ void group_mma(const uint4& w0, const uint4& w1, X x_of, int blocks, float (&d)[BLOCKS][4]) {
  const unsigned int words0[4] = {w0.x, w0.y, w0.z, w0.w}, words1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    unsigned int p0[4], p1[4];  // pairs of row g and of row g + 8
    unpack_int4_word(words0[j], p0);
    unpack_int4_word(words1[j], p1);
#pragma unroll
    for (int c = 0; c < BLOCKS; ++c) {
      if (c >= blocks) break;  // the same for the whole warp
      const uint4 xv = x_of(c, j);
      mma_16x8x16(d[c], p0[0], p1[0], p0[1], p1[1], xv.x, xv.y);
      mma_16x8x16(d[c], p0[2], p1[2], p0[3], p1[3], xv.z, xv.w);
    }
  }
}

// One warp's shared-memory ring: STAGES groups of weights (TILES tiles of 16 rows) and of x.
template <int STAGES, int TILES>
struct GemvRing {
  uint4 weights[STAGES][TILES][2][WARP_SIZE];
  uint4 x[STAGES][X_PIECES_PER_GROUP];
};

// A verify pass (kernels/verify.cu) multiplies up to TOKENS rows of x at once: the MMA's 8
// columns, which decode fills with copies of its one x, then hold 8 different tokens, so every
// weight that reaches a warp serves all of them. Lane (g, t) supplies column g's x and gets back
// rows g and g + 8 of columns 2t and 2t + 1 (d[0], d[1]: row g; d[2], d[3]: row g + 8); more than
// 8 tokens take one MMA per block of 8 columns from the same unpacked weights. Each column is
// computed from the same A fragment and the same x as decode's, with the same group order, so a
// token's sums are decode's bits (tests/test_verify_cuda.py).
constexpr int MMA_COLUMNS = 8;
// Accumulators per tile of a lane: decode's rows g and g + 8, or d[0..3] per block of 8 tokens.
__host__ __device__ constexpr int gemv_accumulators(int tokens) {
  return tokens == 1 ? 2 : 4 * ((tokens + MMA_COLUMNS - 1) / MMA_COLUMNS);
}

// A GEMV block's dynamic shared memory: one GemvRing per warp.
extern __shared__ __align__(16) unsigned char gemv_shared[];

// destination[0, count) = source[0, count), halves, as threads [thread, thread + threads) of the
// block: 16-byte cp.async pieces where the source allows them (a tile's scales start 16-byte
// aligned, except up_proj's when intermediate_size x groups is not a multiple of 8), plain loads
// for the rest. The
// cp.asyncs complete with the thread's next commit group; int4_tile_dot waits for them and then
// meets the block at a barrier. destination must be 16-byte aligned.
__device__ __forceinline__ void stage_scales(unsigned short* destination, const unsigned short* __restrict__ source,
                                             int count, int thread, int threads) {
  const int pieces = reinterpret_cast<unsigned long long>(source) % 16 == 0 ? count / 8 : 0;
  for (int p = thread; p < pieces; p += threads) copy_async_16B(destination + 8 * p, source + 8 * p);
  for (int e = 8 * pieces + thread; e < count; e += threads) destination[e] = __ldg(source + e);
}

// For each of TILES row tiles, lane (g, t) accumulates into acc[tile][0] and acc[tile][1] the dot
// products of rows rows[tile][0] (= row g of the tile) and rows[tile][1] (= row g + 8) with x
// over the groups [group_begin, group_end).
//
// The weights and x of a group travel by cp.async into one slot of a shared-memory ring of
// STAGES slots, STAGES - 1 groups ahead of the one being multiplied, so that the warp's chain per
// group is shared loads, unpacking and MMAs, never a wait on global memory:
// - weights: each lane copies exactly the two 16-byte pieces it later reads itself;
// - x: lanes 0-15 copy its 256 bytes; every lane reads 64 of them, so the lanes meet at
//   __syncwarp between copy and use.
// The scales, two bytes per row and group, come one of two ways:
// - STAGED: from shared memory, where the caller copied its tiles' scales before the wait
//   (stage_scales); `tile_scales` holds them as [TILES][16 rows][GROUPS], rows g and g + 8 (or the
//   last row, where a tile runs past the end) at scale_rows. gate+up, whose warps cover many
//   groups, reads them so: from global memory (below) its many groups' scale loads cost L2
//   sectors beyond the kernel's bytes and stall the warps on them.
// - otherwise from global memory (`scales`, row-major [rows][GROUPS]): each lane loads its rows'
//   raw fp16 into a register ring the same STAGES - 1 groups ahead and converts them where they
//   are used (a conversion at the load would stall the warp on it), and the prologue asks L1 to
//   fetch every 128-byte line of scales the warp will need, so those loads hit. The split-K warps
//   take few groups each, and staging a down_proj tile's 4.7 KB of scales would cost their blocks
//   the shared memory to fit two to an SM.
// The loop is unrolled by STAGES because register arrays need compile-time indices. x comes
// through the ring too, and each scale is converted where it is used: loaded from global memory
// at the top of every group, or converted at its load, either would stall the warp once per group.
// With AHEAD (q|k|v and o), a range that fits the ring is requested whole before the wait and no
// slot is refilled: nothing of the weights is left to ask for once x has arrived. A longer range
// has its first STAGES - 1 groups requested before the wait, as without AHEAD.
// `ring` is this warp's own.
// With TOKENS > 1 (a verify pass) x is `tokens` rows of K and acc[tile] holds
// gemv_accumulators(TOKENS) sums (see MMA_COLUMNS); decode passes TOKENS = 1 and tokens = 1. A
// verify pass's x does not travel through the ring: at 8 tokens it would be twice the weights'
// bytes per slot, and the rings that fit an SM would be half as deep, or its blocks would not all
// fit at once. Each lane loads its columns' x from global memory (L1, which every block of the SM
// shares, serves most of it); x_ring is then unused.
template <int K, int TILES, int STAGES, bool STAGED, bool AHEAD = false, int TOKENS = 1>
__device__ __forceinline__ void int4_tile_dot(const unsigned int* __restrict__ qweight,
                                              const unsigned short* __restrict__ scales,
                                              const unsigned short* tile_scales, const int (&scale_rows)[2],
                                              const unsigned short* x, const int (&rows)[TILES][2],
                                              int group_begin, int group_end,
                                              uint4 (&weight_ring)[STAGES][TILES][2][WARP_SIZE], uint4* x_ring,
                                              int tokens, float (&acc)[TILES][gemv_accumulators(TOKENS)]) {
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  constexpr bool ROWS = TOKENS > 1;
  constexpr int BLOCKS = (TOKENS + MMA_COLUMNS - 1) / MMA_COLUMNS;
  const int lane = threadIdx.x % WARP_SIZE, t = lane % 4, g = lane / 4;
  const int blocks = (tokens + MMA_COLUMNS - 1) / MMA_COLUMNS;
  const int count = group_end - group_begin;
  // AHEAD: a range that fits the ring is requested whole before the wait, no slot refilled.
  const bool all_ahead = AHEAD && count <= STAGES;
  unsigned short scale_ring[STAGES][TILES][2];  // not STAGED only (unused registers otherwise)
  // Row r's 64 bytes of a group sit at word ((r / 16 * GROUPS + group) * 16 + r % 16) * 16 of
  // the tiled weights (quant.tile_int4), and the lane's piece is 4 t words further: so each
  // of the lane's pieces starts at a fixed address for the range's first group and moves one
  // tile-group (256 words) per group. Computed once here, the copies of a group need one add
  // per piece instead of the whole index arithmetic in 64 bits.
  constexpr int WORDS_PER_TILE_GROUP = TILE_ROWS * WORDS_PER_GROUP;
  const unsigned int* weight_source[TILES][2];
  const unsigned short* scale_source[TILES][2];
#pragma unroll
  for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const long long row = rows[tile][r];
      const long long tiled_row = (row / TILE_ROWS * GROUPS + group_begin) * TILE_ROWS + row % TILE_ROWS;
      weight_source[tile][r] = qweight + tiled_row * WORDS_PER_GROUP + 4 * t;
      scale_source[tile][r] = scales + row * GROUPS + group_begin;
    }
  }
  const unsigned short* x_source = x + group_begin * NQ_GROUP_SIZE + 8 * lane;  // lanes < 16 copy x
  // Copy group `i`'s x into slot `slot` (decode's: lanes 0-15 copy its 16 pieces).
  auto fetch_x = [&](int i, int slot) {
    if (!ROWS && lane < X_PIECES_PER_GROUP) copy_async_16B(x_ring + slot * X_PIECES_PER_GROUP + lane, x_source + i * NQ_GROUP_SIZE);
  };
  // Verifying, column g of block c is token 8 c + g (the last token where there are fewer: those
  // columns are computed and dropped), and lane (g, t) multiplies its elements 32 t .. 32 t + 31
  // of each group, four 16-byte pieces from token_x[c] + 16 i in group i of the range.
  const uint4* token_x[BLOCKS] = {};
  if constexpr (ROWS) {
#pragma unroll
    for (int c = 0; c < BLOCKS; ++c)
      token_x[c] = reinterpret_cast<const uint4*>(x + (long long)min(c * MMA_COLUMNS + g, tokens - 1) * K +
                                                  group_begin * NQ_GROUP_SIZE + 32 * t);
  }

  // Start the copies of group number `i` (0-based within the range) into ring slot SLOT:
  // weights (and, not STAGED, scales) always, x only once the previous kernel has written it
  // (WITH_X).
#define NQ_FETCH_GROUP(i, SLOT, WITH_X)                                                                  \
  do {                                                                                                   \
    _Pragma("unroll") for (int tile = 0; tile < TILES; ++tile) {                                         \
      _Pragma("unroll") for (int r = 0; r < 2; ++r) {                                                    \
        copy_async_16B(&weight_ring[SLOT][tile][r][lane],                                                \
                       weight_source[tile][r] + (i) * WORDS_PER_TILE_GROUP);                             \
        if constexpr (!STAGED) scale_ring[SLOT][tile][r] = __ldg(scale_source[tile][r] + (i));            \
      }                                                                                                  \
    }                                                                                                    \
    if (WITH_X) fetch_x((i), (SLOT));                                                                    \
  } while (0)

  if constexpr (!STAGED) {
    // The scales of the range: lane (g, t) warms the L1 lines of row g's (t = 0, 1) or row
    // g + 8's (t = 2, 3) scales, every other 128-byte line each.
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
      const unsigned short* first = scales + (long long)rows[tile][t / 2] * GROUPS + group_begin;
      const unsigned short* last = first + max(count, 1) - 1;
      for (const char* line = reinterpret_cast<const char*>((unsigned long long)first & ~127ull) + 128 * (t % 2);
           line <= reinterpret_cast<const char*>(last); line += 256)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(line));
    }
  }
#pragma unroll
  for (int u = 0; u < STAGES - 1; ++u) {
    if (u < count) NQ_FETCH_GROUP(u, u, false);
    copy_async_commit();  // possibly empty: the group count must not depend on the data
  }
  if (all_ahead && count == STAGES) NQ_FETCH_GROUP(STAGES - 1, STAGES - 1, false);
  wait_for_previous_kernel();  // the weights above are no kernel's output; x is the previous one's
#pragma unroll
  for (int u = 0; u < STAGES; ++u)
    if ((u < STAGES - 1 || all_ahead) && u < count) fetch_x(u, u);
  copy_async_commit();
  copy_async_wait<0>();  // the prologue's groups, their x (and, STAGED, this thread's share of the scales)
  if constexpr (STAGED) __syncthreads();  // and every other thread's share: the block stages them together
  for (int first = 0; first < count; first += STAGES) {
#pragma unroll
    for (int u = 0; u < STAGES; ++u) {
      const int i = first + u;
      __syncwarp();  // every lane is done with the slot refilled next (x is read by all lanes)
      // Refill the slot that iteration i - 1 finished with, STAGES - 1 groups ahead.
      if (!all_ahead && i + STAGES - 1 < count) NQ_FETCH_GROUP(i + STAGES - 1, (u + STAGES - 1) % STAGES, true);
      copy_async_commit();
      copy_async_wait<STAGES - 1>();  // this lane's copies of group i have landed in slot u
      __syncwarp();                   // and so have every other lane's (x)
      if (i < count) {  // the same for the whole warp
        // This lane's 32 activations, 8 per word of the weights. Decode's x is the same in every
        // column and serves every tile: loaded from the slot once. A verify pass's comes from
        // global memory where it is used, so the blocks' x do not all occupy registers at once.
        uint4 decode_x[4];
        if constexpr (!ROWS) {
#pragma unroll
          for (int j = 0; j < 4; ++j) decode_x[j] = x_ring[u * X_PIECES_PER_GROUP + 4 * t + j];
        }
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
          const uint4 w0 = weight_ring[u][tile][0][lane], w1 = weight_ring[u][tile][1][lane];
          float d[BLOCKS][4] = {};
          group_mma(w0, w1, [&](int c, int j) { return ROWS ? token_x[c][i * X_PIECES_PER_GROUP + j] : decode_x[j]; },
                    blocks, d);
          unsigned short scale0, scale1;
          if constexpr (STAGED) {
            const unsigned short* group_scales = tile_scales + tile * TILE_ROWS * GROUPS + group_begin + i;
            scale0 = group_scales[scale_rows[0] * GROUPS], scale1 = group_scales[scale_rows[1] * GROUPS];
          } else {
            scale0 = scale_ring[u][tile][0], scale1 = scale_ring[u][tile][1];
          }
          const float s0 = half_to_float(scale0), s1 = half_to_float(scale1);
          if constexpr (ROWS) {
#pragma unroll
            for (int c = 0; c < BLOCKS; ++c) {
              acc[tile][4 * c + 0] = fmaf(s0, d[c][0], acc[tile][4 * c + 0]);
              acc[tile][4 * c + 1] = fmaf(s0, d[c][1], acc[tile][4 * c + 1]);
              acc[tile][4 * c + 2] = fmaf(s1, d[c][2], acc[tile][4 * c + 2]);
              acc[tile][4 * c + 3] = fmaf(s1, d[c][3], acc[tile][4 * c + 3]);
            }
          } else {  // d[0] is row g (column 2t), d[2] row g + 8; d[1], d[3] repeat them (column 2t+1)
            acc[tile][0] = fmaf(s0, d[0][0], acc[tile][0]);
            acc[tile][1] = fmaf(s1, d[0][2], acc[tile][1]);
          }
        }
      }
    }
  }
#undef NQ_FETCH_GROUP
}

// The block's warps each hold their split's sums of the block's 16 rows for TILES tiles (rows g
// and g + 8 in lane 4 g + t, as int4_tile_dot leaves them). Afterwards thread r < 16 of the block
// holds row r's totals, each begun from its `start` (split-K's bias) and added in split order, so
// the result does not depend on which warp finished first. Every thread of the block calls it
// (one barrier).
template <int TILES, int MAX_SPLITS>
__device__ __forceinline__ void add_splits(float (&split_sums)[MAX_SPLITS][TILES][TILE_ROWS],
                                           const float (&acc)[TILES][2], const float (&start)[TILES],
                                           float (&total)[TILES]) {
  const int split = threadIdx.x / WARP_SIZE, splits = blockDim.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  if (lane % 4 == 0) {
#pragma unroll
    for (int m = 0; m < TILES; ++m) {
      split_sums[split][m][lane / 4] = acc[m][0];
      split_sums[split][m][lane / 4 + 8] = acc[m][1];
    }
  }
  __syncthreads();
  if (threadIdx.x < TILE_ROWS) {
#pragma unroll
    for (int m = 0; m < TILES; ++m) total[m] = split_sums[0][m][threadIdx.x] + start[m];
    for (int s = 1; s < splits; ++s) {
#pragma unroll
      for (int m = 0; m < TILES; ++m) total[m] += split_sums[s][m][threadIdx.x];
    }
  }
}

// Warp `split` of the block's `splits` warps multiplies input groups [split G / splits, (split + 1)
// G / splits) of the rows `rows` (lane (g, t): rows[0][0] and rows[0][1], as int4_tile_dot takes
// them) with x into acc. Decode's split-K GEMVs and the verify pass's share it, so that both cut
// K alike and a verify row's sums are decode's.
template <int K, int STAGES, bool AHEAD, int TOKENS>
__device__ __forceinline__ void split_k_tile_dot(const unsigned int* __restrict__ qweight,
                                                 const unsigned short* __restrict__ scales, const unsigned short* x,
                                                 const int (&rows)[1][2],
                                                 uint4 (&weight_ring)[STAGES][1][2][WARP_SIZE], uint4* x_ring,
                                                 int tokens, float (&acc)[1][gemv_accumulators(TOKENS)]) {
  constexpr int GROUPS = K / NQ_GROUP_SIZE;
  const int splits = blockDim.x / WARP_SIZE, split = threadIdx.x / WARP_SIZE;
  const int unused[2] = {0, 0};
  int4_tile_dot<K, 1, STAGES, false, AHEAD, TOKENS>(qweight, scales, nullptr, unused, x, rows, split * GROUPS / splits,
                                                    (split + 1) * GROUPS / splits, weight_ring, x_ring, tokens, acc);
}

// One 16-row tile of a split-K GEMV (split_k_tile_dot), each warp into its own ring; after one
// barrier thread m < 16 of the block returns MMA row m's total, begun from start() (its bias) and
// added in split order. start is called after the weights are in, so that a kernel that has no use
// for its value before then does not hold it in a register through the loop. Every thread of the
// block calls it.
// dynamic shared memory: splits x sizeof(GemvRing<STAGES, 1>)
template <int K, int STAGES, bool AHEAD, typename Start>
__device__ __forceinline__ float split_k_tile_row(const unsigned int* __restrict__ qweight,
                                                  const unsigned short* __restrict__ scales, const unsigned short* x,
                                                  const int (&rows)[1][2], Start start) {
  __shared__ float split_sums[SPLIT_K_MAX_WARPS][1][TILE_ROWS];
  float acc[1][2] = {{0.0f, 0.0f}};
  GemvRing<STAGES, 1>& ring = reinterpret_cast<GemvRing<STAGES, 1>*>(gemv_shared)[threadIdx.x / WARP_SIZE];
  split_k_tile_dot<K, STAGES, AHEAD, 1>(qweight, scales, x, rows, ring.weights, &ring.x[0][0], 1, acc);
  const float starts[1] = {start()};
  float total[1] = {0.0f};
  add_splits(split_sums, acc, starts, total);
  return total[0];
}

// Block `tile` computes rows [16 tile, 16 tile + 16) of y = W x (+ bias) with split_k_tile_row.
//   qweight uint32 [ceil(n_rows / 16), K/128, 16, 16] (quant.tile_int4), scales fp16 [n_rows, K/128],
//   bias fp16 [n_rows] or null, x fp16 [K], y fp32 [n_rows]
template <int K, int STAGES, bool AHEAD>
__device__ __forceinline__ void gemv_int4_split_k(const unsigned int* __restrict__ qweight,
                                                  const unsigned short* __restrict__ scales,
                                                  const unsigned short* __restrict__ bias,
                                                  const unsigned short* x, float* __restrict__ y, int n_rows) {
  let_next_kernel_launch();
  const int lane = threadIdx.x % WARP_SIZE;
  const int row0 = blockIdx.x * TILE_ROWS + lane / 4, row1 = row0 + 8;
  // Rows past the end (n_rows not a multiple of 16) read the last row and are not written.
  const int rows[1][2] = {{min(row0, n_rows - 1), min(row1, n_rows - 1)}};
  const int row = blockIdx.x * TILE_ROWS + threadIdx.x;
  const bool writes = threadIdx.x < TILE_ROWS && row < n_rows;
  const float total = split_k_tile_row<K, STAGES, AHEAD>(qweight, scales, x, rows, [=] {
    return writes && bias != nullptr ? half_to_float(bias[row]) : 0.0f;
  });
  if (writes) y[row] = total;
}

// One kernel per input width, so that K (and the ring depth) is a compile-time constant in each;
// NAME_ring_bytes, one warp's ring, is read by the host to size the launch.
// grid (ceil(n_rows / 16)), block (32 splits, splits <= SPLIT_K_MAX_WARPS), splits rings of shared memory
#define NQ_GEMV_INT4_KERNEL(NAME, K, STAGES, AHEAD, MIN_BLOCKS, TRACED)                                    \
  __device__ int NAME##_ring_bytes = sizeof(GemvRing<STAGES, 1>);                                          \
  extern "C" __global__ void __launch_bounds__(SPLIT_K_MAX_WARPS * WARP_SIZE, MIN_BLOCKS)                  \
      NAME(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,            \
           const unsigned short* __restrict__ bias, const unsigned short* x, float* __restrict__ y,        \
           int n_rows) {                                                                                   \
    gemv_int4_split_k<K, STAGES, AHEAD>(qweight, scales, bias, x, y, n_rows);                              \
    trace_block_done(TRACED, 0);                                                                           \
  }

// q|k|v and o request their ranges' first groups before the wait (AHEAD: the whole range where it
// fits the ring); down_proj's 15 groups per warp do not fit a ring.
NQ_GEMV_INT4_KERNEL(gemv_int4_from_hidden, NQ_HIDDEN, NQ_FROM_HIDDEN_STAGES, true, CHAIN_GEMV_MIN_BLOCKS, TRACED_FROM_HIDDEN)
NQ_GEMV_INT4_KERNEL(gemv_int4_from_q_dim, NQ_Q_DIM, NQ_FROM_Q_DIM_STAGES, true, CHAIN_GEMV_MIN_BLOCKS, TRACED_FROM_Q_DIM)
NQ_GEMV_INT4_KERNEL(gemv_int4_from_intermediate, NQ_INTERMEDIATE, NQ_FROM_INTERMEDIATE_STAGES, false, 1,
                    TRACED_FROM_INTERMEDIATE)

// Decode's q|k|v projection with RoPE and the cache write in its epilogue: what gemv_int4_from_hidden
// and rope_write_kv (elementwise.cu) do one after the other, in one kernel.
// Reference: reference/ops.py, apply_rope on q and k of int4_linear(x, qkv), then write_kv.
//
// RoPE rotates dim i of a head with dim i + head_dim/2, which a tile of 16 consecutive rows never
// holds together. So this kernel's blocks take their 16 rows in another order: block b covers 8
// dims of one head, [d, d + 8) with d = 8 (b % (head_dim / 16)), and their 8 partners
// [d + head_dim/2, d + head_dim/2 + 8). In the MMA's layout lane (g, t) then multiplies row g and
// row g + 8 of its tile, a rotation pair; after the split sums thread m < 16 of the block holds
// row m and meets its partner, thread m ^ 8, in one shuffle. No weight moves: int4_tile_dot
// fetches any row's pieces from the tiled layout, and both halves of the tile are still 512-byte
// runs. The rows keep their order in the output: q heads go rotated into q_out, K rotated and V
// as they are, in fp16, into the token's page. The kernel that came after (rope_write_kv) was a
// launch and a round trip to L2 on the step's chain of small kernels (chapter 10).
// grid (NQ_QKV_DIM / 16), block (32 splits); qweight, scales, bias as gemv_int4_from_hidden's for
// the stacked q|k|v rows; positions int32 [1] (the step's position); inv_freq fp32 [D/2];
// page_table int32; kv_layer fp16 [pages, 2, KVH, 16, D]; q_out fp32 [Q_DIM]
constexpr int ROPE_HALF = NQ_HEAD_DIM / 2;
constexpr int ROPE_PAIRS_PER_TILE = TILE_ROWS / 2;
static_assert(ROPE_HALF % ROPE_PAIRS_PER_TILE == 0, "gemv_int4_qkv_rope needs head_dim a multiple of 16");
constexpr int ROPE_TILES_PER_HEAD = ROPE_HALF / ROPE_PAIRS_PER_TILE;
__device__ int gemv_int4_qkv_rope_ring_bytes = sizeof(GemvRing<NQ_FROM_HIDDEN_STAGES, 1>);

// The dim in its head of MMA row m (0..15) of a block whose first dim is first_dim.
__device__ __forceinline__ int rope_tile_dim(int first_dim, int m) {
  return first_dim + m % ROPE_PAIRS_PER_TILE + (m >= ROPE_PAIRS_PER_TILE ? ROPE_HALF : 0);
}

// Lane (g, t)'s rows of tile `tile` (a block's, in the GEMV kernels): head_slot's dims g and g + 8
// of the tile's order.
__device__ __forceinline__ void rope_tile_rows(int tile, int (&rows)[1][2], int& head_slot, int& first_dim) {
  const int lane = threadIdx.x % WARP_SIZE;
  head_slot = tile / ROPE_TILES_PER_HEAD;  // query heads, then K heads, then V heads
  first_dim = tile % ROPE_TILES_PER_HEAD * ROPE_PAIRS_PER_TILE;
  const int head_row = head_slot * NQ_HEAD_DIM;
  rows[0][0] = head_row + rope_tile_dim(first_dim, lane / 4);
  rows[0][1] = head_row + rope_tile_dim(first_dim, lane / 4 + 8);
}

// Dim `dim` of head slot `head_slot` of one token: a query head's rotated value into its q row
// (q_row fp32 [Q_DIM]), a K head's rotated one and a V head's as it is (`total`), fp16, into row
// `slot` of `page`.
__device__ __forceinline__ void store_qkv_dim(int head_slot, int dim, float total, float rotated, long long page,
                                              int slot, unsigned short* __restrict__ kv_layer, float* __restrict__ q_row) {
  if (head_slot < NQ_NUM_HEADS) {
    q_row[head_slot * NQ_HEAD_DIM + dim] = rotated;
    return;
  }
  const int kv_slot = head_slot - NQ_NUM_HEADS;
  const bool is_key = kv_slot < NQ_NUM_KV_HEADS;
  kv_layer[kv_index(page, is_key ? 0 : 1, is_key ? kv_slot : kv_slot - NQ_NUM_KV_HEADS, slot, dim)] =
      float_to_half(is_key ? rotated : total);
}

extern "C" __global__ void __launch_bounds__(SPLIT_K_MAX_WARPS * WARP_SIZE, CHAIN_GEMV_MIN_BLOCKS)
gemv_int4_qkv_rope(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                   const unsigned short* __restrict__ bias, const unsigned short* x,
                   const int* __restrict__ positions, const float* __restrict__ inv_freq,
                   const int* __restrict__ page_table, unsigned short* __restrict__ kv_layer,
                   float* __restrict__ q_out) {
  let_next_kernel_launch();
  const int split = threadIdx.x / WARP_SIZE;
  int rows[1][2], head_slot, first_dim;
  rope_tile_rows(blockIdx.x, rows, head_slot, first_dim);
  const int head_row = head_slot * NQ_HEAD_DIM;
  // Thread m < 16 finishes row m. Its bias, rotation and page are no kernel's output (the position
  // and the page table are the step's inputs): all of them before the wait, inside int4_tile_dot.
  const bool finishes = threadIdx.x < TILE_ROWS;
  const int dim = rope_tile_dim(first_dim, threadIdx.x % TILE_ROWS);
  const int position = positions[0];
  float c = 1.0f, s = 0.0f;
  long long page = 0;
  if (finishes) {
    rope_cos_sin(position, inv_freq[dim % ROPE_HALF], c, s);
    if (head_slot >= NQ_NUM_HEADS) page = page_table[position / NQ_PAGE_SIZE];
  }
  const float start = finishes && bias != nullptr ? half_to_float(bias[head_row + dim]) : 0.0f;
  const float total = split_k_tile_row<NQ_HIDDEN, NQ_FROM_HIDDEN_STAGES, true>(qweight, scales, x, rows,
                                                                                           [start] { return start; });
  if (split != 0) return;
  const float partner = __shfl_xor_sync(FULL_MASK, total, ROPE_PAIRS_PER_TILE);  // rows m and m ^ 8
  if (!finishes) return;
  const bool first = threadIdx.x < ROPE_PAIRS_PER_TILE;  // dim i, not i + head_dim/2
  store_qkv_dim(head_slot, dim, total, rope_rotate(total, partner, c, s, first), page, position % NQ_PAGE_SIZE,
                kv_layer, q_out);
  trace_block_done(TRACED_QKV_ROPE, 0);
}

// The MLP's first half with SwiGLU fused: h = silu(gate x) * (up x), as fp16 for down_proj.
// Reference: reference/ops.py, silu_mul(int4_linear(x, gate), int4_linear(x, up)).
// qweight/scales hold gate's rows then up's ([2 I, H] tiled, [2 I, H/128]). Block `tile` takes the
// same 16 rows of both; its `splits` warps (blockDim.x / 32) split the input groups as the split-K
// GEMVs do and add their sums in split order, and its first 16 threads apply silu to the finished
// sums. How many warps a tile takes is the plan's (plan.gate_up_splits): more make each block
// shorter, so that the SMs that free up last hold their final blocks for less time.
// grid (ceil(I / 16)), block (32 splits, splits <= GATE_UP_MAX_SPLITS), splits rings of shared
// memory; h fp16 [I]
constexpr int GATE_UP_MAX_SPLITS = 4;  // warps of a gate+up block
NQ_EXPORT_INT(GATE_UP_MAX_SPLITS)
// gate+up compiles for this many blocks of GATE_UP_MAX_SPLITS warps per SM: at most 96 registers
// a thread, so the plan counts its blocks per SM without a GPU (the build takes about 94; fewer
// spill).
constexpr int GATE_UP_MIN_BLOCKS = 5;
NQ_EXPORT_INT(GATE_UP_MIN_BLOCKS)
using GateUpRing = GemvRing<NQ_GATE_UP_STAGES, 2>;
__device__ int gemv_int4_gate_up_silu_ring_bytes = sizeof(GateUpRing);  // read by the host to size the launch

// Block blockIdx.x's tile of gate's rows and the same rows of up, times x, its warps splitting the
// input groups: stages the two tiles' scales in `tile_scales` and leaves each warp's sums in acc
// (int4_tile_dot's layout, tile 0 gate's, tile 1 up's). Decode's kernel and the verify pass's.
template <int STAGES, int TOKENS>
__device__ __forceinline__ void gate_up_tile_dot(const unsigned int* __restrict__ qweight,
                                                 const unsigned short* __restrict__ scales, const unsigned short* x,
                                                 unsigned short (&tile_scales)[2][TILE_ROWS * (NQ_HIDDEN / NQ_GROUP_SIZE)],
                                                 uint4 (&weight_ring)[STAGES][2][2][WARP_SIZE], uint4* x_ring,
                                                 int tokens, float (&acc)[2][gemv_accumulators(TOKENS)]) {
  constexpr int GROUPS = NQ_HIDDEN / NQ_GROUP_SIZE;
  const int splits = blockDim.x / WARP_SIZE, split = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int first_row = blockIdx.x * TILE_ROWS, tile_rows = min(TILE_ROWS, NQ_INTERMEDIATE - first_row);
  stage_scales(tile_scales[0], scales + (long long)first_row * GROUPS, tile_rows * GROUPS, threadIdx.x, blockDim.x);
  stage_scales(tile_scales[1], scales + (long long)(NQ_INTERMEDIATE + first_row) * GROUPS, tile_rows * GROUPS,
               threadIdx.x, blockDim.x);
  const int row0 = first_row + lane / 4, row1 = row0 + 8;
  const int gate0 = min(row0, NQ_INTERMEDIATE - 1), gate1 = min(row1, NQ_INTERMEDIATE - 1);
  const int rows[2][2] = {{gate0, gate1}, {NQ_INTERMEDIATE + gate0, NQ_INTERMEDIATE + gate1}};
  const int scale_rows[2] = {gate0 - first_row, gate1 - first_row};  // up's rows sit as gate's in their tile
  int4_tile_dot<NQ_HIDDEN, 2, STAGES, true, false, TOKENS>(qweight, scales, tile_scales[0], scale_rows, x, rows,
                                                           split * GROUPS / splits, (split + 1) * GROUPS / splits,
                                                           weight_ring, x_ring, tokens, acc);
}

// silu(g) * u = g / (1 + exp(-g)) * u, in fp32 with the accurate expf.
__device__ __forceinline__ float silu_times(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

extern "C" __global__ void __launch_bounds__(GATE_UP_MAX_SPLITS * WARP_SIZE, GATE_UP_MIN_BLOCKS)
gemv_int4_gate_up_silu(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                       const unsigned short* x, unsigned short* __restrict__ h) {
  __shared__ __align__(16) unsigned short tile_scales[2][TILE_ROWS * (NQ_HIDDEN / NQ_GROUP_SIZE)];  // gate's, up's
  __shared__ float split_sums[GATE_UP_MAX_SPLITS][2][TILE_ROWS];
  let_next_kernel_launch();
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  GateUpRing& ring = reinterpret_cast<GateUpRing*>(gemv_shared)[threadIdx.x / WARP_SIZE];
  gate_up_tile_dot<NQ_GATE_UP_STAGES, 1>(qweight, scales, x, tile_scales, ring.weights, &ring.x[0][0], 1, acc);
  const float start[2] = {0.0f, 0.0f};
  float total[2];  // gate's, up's
  add_splits(split_sums, acc, start, total);
  const int row = blockIdx.x * TILE_ROWS + threadIdx.x;
  if (threadIdx.x < TILE_ROWS && row < NQ_INTERMEDIATE) h[row] = float_to_half(silu_times(total[0], total[1]));
  trace_block_done(TRACED_GATE_UP, 0);
}

// Prefill multiplies whole prompts, which cuBLAS does best from fp16 matrices: this expands a
// packed matrix (weights tiled, scales row-major) into a row-major scratch buffer, one word (8
// weights, one 16-byte store) per thread. The fp32 product (nibble - 8) * scale is rounded to
// fp16 (relative error <= 2^-11).
// grid-stride over n_rows * in_features / 8 words; out fp16 [n_rows, in_features]
extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)
dequantize_int4_to_half(const unsigned int* __restrict__ qweight, const unsigned short* __restrict__ scales,
                        uint4* __restrict__ out, int n_rows, int in_features) {
  const long long words_per_row = in_features / 8;
  const long long total = (long long)n_rows * words_per_row;
  const int groups = in_features / NQ_GROUP_SIZE;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / words_per_row, word_in_row = i % words_per_row, group = word_in_row / WORDS_PER_GROUP;
    const long long tiled_row = (row / TILE_ROWS * groups + group) * TILE_ROWS + row % TILE_ROWS;
    const float scale = half_to_float(scales[row * groups + group]);
    unsigned int pairs[4];
    unpack_int4_word(qweight[tiled_row * WORDS_PER_GROUP + word_in_row % WORDS_PER_GROUP], pairs);
    unsigned int packed[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float2 q = half2_to_float2(pairs[p]);
      packed[p] = float2_to_half2(q.x * scale, q.y * scale);
    }
    out[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}
