// sampler.cu: the device sampler, the decode step's last kernel (argmax_select_next).
//
// It reduces the lm_head's per-block candidates to the step's token (greedy, or a Gumbel-max
// draw at a temperature), applies top-k and top-p on the device when the request asks for them,
// advances the decode state for the next step and stores the state's head where the host reads
// it. Reference: nanoqwen/sampling.py (sample, nucleus, most_likely_first).
//
#pragma once  // verify.cu includes it too, for its multi-row kernels
#include "common.cuh"
#include "sampler.cuh"

// ---------------------------------------------------------------- top-k and top-p on the device
// nanoqwen.sampling.sample with a filter: keep the top_k most likely tokens (ties to the lower id),
// then the shortest run of them, most likely first, whose probability reaches top_p of theirs,
// then the Gumbel-max draw among what is left. A top-p alone weighs every token: the device keeps
// the TOP_K_MAX most likely, and when the run is longer than those (a flat distribution) it
// leaves the draw to the host, as nanoqwen.sampling.nucleus first looks among its most likely.
//
// One block does it over the step's logits, which lm_head_logits just left in L2, in three passes:
// each thread's largest logit gives a floor for the k-th largest, a histogram of the top 12 bits
// of the logits above the floor finds the bucket that holds the k-th, and the logits from that
// bucket up (a few thousand at most, unless many logits tie) go to shared memory, where a radix
// select finds the k-th largest of (logit, id) pairs: ties by id come for free. When that bucket
// is too full, kth_largest and gather_top_k do the same over the logits a byte at a time, in six
// passes. A bitonic sort orders the k kept for the nucleus.
constexpr int ARGMAX_THREADS = 1024;
constexpr int TOP_K_MAX = ARGMAX_THREADS;  // one kept token per thread
NQ_EXPORT_INT(ARGMAX_THREADS)
NQ_EXPORT_INT(TOP_K_MAX)
constexpr int BUCKET_BITS = 12;            // of a logit's order key, in the first pass's histogram
constexpr int BUCKETS = 1 << BUCKET_BITS;
constexpr int POOL = 4096;                 // (logit, id) pairs that shared memory takes
constexpr int NO_DIGIT = 256;              // a logit outside the radix select's current prefix
static_assert(BUCKETS * sizeof(unsigned int) <= POOL * sizeof(unsigned long long), "the histogram lives in the pool");
static_assert(POOL >= TOP_K_MAX && POOL % ARGMAX_THREADS == 0, "the pool holds the kept, a whole number per thread");
static_assert(ARGMAX_THREADS == WARP_SIZE * WARP_SIZE, "one warp reduces the warps' totals, a lane each");

// A float's bits as an unsigned key in the float's order; -0 counts as +0, as numpy compares them.
__device__ __forceinline__ unsigned int order_key(float value) {
  unsigned int bits = __float_as_uint(value);
  if (bits == 0x80000000u) bits = 0u;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// (logit, id) as one 64-bit word in the order the filters keep: larger logits first, then lower ids.
__device__ __forceinline__ unsigned long long pack_kept(unsigned int key, int id) {
  return ((unsigned long long)key << 32) | (0xffffffffu - (unsigned int)id);
}
__device__ __forceinline__ int kept_id(unsigned long long packed) {
  return (int)(0xffffffffu - (unsigned int)(packed & 0xffffffffu));
}

// The block's largest (value, index) pair, ties to the lower index (better_candidate's order);
// every thread gets it. Two calls need a barrier between them: they share the warps' slots.
__device__ __forceinline__ void block_argmax(float& value, int& index) {
  __shared__ float warp_values[ARGMAX_THREADS / WARP_SIZE];
  __shared__ int warp_indices[ARGMAX_THREADS / WARP_SIZE];
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  warp_argmax(value, index);
  if (lane == 0) {
    warp_values[warp] = value;
    warp_indices[warp] = index;
  }
  __syncthreads();
  value = warp_values[lane];  // ARGMAX_THREADS / WARP_SIZE = WARP_SIZE warps
  index = warp_indices[lane];
  warp_argmax(value, index);  // every warp reduces the same 32 candidates
}

// Exclusive prefix sum of `value` over the block's ARGMAX_THREADS threads; scratch int [WARP_SIZE], shared.
__device__ __forceinline__ int block_exclusive_scan(int value, int* scratch) {
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
    const int other = __shfl_up_sync(FULL_MASK, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == WARP_SIZE - 1) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {  // ARGMAX_THREADS / WARP_SIZE = WARP_SIZE warps
    const int warp_total = scratch[lane];
    int warp_inclusive = warp_total;
#pragma unroll
    for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
      const int other = __shfl_up_sync(FULL_MASK, warp_inclusive, offset);
      if (lane >= offset) warp_inclusive += other;
    }
    scratch[lane] = warp_inclusive - warp_total;
  }
  __syncthreads();
  const int exclusive = scratch[warp] + inclusive - value;
  __syncthreads();  // scratch is free again
  return exclusive;
}

