// common.cuh: what every nanoqwen kernel file shares.
//
// The model's dimensions arrive as preprocessor constants (-DNQ_HIDDEN=3584 ...), set by
// nanoqwen/cuda/build.py from the ModelConfig, so loop bounds and strides are compile-time
// numbers the compiler can unroll. Half-precision values travel as raw 16-bit patterns
// (`unsigned short`, two of them in an `unsigned int`) and are converted with one PTX
// instruction each: the sources then need no CUDA header at all, and compile the same under
// NVRTC (CuPy, at engine start) and under plain nvcc (CI's compile check).
#pragma once

#if !defined(NQ_HIDDEN) || !defined(NQ_INTERMEDIATE) || !defined(NQ_NUM_HEADS) ||         \
    !defined(NQ_NUM_KV_HEADS) || !defined(NQ_HEAD_DIM) || !defined(NQ_VOCAB) ||           \
    !defined(NQ_GROUP_SIZE) || !defined(NQ_PAGE_SIZE) || !defined(NQ_RMS_EPS)
#error "compile with the model's dimensions: nanoqwen.cuda.build.kernel_defines(config) lists the -D options"
#endif

#define NQ_Q_DIM (NQ_NUM_HEADS * NQ_HEAD_DIM)
#define NQ_KV_DIM (NQ_NUM_KV_HEADS * NQ_HEAD_DIM)
#define NQ_QKV_DIM (NQ_Q_DIM + 2 * NQ_KV_DIM)

static_assert(NQ_HIDDEN % 128 == 0 && NQ_INTERMEDIATE % 128 == 0 && NQ_Q_DIM % 128 == 0,
              "projection inputs must split into whole INT4 groups of 128");
static_assert(NQ_GROUP_SIZE == 128, "the INT4 GEMV maps one group onto 4 lanes x 32 weights");
static_assert(NQ_HEAD_DIM % 2 == 0 && NQ_HEAD_DIM <= 256, "RoPE pairs dim i with i + head_dim/2");

// The decode step's inputs live in one device int32 array so that one host-to-device copy
// sets them and a captured CUDA graph can read them at fixed addresses. The host reads these
// offsets from this file (nanoqwen/cuda/abi.py) and checks them against the compiled module.
#define STATE_TOKEN 0       // token id fed to the step; the greedy argmax writes the next one
#define STATE_POSITION 1    // position of that token in its sequence
#define STATE_SEQ_LEN 2     // positions attention reads: position + 1
#define STATE_STATUS 3      // the argmax writes 1 if the logits held NaN or +inf (or all -inf), 2 if the host must
                            // draw (a top-p's run is longer than the device keeps), else 0
#define STATUS_NOT_FINITE 1
#define STATUS_HOST_DRAWS 2
#define STATE_PAGE_TABLE 4  // the sequence's page table starts here

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int ELEMENTWISE_THREADS = 256;  // block of the grid-stride elementwise kernels

// A number the host must launch or index with, exported from every compiled module as
// `abi_NAME`: nanoqwen/cuda/abi.py reads NAME from the source and checks the module agrees.
#define NQ_EXPORT_INT(NAME) __device__ int abi_##NAME = NAME;
NQ_EXPORT_INT(STATE_TOKEN)
NQ_EXPORT_INT(STATE_POSITION)
NQ_EXPORT_INT(STATE_SEQ_LEN)
NQ_EXPORT_INT(STATE_STATUS)
NQ_EXPORT_INT(STATE_PAGE_TABLE)
NQ_EXPORT_INT(STATUS_NOT_FINITE)
NQ_EXPORT_INT(STATUS_HOST_DRAWS)
NQ_EXPORT_INT(ELEMENTWISE_THREADS)

