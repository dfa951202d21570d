"""The CUDA backend: the kernels of kernels/ compiled for one model, launched as one decode step
that a CUDA graph replays per token, and prefill through cuBLAS. Nothing here imports CuPy at
module load, so the planning helpers run on any machine."""