// One shared-memory atomic per distinct `digit` in the warp (NO_DIGIT: none): the high digits of
// similar logits collide, and an atomic per logit would serialise on them. Every lane calls it.
__device__ __forceinline__ void count_digit(unsigned int* histogram, int digit) {
  if (__any_sync(FULL_MASK, digit != NO_DIGIT)) {
    const unsigned int peers = __match_any_sync(FULL_MASK, digit);
    if (digit != NO_DIGIT && threadIdx.x % WARP_SIZE == __ffs(peers) - 1) atomicAdd(&histogram[digit], __popc(peers));
  }
}

// A slot of `count` for each lane that wants one, one atomic per warp. Every lane calls it.
__device__ __forceinline__ int claim_slot(bool wants, int* count) {
  const unsigned int wanting = __ballot_sync(FULL_MASK, wants);
  const int lane = threadIdx.x % WARP_SIZE, leader = __ffs(wanting) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(count, __popc(wanting));
  base = __shfl_sync(FULL_MASK, base, leader < 0 ? 0 : leader);
  return base + __popc(wanting & ((1u << lane) - 1u));
}

// visit(i, logits[i]) for every id i < n, and visit(i, 0) for some i >= n up to the last whole
// round (so that every lane of a warp takes part in each call). One block reads 608 KB this way
// per pass: LOGIT_BATCH 16-byte loads are in flight per thread before the first is used, or each
// pass would wait out dozens of round trips to L2 in a row. `logits` is 16-byte aligned.
constexpr int LOGIT_BATCH = 4;

template <typename Visit>
__device__ __forceinline__ void for_each_logit(const float* logits, int n, Visit visit) {
  const float4* quads = reinterpret_cast<const float4*>(logits);
  const int whole_quads = n / 4;
  for (int base = 0; base * 4 < n; base += LOGIT_BATCH * ARGMAX_THREADS) {
    float4 values[LOGIT_BATCH];
#pragma unroll
    for (int j = 0; j < LOGIT_BATCH; ++j) {
      const int q = base + j * ARGMAX_THREADS + threadIdx.x;
      if (q < whole_quads) {
        values[j] = quads[q];
      } else {  // the last, partial quad, or past the end
        const int i = 4 * q;
        values[j] = make_float4(i < n ? logits[i] : 0.0f, i + 1 < n ? logits[i + 1] : 0.0f,
                                i + 2 < n ? logits[i + 2] : 0.0f, i + 3 < n ? logits[i + 3] : 0.0f);
      }
    }
#pragma unroll
    for (int j = 0; j < LOGIT_BATCH; ++j) {
      const int i = 4 * (base + j * ARGMAX_THREADS + threadIdx.x);
      visit(i, values[j].x);
      visit(i + 1, values[j].y);
      visit(i + 2, values[j].z);
      visit(i + 3, values[j].w);
    }
  }
}

// Warp 0's search of a radix select's `histogram` [256] for the digit, from the largest down,
// whose bucket holds the remaining-th largest (1 <= remaining <= the histogram's total): exactly
// one lane returns true, with that digit and the count in the digits above it. Lane l holds
// digits 255-8l down to 248-8l; a shuffle scan of the lanes' totals gives each the count above
// its first. Every lane of warp 0 calls it.
__device__ __forceinline__ bool find_digit(const unsigned int* histogram, int remaining, int& digit, int& above) {
  const int lane = threadIdx.x % WARP_SIZE;
  int total = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) total += histogram[255 - 8 * lane - j];
  int running = total;
