// paged_attention_broken.cu: THE BROKEN DECODE KERNEL, kept to show a synchronization bug.
// Never used by the engine; tools/gpu_check_attention.py and chapter 5 run it on purpose.
//
// It is kernels/paged_attention.cu with the stage hand-off written the way a synchronous
// kernel does it, but with that kernel's one __syncthreads() moved into the producer's branch:
//
//   producer:  issue the copies; wait until they land; __syncthreads()   <- only warp 0 gets here
//   consumers: read the stage                                            <- nobody made them wait
//
// __syncthreads() is a barrier for the whole block. Reached by the producer warp alone, it
// does not hold the consumers back (on the hardware it opens once they have exited; CUDA calls
// it undefined), so consumers read stages whose copies have not landed: stale shared memory,
// from an earlier page or an earlier block. compute-sanitizer --tool racecheck reports the
// hazards (results/attention-h200.md); nanoqwen/book/barrier_sim.py replays the race step by step.
#define PA_DECODE_KERNEL paged_attention_decode_broken

#define PRODUCER_WAIT_STAGE_FREE(stage, round) (void)(round) /* "the barrier below keeps the stages apart" */
#define PRODUCER_AFTER_ISSUE(stage, round)     \
  do {                                         \
    mbar_wait(&sh.full[stage], (round) & 1);   \
    __syncthreads(); /* BUG: block-wide barrier in a branch only the producer warp takes */ \
  } while (0)
#define CONSUMER_WAIT_STAGE_FULL(stage, round) (void)(round) /* "the producer's __syncthreads published it" */
#define CONSUMER_RELEASE_STAGE(stage)            /* "and the next __syncthreads will retire it" */

#include "paged_attention.cu"
