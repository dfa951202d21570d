"""Programmatic dependent launch (PDL): kernel n + 1 starts while kernel n is finishing.

In a stream, and in a CUDA graph captured from one, a kernel starts only when the kernel before
it has completed: between the two the GPU retires the last blocks of one grid and schedules
the first blocks of the next, about half a microsecond on an H200 (chapter 6), paid at every
one of a token's ~250 launches. Hopper can overlap that gap. A kernel launched with the
attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start as soon as every
block of the kernel before it has executed `griddepcontrol.launch_dependents`; it runs what
does not depend on that kernel, then `griddepcontrol.wait` holds it until the kernel before
has completed and its writes are visible (kernels/common.cuh: `let_next_kernel_launch`,
`wait_for_previous_kernel` and the ordering rule every kernel follows).

CuPy launches through cuLaunchKernel, which takes no launch attributes. This module launches a
CuPy kernel through the driver's cuLaunchKernelEx instead, from the optional package
`cuda.bindings` (cuda-python):

    kernel = StepKernel(module.get_function("add_rmsnorm"), "add_rmsnorm")
    kernel(grid, block, args)                    # a plain CuPy launch
    with programmatic_launches() as active:      # active is False without cuda.bindings
        kernel(grid, block, args)                # a PDL launch, since add_rmsnorm waits

Only the captured decode graph launches this way (nanoqwen.cuda.graph.DecodeGraph); eager
launches stay plain CuPy launches, chapter 6's baseline for what the host costs.

The read-only path. A kernel that waits reads what earlier kernels of the step wrote with
ordinary loads, never through `__ldg` or a `const T* __restrict__` pointer, which compile to
ld.global.nc: that path promises the data does not change while the kernel runs, and under
PDL it does (the kernel before writes it after this one has started). ptxas relies on the
promise and moves ld.global.nc across griddepcontrol.wait: in the sm_90a code of nvcc 13.0,
disassembled with cuobjdump -sass (the wait is ACQBULK, launch_dependents PREEXIT),
paged_attention_decode loaded `*seq_len_ptr` above the wait while that pointer was
`__restrict__`, and a variant of gemv_int4_int8 issued its activation loads above it. Weights, which no kernel writes, keep the read-only path
and may be loaded before the wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import threading
import warnings

import numpy as np

from ..errors import LaunchError
from .plan import VERIFY_GEMVS, VERIFY_WIDTHS

# Kernels whose every block calls wait_for_previous_kernel() before it reads what an earlier
# kernel of the step wrote and before it writes anything. Only these may be launched to start
# early: a kernel without the wait, launched with the attribute, could read its inputs before
# the kernel writing them has finished. One launched plainly simply waits for its predecessor
# to complete, which is always correct. tests/test_pdl.py checks this set against kernels/.
KERNELS_THAT_WAIT = frozenset({
    "embed_tokens", "add_rmsnorm", "add_rmsnorm_cluster", "rope_write_kv", "silu_mul_rows", "lm_head_logits", "argmax_select_next",
    "gemv_int4_from_hidden", "gemv_int4_qkv_rope", "gemv_int4_from_q_dim", "gemv_int4_from_intermediate", "gemv_int4_gate_up_silu",
    "paged_attention_decode", "paged_attention_combine", "paged_attention_prefill",
    *(f"{gemv}_{width}" for gemv in VERIFY_GEMVS for width in VERIFY_WIDTHS),
    "lm_head_logits_rows", "verify_select", "decode_layers_persistent",
    *(f"{kind}_{width}" for kind in ("quantize_activations_int8", "gemv_int4_int8")
      for width in ("hidden", "q_dim", "intermediate")),
})

# numpy scalar type -> the C type of the kernel parameter. Nothing else passes: CuPy turns a
# Python int into an int64 and a float into a double, and the driver copies as many bytes as
# the parameter has, so a float parameter would get half a double, without any error (an int
# one gets the right value only by the accident of little-endian order).
SCALAR_TYPES = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.uint64): ctypes.c_uint64,  # also the null pointer, np.uint64(0)
}



# ---------------------------------------------------------------------------- the driver


def driver_module():
    """cuda.bindings.driver, or None with the reason when it cannot launch with attributes."""
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError as e:
        return None, f"cuda.bindings is not installed ({e}); pip install cuda-bindings provides it"
    if not hasattr(driver, "cuLaunchKernelEx"):
        return None, "this cuda.bindings has no cuLaunchKernelEx (CUDA 12.0 or newer needed)"
    return driver, None


def launch_config(driver, grid: tuple, block: tuple, shared_mem: int, stream_ptr: int):
    """The CUlaunchConfig of one launch, with programmatic stream serialization allowed."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream_ptr)
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


# ---------------------------------------------------------------------------- arguments