#pragma unroll
  for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
    const int other = __shfl_up_sync(FULL_MASK, running, offset);
    if (lane >= offset) running += other;
  }
  running -= total;
  bool found = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int candidate = 255 - 8 * lane - j, count = histogram[candidate];
    if (running < remaining && remaining <= running + count) {
      found = true;
      digit = candidate;
      above = running;
    }
    running += count;
  }
  return found;
}

// The fallback's radix select over logits [n], a byte at a time from the top: the order key of
// the k-th largest, and how many of the logits equal to it are among the k largest (`ties_kept`).
__device__ void kth_largest(const float* logits, int n, int k, unsigned int& threshold, int& ties_kept) {
  __shared__ unsigned int histogram[256];
  __shared__ unsigned int chosen_prefix;
  __shared__ int chosen_remaining;
  unsigned int prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += ARGMAX_THREADS) histogram[i] = 0;
    __syncthreads();
    for_each_logit(logits, n, [&](int i, float value) {
      const unsigned int key = order_key(value);
      count_digit(histogram, i < n && (key & mask) == prefix ? (key >> shift) & 255u : NO_DIGIT);
    });
    __syncthreads();
    int digit, above;
    if (threadIdx.x < WARP_SIZE && find_digit(histogram, remaining, digit, above)) {
      chosen_prefix = prefix | ((unsigned int)digit << shift);
      chosen_remaining = remaining - above;
    }
    __syncthreads();
    prefix = chosen_prefix;
    remaining = chosen_remaining;
    mask |= 255u << shift;
    __syncthreads();  // before the next round clears the histogram warp 0 just read
  }
  threshold = prefix;
  ties_kept = remaining;
}

// The fallback's top_k into pool[0, k), in no order: those above the threshold, then the lowest
// ids of those equal to it. Each thread walks a contiguous run of ids, so a scan of the
// per-thread tie counts ranks the ties in id order.
__device__ void gather_top_k(const float* logits, int n, int k, unsigned int threshold, int ties_kept,
                             unsigned long long* pool, int* scratch) {
  __shared__ int above_count;
  if (threadIdx.x == 0) above_count = 0;
  const int run = (n + ARGMAX_THREADS - 1) / ARGMAX_THREADS;
  const int begin = min(n, threadIdx.x * run), end = min(n, begin + run);
  int ties = 0;
#pragma unroll 8
  for (int i = begin; i < end; ++i) ties += order_key(logits[i]) == threshold;
  int rank = block_exclusive_scan(ties, scratch);  // also orders above_count's reset
  const int above = k - ties_kept;
#pragma unroll 8
  for (int i = begin; i < end; ++i) {
    const unsigned int key = order_key(logits[i]);
    if (key > threshold) {
      pool[atomicAdd(&above_count, 1)] = pack_kept(key, i);
    } else if (key == threshold) {
      if (rank < ties_kept) pool[above + rank] = pack_kept(key, i);
      ++rank;
    }
  }
  __syncthreads();
}

// The bucket of `histogram` [BUCKETS] that holds the k-th largest logit, and how many logits lie
// in the buckets above it. Thread t scans buckets BUCKETS-1-4t down to BUCKETS-4-4t; a scan of
// the threads' totals gives each the count above its first.
__device__ __forceinline__ void bucket_of_kth(const unsigned int* histogram, int k, int* scratch, int& bucket, int& above) {
  __shared__ int chosen_bucket, chosen_above;
  constexpr int PER_THREAD = BUCKETS / ARGMAX_THREADS;
  const int first = BUCKETS - 1 - PER_THREAD * threadIdx.x;
  int total = 0;
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) total += histogram[first - j];
  int running = block_exclusive_scan(total, scratch);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int count = histogram[first - j];
    if (running < k && k <= running + count) {  // exactly one thread, one bucket: 1 <= k <= n
      chosen_bucket = first - j;
      chosen_above = running;
    }
    running += count;
  }
  __syncthreads();
  bucket = chosen_bucket;
  above = chosen_above;
}

