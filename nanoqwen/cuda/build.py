"""Compile nanoqwen's CUDA kernels for one model, at engine start.

A kernel file in `kernels/` is plain CUDA C++ with the model's dimensions left as
preprocessor names (`NQ_HIDDEN`, `NQ_HEAD_DIM`, ...). `compile_module` fills them in from a
`ModelConfig` with `-D` options and hands the source to NVRTC through `cupy.RawModule`, so
every loop bound and stride is a compile-time number. CuPy caches the compiled module on
disk (`~/.cupy/kernel_cache`), keyed by the source string and the options; the source string
here is only a list of `#include` lines, so a hash of every kernel file goes into the options
too, and editing any `.cu`/`.cuh` file triggers a recompile.

The same files compile with plain nvcc (`nvcc_command`), which is how CI checks them on a
machine without a GPU (tools/compile_kernels.py).

    module = compile_module(config)                 # cupy.RawModule, compiled now
    add_rmsnorm = module.get_function("add_rmsnorm")
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from ..config import PAGE_SIZE, ModelConfig

# The decoder layer's kernels (everything but attention), in the order they are included.
DECODER_KERNEL_FILES = ("rmsnorm.cu", "gemv_int4.cu", "elementwise.cu", "lm_head.cu", "sampler.cu", "verify.cu",
                        "decode_persistent.cu")
NVCC_ARCH = "-gencode=arch=compute_90a,code=sm_90a"


def kernel_dir() -> Path:
    """The folder holding the .cu/.cuh files: `kernels/` inside an installed package (the wheel
    ships them there), or the repository's top-level `kernels/` beside a source tree's package.

    The folder is data, not a Python package: a top-level package named `kernels` would hide
    Hugging Face's `kernels`, which transformers imports."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "kernels", package.parent / "kernels"):
        if (folder / "common.cuh").is_file():
            return folder
    raise FileNotFoundError(f"no CUDA kernel sources beside {package} (expected kernels/common.cuh)")


def kernel_defines(config: ModelConfig) -> dict[str, str]:
    """The `-D` constants every kernel file is compiled with (names as in kernels/common.cuh)."""
    return {
        "NQ_HIDDEN": str(config.hidden_size),
        "NQ_INTERMEDIATE": str(config.intermediate_size),
        "NQ_NUM_HEADS": str(config.num_heads),
        "NQ_NUM_KV_HEADS": str(config.num_kv_heads),
        "NQ_HEAD_DIM": str(config.head_dim),
        "NQ_VOCAB": str(config.vocab_size),
        "NQ_GROUP_SIZE": str(config.group_size),
        "NQ_PAGE_SIZE": str(PAGE_SIZE),
        # A decimal literal with an f suffix rounds to the same float32 as numpy.float32(eps).
        "NQ_RMS_EPS": f"{float(config.rms_norm_eps)!r}f",
    }


def sources_hash(folder: Path | None = None) -> str:
    """SHA-256 (first 16 hex digits) over the names and bytes of every .cu/.cuh/.h file."""
    folder = kernel_dir() if folder is None else folder
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".cu", ".cuh", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def define_options(defines: dict[str, str]) -> list[str]:
    return [f"-D{name}={value}" for name, value in defines.items()]


def compile_module(config: ModelConfig, files=DECODER_KERNEL_FILES, extra_defines: dict[str, str] | None = None):
    """NVRTC-compile `files` (names in the kernel folder) into one cupy.RawModule for `config`.

    Compilation happens here, not at the first launch, so a kernel that does not build stops
    the engine at start with the compiler's message.
    """
    import cupy

    folder = kernel_dir()
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"kernel sources {missing} not found in {folder}")
    defines = {**kernel_defines(config), **(extra_defines or {}), "NQ_SOURCES_HASH": "0x" + sources_hash(folder)}
    code = "".join(f'#include "{name}"\n' for name in files)
    options = ("-std=c++17", f"-I{folder}", *define_options(defines))
    module = cupy.RawModule(code=code, options=options)
    module.compile()
    return module


def macro_defaults(source_name: str) -> dict[str, str]:
    """The defaults a kernel file gives its tunable macros (`#ifndef NAME` / `#define NAME value` /
    `#endif`), as the compiler sees them when no -D option sets them."""
    text = (kernel_dir() / source_name).read_text()
    return dict(re.findall(r"#ifndef (\w+)\n#define \1 (\S+)\n#endif", text))


def module_int(module, name: str) -> int:
    """The value of a kernel file's `__device__ int` (a size the host must launch with)."""
    import cupy

    return int(cupy.ndarray((1,), cupy.int32, memptr=module.get_global(name)).get()[0])


def nvcc_command(config: ModelConfig, source: Path, output: Path, extra_defines: dict[str, str] | None = None) -> list[str]:
    """The nvcc line that builds `source` into an sm_90a cubin and prints ptxas's resource report."""
    defines = {**kernel_defines(config), **(extra_defines or {})}
    return [
        "nvcc", NVCC_ARCH, "-cubin", "-std=c++17", "-Xptxas", "-v",
        f"-I{source.parent}", *define_options(defines), "-o", str(output), str(source),
    ]