// The GPU's global clock (%globaltimer), in ns.
__device__ __forceinline__ unsigned long long global_time_ns() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// ---------------------------------------------------------------- programmatic dependent launch
//
// Inside the decode graph every kernel is launched with programmatic stream serialization
// (nanoqwen/cuda/launch.py), which lets a kernel's blocks start while the kernel before it is
// still finishing. Each kernel therefore does, in this order:
//   1. let_next_kernel_launch(): the next kernel may start its own prologue now;
//   2. work that reads only inputs no earlier kernel of the step writes (weights, the KV pages of
//      earlier tokens are NOT such inputs for attention: rope_write_kv writes the new token's);
//   3. wait_for_previous_kernel(): returns once the previous kernel has completed and its writes
//      are visible, and, because that kernel waited for its own predecessor, every earlier one;
//   4. everything else.
// Every block of every kernel must reach step 3 before it exits or writes anything, or the chain
// of completions in 3 breaks. What step 4 reads of earlier kernels' output goes through ordinary
// (coherent) loads: ptxas treats ld.global.nc (__ldg, const __restrict__ pointers) as reading
// immutable memory and moves it across the wait in either direction. Launched without the attribute (eager launches, CPU-side tests),
// both instructions are no-ops.
//
// Compiled with -DNQ_TRACE (tools/step_timeline.py), the two also write a timeline: thread 0 of
// block 0 of every kernel records the GPU's global clock (%globaltimer, ns) when the kernel starts
// and when its wait returns, each in the next slot of its own counter. Both orders are the launch
// order: a kernel launches only after every block of the one before has started, and its wait
// returns only after that one has finished, which was after that one's wait. Two counters, so
// that no shared-memory variable carries a slot from one call to the other: a few bytes more per
// block can cost a kernel a block per SM, and a GEMV of one wave a second wave.
#ifdef NQ_TRACE
// Set by the host; until then (capacity 0) nothing is recorded.
__device__ unsigned long long* nq_trace_starts;    // [capacity]
__device__ unsigned long long* nq_trace_releases;  // [capacity]
__device__ unsigned int* nq_trace_counters;        // [2]: starts, releases taken
__device__ unsigned int nq_trace_capacity;
__device__ __forceinline__ void trace_time(unsigned long long* times, unsigned int* counter) {
  if ((blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y | threadIdx.z) != 0 || nq_trace_capacity == 0) return;
  const unsigned long long now = global_time_ns();
  const unsigned int slot = atomicAdd(counter, 1u);
  if (slot < nq_trace_capacity) times[slot] = now;
}
#endif
// Compiled with -DNQ_TRACE_BLOCKS (tools/block_trace.py), the kernels that end with
// trace_block_done() record every block that did work: its SM, when it started, when its wait
// returned and when it finished, each kernel under its TRACED_* number. Thread 0 notes the first two
// moments in shared memory, 16 bytes a block that the timeline above avoids, so the two are separate
// builds; the block's `recorder`, a thread that finishes with the block's work, writes the record.
constexpr int TRACED_QKV_ROPE = 1;
constexpr int TRACED_ATTENTION = 2;
constexpr int TRACED_COMBINE = 3;
constexpr int TRACED_FROM_Q_DIM = 4;
constexpr int TRACED_GATE_UP = 5;
constexpr int TRACED_FROM_INTERMEDIATE = 6;
constexpr int TRACED_FROM_HIDDEN = 7;
// A block's record: kernel << BLOCK_RECORD_KERNEL_SHIFT | SM, then the three moments (ns).
constexpr int BLOCK_RECORD_WORDS = 4;
constexpr int BLOCK_RECORD_KERNEL_SHIFT = 32;
#ifdef NQ_TRACE_BLOCKS
// Set by the host; until then (capacity 0) nothing is recorded.
__device__ unsigned long long* nq_block_records;  // [capacity][BLOCK_RECORD_WORDS]
__device__ unsigned int nq_block_count;
__device__ unsigned int nq_block_capacity;
__shared__ volatile unsigned long long nq_block_moments[2];  // started, wait returned
#endif
__device__ __forceinline__ void trace_block_done(int kernel, int recorder) {
#ifdef NQ_TRACE_BLOCKS
  if (threadIdx.x != recorder || nq_block_capacity == 0) return;
  unsigned int sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const unsigned long long done = global_time_ns();
  const unsigned int slot = atomicAdd(&nq_block_count, 1u);
  if (slot >= nq_block_capacity) return;
  unsigned long long* record = nq_block_records + (unsigned long long)BLOCK_RECORD_WORDS * slot;
  record[0] = (unsigned long long)kernel << BLOCK_RECORD_KERNEL_SHIFT | sm;
  record[1] = nq_block_moments[0];  // thread 0's, noted microseconds before; no barrier orders them
  record[2] = nq_block_moments[1];
  record[3] = done;
#endif
}
// The two traces' moments: the kernel started, its wait returned (nothing without -D).
__device__ __forceinline__ void trace_started() {
#ifdef NQ_TRACE
  trace_time(nq_trace_starts, nq_trace_counters);
#endif
#ifdef NQ_TRACE_BLOCKS
  if (threadIdx.x == 0) nq_block_moments[0] = global_time_ns();
#endif
}
__device__ __forceinline__ void trace_waited() {
#ifdef NQ_TRACE
  trace_time(nq_trace_releases, nq_trace_counters + 1);
#endif
#ifdef NQ_TRACE_BLOCKS
  if (threadIdx.x == 0) nq_block_moments[1] = global_time_ns();
#endif
}
__device__ __forceinline__ void let_next_kernel_launch() {
  trace_started();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  trace_waited();
}

// ---------------------------------------------------------------- half precision as bits