// The (remaining)-th largest of the `count` pairs in pool whose top BUCKET_BITS bits are
// `bucket`'s, by a radix select over their other 52 bits in shared memory; it stops as soon as a
// digit's bucket holds exactly the pairs still wanted. Every pair >= the result is kept.
__device__ unsigned long long kth_largest_pair(const unsigned long long* pool, int count, int bucket, int remaining) {
  __shared__ unsigned int histogram[256];
  __shared__ unsigned long long chosen_prefix;
  __shared__ int chosen_remaining, settled;
  constexpr int KNOWN = 64 - BUCKET_BITS;  // bits below the bucket's
  unsigned long long prefix = (unsigned long long)bucket << KNOWN, mask = ~0ull << KNOWN;
  for (int shift = KNOWN - 8; ; shift = max(shift - 8, 0)) {
    for (int i = threadIdx.x; i < 256; i += ARGMAX_THREADS) histogram[i] = 0;
    __syncthreads();
    for (int base = 0; base < count; base += ARGMAX_THREADS) {  // whole rounds: count_digit needs every lane
      const int i = base + threadIdx.x;
      count_digit(histogram, i < count && (pool[i] & mask) == prefix ? (int)((pool[i] >> shift) & 255u) : NO_DIGIT);
    }
    __syncthreads();
    int digit, above;
    if (threadIdx.x < WARP_SIZE && find_digit(histogram, remaining, digit, above)) {
      chosen_prefix = prefix | ((unsigned long long)digit << shift);
      chosen_remaining = remaining - above;
      settled = (int)histogram[digit] == remaining - above || shift == 0;  // every pair of this digit is kept
    }
    __syncthreads();
    prefix = chosen_prefix;
    remaining = chosen_remaining;
    mask |= 255ull << shift;
    const bool done = settled;
    __syncthreads();  // before the next round clears the histogram warp 0 just read
    if (done) return prefix;
  }
}

// sorted[0, TOP_K_MAX) in descending order, one element per thread (a bitonic network).
__device__ void sort_descending(unsigned long long* sorted) {
  for (int size = 2; size <= TOP_K_MAX; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const int i = threadIdx.x, partner = i ^ stride;
      if (partner > i) {
        const unsigned long long a = sorted[i], b = sorted[partner];
        if ((a < b) == ((i & size) == 0)) {  // descending runs where bit `size` of i is clear
          sorted[i] = b;
          sorted[partner] = a;
        }
      }
      __syncthreads();
    }
  }
}

// A logit's weight in the softmax at temperature T, relative to the largest logit `top`: float64,
// as the host's nanoqwen.sampling.nucleus computes it.
__device__ __forceinline__ double softmax_weight(float logit, float top, double temperature) {
  return exp(((double)logit - (double)top) / temperature);
}

