// mbarrier.cuh: the Hopper hand-off primitives of the paged-attention kernels, in PTX.
//
// An mbarrier is a 64-bit object in shared memory that counts arrivals and, since sm_90, bytes
// still to land from the copy engine (cp.async.bulk): its current phase completes when both reach
// zero, and a waiter spins on the parity of the phase it expects. Named barriers (bar.sync /
// bar.arrive) are the hardware's 16 per-block barriers for a subset of the block's warps.
// kernels/paged_attention.cu builds its producer/consumer ring from these, and
// tools/gpu_check_attention.py runs it under compute-sanitizer (results/attention-h200.md).
//
// The includer declares `unsigned smem_address(const void*)` first, the 32-bit shared-memory
// address of a generic pointer (the attention kernels spell it in PTX).
#pragma once

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}

// Arrive once and announce `bytes` more to come from the copy engine: the phase completes
// when the arrivals are done AND those bytes have landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes) : "memory");
}

// Spin until the phase with this parity has completed. A barrier only remembers the parity of
// its current phase, so a waiter must never fall two phases behind: the pipeline around it has
// to guarantee that (paged_attention.cu gives each stage to one consumer warp).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(smem_address(bar)), "r"(parity) : "memory");
  } while (!done);
}

// The copy engine moves `bytes` from global to shared memory and completes them on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar)) : "memory");
}

// Hardware named barrier `id` (0-15; 0 is __syncthreads) for THREADS threads, a multiple of 32.
// bar.sync counts the calling warp's arrival and waits until THREADS threads have arrived;
// bar.arrive counts it and goes on. The barrier then starts over. Both are .aligned: the whole
// warp executes them, converged. An id in a register makes ptxas count all 16 as used.
template <int THREADS>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}

template <int THREADS>
__device__ __forceinline__ void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}