__device__ __forceinline__ float half_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// Round to nearest even, as numpy's astype(float16) does.
__device__ __forceinline__ unsigned short float_to_half(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// An fp16 pair (low half = first element) as two floats.
__device__ __forceinline__ float2 half2_to_float2(unsigned int pair) {
  return make_float2(half_to_float((unsigned short)(pair & 0xffffu)), half_to_float((unsigned short)(pair >> 16)));
}

__device__ __forceinline__ unsigned int float2_to_half2(float lo, float hi) {
  return (unsigned int)float_to_half(lo) | ((unsigned int)float_to_half(hi) << 16);
}

// ---------------------------------------------------------------- loads

// Weights are read exactly once per launch: 16 bytes per lane, kept out of L1 (which holds
// the activations every warp re-reads), and each miss asks L2 to fetch the whole 256-byte
// stretch the warp walks through next.
__device__ __forceinline__ uint4 load_weights_16B(const void* address) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(address));
  return v;
}

// ---------------------------------------------------------------- reductions

// Butterfly sum: after step `offset`, each lane holds the sum of a block of 2*offset lanes;
// after five steps every lane holds the whole warp's sum (no shared memory, no barrier).
template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
  for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(FULL_MASK, value, offset);
  return value;
}

// Sum over a block of THREADS threads (a multiple of 32): each warp reduces by shuffles, one
// lane per warp parks its sum in shared memory, and every thread adds up those few sums in
// the same order, so all threads return the same value. `scratch` holds THREADS/32 values.
template <int THREADS, typename T>
__device__ __forceinline__ T block_sum(T value, T* scratch) {
  static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "block_sum needs whole warps");
  constexpr int WARPS = THREADS / WARP_SIZE;
  value = warp_sum(value);
  if (WARPS == 1) return value;
  if (threadIdx.x % WARP_SIZE == 0) scratch[threadIdx.x / WARP_SIZE] = value;
  __syncthreads();
  T total = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += scratch[w];
  return total;
}

#define NEGATIVE_INFINITY __int_as_float(0xff800000)
#define POSITIVE_INFINITY __int_as_float(0x7f800000)  // spelled out: NVRTC has no math.h for INFINITY

// Greedy choice: the larger logit wins, the smaller token id breaks a tie (numpy.argmax
// returns the first maximum). NaN never wins; a search starts from (-inf, token 0), so logits
// that are all NaN or -inf pick token 0 rather than an id outside the vocabulary.
__device__ __forceinline__ bool better_candidate(float value, int index, float best_value, int best_index) {
  return value > best_value || (value == best_value && index < best_index);
}

__device__ __forceinline__ void warp_argmax(float& value, int& index) {
#pragma unroll
  for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
    const float other_value = __shfl_xor_sync(FULL_MASK, value, offset);
    const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
    if (better_candidate(other_value, other_index, value, index)) {
      value = other_value;
      index = other_index;
    }
  }
}

// ---------------------------------------------------------------- RoPE and the KV cache slot
// Shared by rope_write_kv (elementwise.cu) and the decode q|k|v GEMV that rotates its own rows
// (gemv_int4.cu, gemv_int4_qkv_rope), so that both write the same bits.
// Reference: reference/ops.py apply_rope (rotate_half: dim i pairs with i + head_dim/2).

// cos and sin of position * inv_freq_i. The accurate sincosf at any position: its reduction of
// large angles (up to 32768 radians here) keeps a 32-byte table in local memory, the stack frame
// of both kernels in results/ptxas-report.txt.
__device__ __forceinline__ void rope_cos_sin(int position, float inv_freq_i, float& c, float& s) {
  sincosf(__fmul_rn((float)position, inv_freq_i), &s, &c);
}

// One half of a rotation pair: x is dim i (first) or dim i + head_dim/2, partner the other one.
//   first:  x c - partner s        second: x c + partner s
// Rounded the same way wherever it is computed: one product, then one fused multiply-add.
__device__ __forceinline__ float rope_rotate(float x, float partner, float c, float s, bool first) {
  return __fmaf_rn(x, c, __fmul_rn(first ? -partner : partner, s));
}

// Element `dim` of a token's K (which 0) or V (which 1) for KV head `kv_head` in one layer's pool
//   kv_layer fp16 [num_pages, 2, NQ_NUM_KV_HEADS, NQ_PAGE_SIZE, NQ_HEAD_DIM]
// at page `page`, row `slot` (position % NQ_PAGE_SIZE).
__device__ __forceinline__ long long kv_index(long long page, int which, int kv_head, int slot, int dim) {
  return (((page * 2 + which) * NQ_NUM_KV_HEADS + kv_head) * NQ_PAGE_SIZE + slot) * (long long)NQ_HEAD_DIM + dim;
}