// The token sample() draws with top-k (and top-p) from logits [n] whose largest is `top`, at the
// step after `position`; or -1 when the host must draw it: a top-p over every token
// (settings.nucleus_of_all) whose run does not end among the top_k most likely, which this keeps.
// Every thread of the block calls it; every thread gets the result.
__device__ int filtered_draw(const float* logits, int n, float top, const SamplerSettings& settings, int position) {
  __shared__ unsigned long long pool[POOL];  // first the histogram, then pairs, then the kept
  __shared__ double weights[TOP_K_MAX];
  __shared__ double warp_totals[ARGMAX_THREADS / WARP_SIZE];
  __shared__ int scratch[WARP_SIZE];
  __shared__ int pairs, members;
  const int k = settings.top_k;
  unsigned int* histogram = reinterpret_cast<unsigned int*>(pool);

  // Pass 1: each thread's largest logit, and for a top-p alone the mass of every token, float64
  // as the host's nanoqwen.sampling.nucleus weighs them. The k-th largest of the threads' largest
  // is a floor for the k-th largest logit (k threads hold a logit at least that large), so the
  // histogram below counts only the logits above that floor: a few thousand at most, which keeps
  // its shared-memory atomics (many logits, near one another, collide on one bucket) cheap.
  unsigned int largest = 0;
  double mass_of_all = 0.0;
  for_each_logit(logits, n, [&](int i, float value) {
    if (i < n) largest = max(largest, order_key(value));
    if (settings.nucleus_of_all && i < n) mass_of_all += softmax_weight(value, top, settings.temperature);
  });
  pool[threadIdx.x] = pack_kept(largest, threadIdx.x);
  __syncthreads();
  sort_descending(pool);
  const unsigned int floor_key = (unsigned int)(pool[k - 1] >> 32);
  __syncthreads();  // every thread has its floor: the pool takes the histogram now

  // Pass 2: the top bits' histogram of the logits above the floor.
  for (int i = threadIdx.x; i < BUCKETS; i += ARGMAX_THREADS) histogram[i] = 0;
  if (threadIdx.x == 0) pairs = 0;
  __syncthreads();
  for_each_logit(logits, n, [&](int i, float value) {
    const unsigned int key = order_key(value);
    count_digit(histogram, i < n && key >= floor_key ? (int)(key >> (32 - BUCKET_BITS)) : NO_DIGIT);
  });
  __syncthreads();
  int bucket, above;
  bucket_of_kth(histogram, k, scratch, bucket, above);
  const int candidates = above + (int)histogram[bucket];
  __syncthreads();  // every thread has read the histogram: the pool takes pairs now

  if (candidates <= POOL) {
    // Pass 3: the pairs above the floor from the k-th's bucket up into the pool, then the k-th
    // largest among them.
    for_each_logit(logits, n, [&](int i, float value) {
      const unsigned int key = order_key(value);
      const bool wanted = i < n && key >= floor_key && (int)(key >> (32 - BUCKET_BITS)) >= bucket;
      const int slot = claim_slot(wanted, &pairs);
      if (wanted) pool[slot] = pack_kept(key, i);
    });
    __syncthreads();
    const unsigned long long kth = kth_largest_pair(pool, candidates, bucket, k - above);
    unsigned long long mine[POOL / ARGMAX_THREADS];  // read them all before any moves
#pragma unroll
    for (int j = 0; j < POOL / ARGMAX_THREADS; ++j) {
      const int i = j * ARGMAX_THREADS + threadIdx.x;
      mine[j] = i < candidates ? pool[i] : 0ull;
    }
    if (threadIdx.x == 0) pairs = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < POOL / ARGMAX_THREADS; ++j) {
      const bool kept = mine[j] >= kth;  // 0 (no pair) is below every pair
      const int slot = claim_slot(kept, &pairs);
      if (kept) pool[slot] = mine[j];
    }
  } else {  // a bucket too full for the pool: many logits tie, or nearly
    unsigned int threshold;
    int ties_kept;
    kth_largest(logits, n, k, threshold, ties_kept);
    gather_top_k(logits, n, k, threshold, ties_kept, pool, scratch);
  }
  __syncthreads();  // pool[0, k) holds the kept pairs

  if (settings.top_p < 1.0) {
    if (threadIdx.x >= k) pool[threadIdx.x] = 0ull;  // below every pair
    __syncthreads();
    sort_descending(pool);  // most likely first, ties by id
    // Each kept token's weight exp((logit - top) / T), the mass they share (or that of every token)
    // by a block sum, and the run's mass in order by one thread, as numpy's cumsum adds it.
    weights[threadIdx.x] =
        threadIdx.x < k ? softmax_weight(logits[kept_id(pool[threadIdx.x])], top, settings.temperature) : 0.0;
    const double total = block_sum<ARGMAX_THREADS>(settings.nucleus_of_all ? mass_of_all : weights[threadIdx.x],
                                                   warp_totals);  // its barrier also publishes weights
    if (threadIdx.x == 0) {
      const double target = settings.top_p * total;
      double mass = 0.0;
      int length = settings.nucleus_of_all && k < n ? -1 : k;  // a run past the kept: the host's
      for (int i = 0; i < k; ++i) {
        mass += weights[i];
        if (mass >= target) {
          length = i + 1;
          break;
        }
      }
      members = length;
    }
  } else if (threadIdx.x == 0) {
    members = k;
  }
  __syncthreads();
  if (members < 0) return -1;
  const unsigned int step = noise_step(settings, position);
  float value = NEGATIVE_INFINITY;
  int index = 0x7fffffff;
  if (threadIdx.x < members) {
    index = kept_id(pool[threadIdx.x]);
    value = (float)__dadd_rn((double)logits[index], __dmul_rn(settings.temperature, gumbel_noise(step, index)));
  }
  block_argmax(value, index);
  return index;
}