def pack_arguments(args) -> tuple[ctypes.Array, list]:
    """Kernel arguments as cuLaunchKernelEx's kernelParams: an array of pointers, one per
    argument, each to a C value of the parameter's exact type. Returns (array, values); keep
    both alive until the launch call has returned (the driver copies the values then).

    A cupy.ndarray passes its device address; numpy int32, uint32, float32 and uint64 scalars
    pass their value; anything else is refused.
    """
    import cupy

    values = []
    for index, arg in enumerate(args):
        if isinstance(arg, cupy.ndarray):
            values.append(ctypes.c_void_p(arg.data.ptr))
        elif isinstance(arg, np.generic) and arg.dtype in SCALAR_TYPES:
            c_type = SCALAR_TYPES[arg.dtype]
            values.append(c_type(float(arg) if arg.dtype.kind == "f" else int(arg)))
        else:
            what = f"numpy {arg.dtype} scalar" if isinstance(arg, np.generic) else type(arg).__module__ + "." + type(arg).__qualname__
            raise TypeError(
                f"kernel argument {index} is a {what}; pass a cupy.ndarray or a numpy int32, uint32, float32 "
                "or uint64 scalar (a Python int or float would not have the parameter's C type)"
            )
    pointers = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
    return pointers, values


def _dims(name: str, dims) -> tuple[int, int, int]:
    """A grid or block as three positive ints, as CuPy's Function.__call__ makes it (missing
    dimensions are 1, and so are zeros)."""
    dims = tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{name} must have 1 to 3 dimensions, got {dims}")
    dims = (dims + (1, 1))[:3]
    return tuple(max(1, d) for d in dims)


# ---------------------------------------------------------------------------- launchers


class ProgrammaticKernel:
    """A CuPy kernel (RawModule.get_function) launched with programmatic stream serialization.

    Called like CuPy's Function: kernel(grid, block, args, shared_mem=0, stream=None), on the
    current CuPy stream when `stream` is None, inside a stream capture too.
    """

    def __init__(self, kernel, name: str, driver=None):
        if driver is None:
            driver, reason = driver_module()
            if driver is None:
                raise RuntimeError(f"programmatic dependent launch is unavailable: {reason}")
        self.kernel, self.name, self.driver = kernel, name, driver

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        import cupy

        grid, block = _dims("grid", grid), _dims("block", block)
        if stream is None:
            stream = cupy.cuda.get_current_stream()
        pointers, values = pack_arguments(args)  # alive until the call returns: the driver copies them
        config = launch_config(self.driver, grid, block, int(shared_mem), stream.ptr)
        function = self.driver.CUfunction(getattr(self.kernel, "kernel", self.kernel).ptr)  # RawKernel or Function
        (result,) = self.driver.cuLaunchKernelEx(config, function, ctypes.addressof(pointers), 0)
        if result != self.driver.CUresult.CUDA_SUCCESS:
            name = getattr(result, "name", None) or str(result)  # the CUresult's name: CUDA_ERROR_...
            raise LaunchError(f"cuLaunchKernelEx of {self.name} (grid {grid}, block {block}) failed: {name}")


_launch_mode = threading.local()
_warned_unavailable = False


def programmatic_launches_active() -> bool:
    return getattr(_launch_mode, "active", False)


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True):
    """Inside the block, StepKernels of KERNELS_THAT_WAIT launch with PDL. Yields whether they
    do: without cuda.bindings it warns (once per process) and they launch plainly."""
    global _warned_unavailable
    active = False
    if enabled:
        driver, reason = driver_module()
        active = driver is not None
        if not active and not _warned_unavailable:
            warnings.warn(f"programmatic dependent launch is off: {reason}; the decode graph uses plain launches",
                          RuntimeWarning, stacklevel=3)
            _warned_unavailable = True
    previous = programmatic_launches_active()
    _launch_mode.active = active
    try:
        yield active
    finally:
        _launch_mode.active = previous


class StepKernel:
    """A CuPy kernel of the decode step: a plain CuPy launch, or a PDL launch inside
    `programmatic_launches()` when the kernel is one of KERNELS_THAT_WAIT. Every other
    attribute, read or set (max_threads_per_block, max_dynamic_shared_size_bytes, kernel.ptr,
    ...), is the CuPy kernel's."""

    _OWN = ("cupy_kernel", "name", "waits", "_programmatic")

    def __init__(self, kernel, name: str):
        self.cupy_kernel, self.name = kernel, name
        self.waits = name in KERNELS_THAT_WAIT
        self._programmatic = None  # built at the first PDL launch

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        if self.waits and programmatic_launches_active():
            if self._programmatic is None:
                self._programmatic = ProgrammaticKernel(self.cupy_kernel, self.name)
            self._programmatic(grid, block, args, shared_mem=shared_mem, stream=stream)
        elif stream is None:
            self.cupy_kernel(grid, block, args, shared_mem=shared_mem)
        else:
            self.cupy_kernel(grid, block, args, shared_mem=shared_mem, stream=stream)

    def __getattr__(self, name):
        if name in StepKernel._OWN:  # not set yet (copy, pickle): do not recurse
            raise AttributeError(name)
        return getattr(self.cupy_kernel, name)

    def __setattr__(self, name, value) -> None:
        if name in StepKernel._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.cupy_kernel, name, value)

    def __repr__(self) -> str:
        return f"StepKernel({self.name!r}, waits={self.waits})"
