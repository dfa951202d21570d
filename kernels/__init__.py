"""CUDA sources of the nanoqwen runtime, shipped inside the package as ``nanoqwen.kernels``.

The ``.cu``/``.cuh`` files in this folder are data, not Python: the GPU backend reads
them with ``importlib.resources.files("nanoqwen.kernels")`` and compiles them at run
time (NVRTC through CuPy). In the repository the folder is ``kernels/`` at the root, so
the book can show the sources; ``pyproject.toml`` maps it to ``nanoqwen.kernels``.
"""