// The lm_head's per-block candidates [0, count) reduced to the best (value, index), which every
// thread gets; true when some block saw a NaN or +inf logit (its candidate value is NaN). The
// whole block calls it; a barrier comes before its use of shared memory, so calls may follow each
// other.
__device__ __forceinline__ bool reduce_candidates(const float* values, const int* indices, int count, float& value,
                                                  int& index) {
  value = NEGATIVE_INFINITY;
  index = 0;
  bool flagged = false;
  for (int c = threadIdx.x; c < count; c += ARGMAX_THREADS) {
    flagged |= values[c] != values[c];  // NaN
    if (better_candidate(values[c], indices[c], value, index)) {
      value = values[c];
      index = indices[c];
    }
  }
  flagged = __syncthreads_or(flagged);
  block_argmax(value, index);
  return flagged;
}

// The decode step's last kernel: reduce the lm_head's per-block candidates to the chosen token
// (the argmax of the keys: the logits when greedy, logit + T * noise when sampling), store it as
// the next step's input token, and advance position and sequence length, so consecutive steps
// can run without the host touching the state. With a top-k in `sampler` the candidates give the
// largest logit, and filtered_draw chooses among the kept logits instead, or, for a top-p run
// longer than it keeps, sets the status STATUS_HOST_DRAWS: the host draws from the logits.
// It also leaves the new head of the state (token, position, seq_len, status) where the host
// reads it without a copy in the stream: row position % slots of `head_slots`, pinned host memory
// mapped into the GPU's address space (null: not written). A device-to-host copy after each step
// ran between two graph launches; a store to host memory inside the kernel does not
// (nanoqwen.cuda.backend.CudaBackend.next_tokens reads the rows). A step that leaves its draw to
// the host copies its logits to row position % slots of `handed_back`, where the step queued
// behind it, which overwrites `logits`, does not write unless it hands back too.
// grid (1), block (ARGMAX_THREADS); state int32 [STATE_PAGE_TABLE + pages] (common.cuh);
// head_slots int32 [slots, STATE_PAGE_TABLE] or null; logits fp32 [NQ_VOCAB]; sampler: null, greedy;
// handed_back fp32 [slots, NQ_VOCAB] or null.
// The candidates and logits are lm_head_logits' output: ordinary loads, as for x above.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_select_next(const float* candidate_values, const int* candidate_indices,
                   int num_candidates, int* __restrict__ state, int* __restrict__ head_slots, int slots,
                   const float* logits, const SamplerSettings* sampler, float* __restrict__ handed_back) {
  let_next_kernel_launch();
  // As in lm_head_logits: no kernel of this step writes the sampler or the position.
  const bool filter = sampler != nullptr && sampler->top_k > 0 && sampler->temperature > 0;
  const int position = state[STATE_POSITION];
  wait_for_previous_kernel();  // the candidates are lm_head_logits' output
  float value;
  int index;
  const bool flagged = reduce_candidates(candidate_values, candidate_indices, num_candidates, value, index);
  const bool usable = !flagged && value != NEGATIVE_INFINITY;
  int status = usable ? 0 : STATUS_NOT_FINITE;
  if (filter && usable) {
    const int drawn = filtered_draw(logits, NQ_VOCAB, value, *sampler, position);
    if (drawn < 0) {  // the token stays the argmax, for no one to read
      status = STATUS_HOST_DRAWS;
      if (handed_back != nullptr) {
        float* copy = handed_back + (long long)(position % slots) * NQ_VOCAB;
        for_each_logit(logits, NQ_VOCAB, [&](int i, float value) {
          if (i < NQ_VOCAB) copy[i] = value;
        });
      }
    } else {
      index = drawn;
    }
  }
  if (threadIdx.x == 0) {
    const int head[STATE_PAGE_TABLE] = {index, position + 1, state[STATE_SEQ_LEN] + 1, status};
#pragma unroll
    for (int i = 0; i < STATE_PAGE_TABLE; ++i) state[i] = head[i];
    if (head_slots != nullptr) {
      int* row = head_slots + (long long)(position % slots) * STATE_PAGE_TABLE;
#pragma unroll
      for (int i = 0; i < STATE_PAGE_TABLE; ++i) row[i] = head[i];
    }
  }
}
