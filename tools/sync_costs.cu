// sync_costs.cu: three ways for the blocks of one GPU to wait for each other, each carrying one
// value from block 0 to every block (tools/sync_costs.py times them).
//
// 1. A kernel boundary: kernel n + 1 waits for kernel n (griddepcontrol.wait, launched with
//    programmatic dependent launch or plainly), then every block reads what block 0 of kernel n
//    wrote. This is how the decode step passes activations from one kernel to the next.
// 2. A software grid barrier inside one persistent kernel: every block adds 1 to a counter in
//    global memory (release) and spins until it holds all the blocks' arrivals (acquire). It is
//    what a persistent kernel spanning several of the step's kernels would use between stages.
// 3. A cluster barrier (barrier.cluster, hardware) among the 8 blocks of a thread-block cluster:
//    the scope a merge inside one KV head's blocks would need.
// Self-contained: the model's kernels/common.cuh wants the model's dimensions, these want none.

// grid (blocks), any block size; data[0] counts the launches that have read their predecessor's.
extern "C" __global__ void kernel_handoff(int* data) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // a no-op when launched plainly
  __shared__ int seen;
  if (threadIdx.x == 0) seen = *(volatile int*)&data[0];
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) data[0] = seen + 1;
}

__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned arrivals) {
  __syncthreads();  // the block's writes before the barrier are thread 0's to release
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    unsigned now;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
    } while (now < arrivals);
  }
  __syncthreads();
}

// grid (blocks that are all resident at once), any block size; counter starts at 0.
// data[1 + i] carries barrier i's value; data[0] stays 0 unless a block missed one.
extern "C" __global__ void grid_barriers(unsigned* counter, int* data, int barriers) {
  for (int i = 0; i < barriers; ++i) {
    if (blockIdx.x == 0 && threadIdx.x == 0) data[1 + i] = i + 1;
    grid_barrier(counter, (unsigned)(i + 1) * gridDim.x);
    if (threadIdx.x == 0 && *(volatile int*)&data[1 + i] != i + 1) atomicAdd(&data[0], 1);
  }
}

// grid (a multiple of 8), any block size; the same hand-off within each cluster, through block
// 0 of the cluster's shared memory (distributed shared memory), barrier after barrier.
extern "C" __global__ void __cluster_dims__(8, 1, 1) cluster_barriers(int* data, int barriers) {
  __shared__ int value;
  unsigned rank, value_in_rank0;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(value_in_rank0) : "r"((unsigned)__cvta_generic_to_shared(&value)));
  int missed = 0;
  for (int i = 0; i < barriers; ++i) {
    if (rank == 0 && threadIdx.x == 0) value = i + 1;
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    int seen;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(seen) : "r"(value_in_rank0) : "memory");
    missed += seen != i + 1;
    // Block 0 overwrites `value` in the next round only after every block has read this one.
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  }
  if (missed) atomicAdd(&data[0], missed);
}
