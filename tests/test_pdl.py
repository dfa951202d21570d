"""Programmatic dependent launch (nanoqwen.cuda.launch) and the decode graph that uses it.

Everywhere: the argument conversion and its errors, the launch configuration handed to
cuLaunchKernelEx (the real cuda.bindings structs when that package is installed, a recording
stand-in for the launch itself), the fallback to plain launches without cuda.bindings, and
that the kernels that may start early are exactly those whose source waits.

On a GPU (marked `gpu`): a PDL graph decodes the same greedy tokens as a plain graph and as the
numpy backend; every kernel of one decode step writes the same bits with and without PDL (Path
B and Path A); and attention started early behind a slow kernel that writes its query late
still equals the oracle on a sequence ending in a partly filled page.
"""

from __future__ import annotations

import ctypes
import enum
import re
import sys
import types
import warnings
from importlib.machinery import ModuleSpec
from pathlib import Path

import numpy as np
import pytest

from nanoqwen.cuda import graph as cuda_graph
from nanoqwen.cuda import profile
from nanoqwen.cuda import launch as cuda_launch
from nanoqwen.cuda.launch import (
    KERNELS_THAT_WAIT, LaunchError, ProgrammaticKernel, StepKernel, pack_arguments, programmatic_launches,
    programmatic_launches_active,
)

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
PROGRAMMATIC = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION in cuda.h


# ---------------------------------------------------------------------------- stand-ins


class FakeDeviceArray:
    """What pack_arguments needs of a cupy.ndarray: its device address."""

    def __init__(self, ptr: int):
        self.data = types.SimpleNamespace(ptr=ptr)


class FakeCupyKernel:
    """A RawKernel as module.get_function returns it: callable, with attributes."""

    def __init__(self, ptr: int = 0xF00D):
        self.calls = []
        self.kernel = types.SimpleNamespace(ptr=ptr)
        self.max_threads_per_block = 1024
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, **options):
        self.calls.append((grid, block, args, options))


@pytest.fixture
def fake_cupy(monkeypatch):
    """A cupy module with ndarray and a current stream, no GPU behind it."""
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = ModuleSpec("cupy", None)
    cupy.ndarray = FakeDeviceArray
    stream = types.SimpleNamespace(ptr=0x5EED)
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


def stand_in_driver():
    """A driver module whose cuLaunchKernelEx records its arguments, and reads the argument
    bytes while the caller keeps them alive. Built on cuda.bindings' own structs when it is
    installed, so the attribute spellings are the real ones."""
    try:
        from cuda.bindings import driver as real
    except ImportError:
        real = None
    launches = []

    def cuLaunchKernelEx(config, function, kernel_params, extra):
        pointers = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))  # valid during the call only
        launches.append({"config": config, "function": int(function), "extra": extra,
                         "arguments": [ctypes.string_at(pointers[i], 8) for i in range(driver.arguments)]})
        return (driver.result,)

    if real is not None:
        names = ("CUlaunchAttribute", "CUlaunchAttributeID", "CUlaunchConfig", "CUstream", "CUfunction", "CUresult")
        driver = types.SimpleNamespace(**{name: getattr(real, name) for name in names})
        driver.result = real.CUresult.CUDA_SUCCESS
    else:
        attribute_ids = types.SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=PROGRAMMATIC)

        class Attribute:
            def __init__(self):
                self.id, self.value = None, types.SimpleNamespace(programmaticStreamSerializationAllowed=0)

        driver = types.SimpleNamespace(
            CUlaunchAttribute=Attribute, CUlaunchAttributeID=attribute_ids, CUlaunchConfig=types.SimpleNamespace,
            CUstream=int, CUfunction=int, CUresult=CUresult, result=CUresult.CUDA_SUCCESS)
    driver.cuLaunchKernelEx = cuLaunchKernelEx
    driver.launches = launches
    driver.arguments = 0  # how many arguments a launch reads back (8 bytes each)
    return driver


@pytest.fixture
def driver(monkeypatch):
    """cuda_launch sees the stand-in driver as cuda.bindings.driver."""
    stand_in = stand_in_driver()
    monkeypatch.setattr(cuda_launch, "driver_module", lambda: (stand_in, None))
    return stand_in


@pytest.fixture
def no_bindings(monkeypatch):
    """cuda.bindings is not installed, and no warning about it has been given yet."""
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # import_module raises ImportError
    monkeypatch.setattr(cuda_launch, "_warned_unavailable", False)


# ---------------------------------------------------------------------------- arguments


def argument_bytes(pointers, values, index: int, c_type) -> object:
    assert pointers[index] == ctypes.addressof(values[index])
    return ctypes.cast(pointers[index], ctypes.POINTER(c_type)).contents.value


def test_arguments_keep_their_exact_c_types(fake_cupy):
    args = (FakeDeviceArray(0x7000_0000_1230), np.int32(-7), np.uint32(4_000_000_000), np.float32(0.1),
            np.uint64(0), np.uint64(2**63 + 5))
    pointers, values = pack_arguments(args)
    assert [type(v) for v in values] == [ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float,
                                         ctypes.c_uint64, ctypes.c_uint64]
    assert argument_bytes(pointers, values, 0, ctypes.c_uint64) == 0x7000_0000_1230
    assert argument_bytes(pointers, values, 1, ctypes.c_int32) == -7
    assert argument_bytes(pointers, values, 2, ctypes.c_uint32) == 4_000_000_000
    float_bits = argument_bytes(pointers, values, 3, ctypes.c_uint32)
    assert float_bits == int(np.float32(0.1).view(np.uint32))  # the float32, not a rounded double
    assert argument_bytes(pointers, values, 4, ctypes.c_uint64) == 0
    assert argument_bytes(pointers, values, 5, ctypes.c_uint64) == 2**63 + 5


@pytest.mark.parametrize("bad, what", [
    (3, "builtins.int"),
    (0.5, "builtins.float"),
    (True, "builtins.bool"),
    (None, "builtins.NoneType"),
    (np.int64(3), "numpy int64 scalar"),
    (np.float64(3), "numpy float64 scalar"),
    (np.zeros(4, np.float32), "numpy.ndarray"),
])
def test_other_arguments_are_refused_naming_index_and_type(fake_cupy, bad, what):
    with pytest.raises(TypeError, match=rf"kernel argument 2 is a {re.escape(what)}; pass a cupy.ndarray"):
        pack_arguments((FakeDeviceArray(16), np.int32(1), bad))


def test_no_arguments(fake_cupy):
    pointers, values = pack_arguments(())
    assert values == [] and len(pointers) == 1


# ---------------------------------------------------------------------------- the launch


def test_launch_passes_geometry_stream_attribute_and_arguments(fake_cupy, driver):
    kernel = ProgrammaticKernel(FakeCupyKernel(ptr=0xBEEF), "add_rmsnorm", driver=driver)
    driver.arguments = 2
    kernel((5,), (128, 2), (FakeDeviceArray(0x1000), np.int32(42)), shared_mem=4096)
    (launch,) = driver.launches
    config = launch["config"]
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (5, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (128, 2, 1)
    assert config.sharedMemBytes == 4096
    assert int(config.hStream) == 0x5EED  # the current CuPy stream, as CuPy's own launch takes it
    assert config.numAttrs == 1
    (attribute,) = config.attrs
    assert int(attribute.id) == PROGRAMMATIC
    assert attribute.value.programmaticStreamSerializationAllowed == 1
    assert launch["function"] == 0xBEEF and launch["extra"] == 0
    pointer, scalar = launch["arguments"]
    assert int.from_bytes(pointer, "little") == 0x1000
    assert int.from_bytes(scalar[:4], "little", signed=True) == 42


def test_an_explicit_stream_and_cupy_grid_rules(fake_cupy, driver):
    kernel = ProgrammaticKernel(FakeCupyKernel(), "add_rmsnorm", driver=driver)
    kernel((0, 3), (32,), (), stream=types.SimpleNamespace(ptr=0xABC))
    config = driver.launches[0]["config"]
    assert int(config.hStream) == 0xABC
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (1, 3, 1)  # CuPy launches a zero as 1
    with pytest.raises(ValueError, match="grid must have 1 to 3 dimensions"):
        kernel((1, 1, 1, 1), (32,), ())


def test_a_failed_launch_names_the_kernel_and_the_error(fake_cupy, driver):
    driver.result = driver.CUresult(1)  # CUDA_ERROR_INVALID_VALUE in cuda.h and in the stand-in
    kernel = ProgrammaticKernel(FakeCupyKernel(), "lm_head_logits", driver=driver)
    with pytest.raises(LaunchError, match=r"lm_head_logits .*failed: CUDA_ERROR_INVALID_VALUE"):
        kernel((396,), (256,), ())


def test_real_bindings_build_the_launch_config():
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda.bindings (cuda-python) is not installed")
    config = cuda_launch.launch_config(driver, (7, 2, 1), (256, 1, 1), 1024, 0x1234)
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (7, 2, 256, 1024)
    assert int(config.hStream) == 0x1234 and config.numAttrs == 1
    assert config.attrs[0].id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert config.attrs[0].value.programmaticStreamSerializationAllowed == 1
    assert hasattr(driver, "cuLaunchKernelEx") and driver.CUresult.CUDA_SUCCESS == 0


# ---------------------------------------------------------------------------- modes and fallback


def test_step_kernel_is_plain_outside_programmatic_launches(fake_cupy, driver):
    cupy_kernel = FakeCupyKernel()
    kernel = StepKernel(cupy_kernel, "add_rmsnorm")
    kernel((1,), (32,), (np.int32(1),))
    assert len(cupy_kernel.calls) == 1 and driver.launches == []


def test_step_kernel_uses_pdl_inside_only_if_it_waits(fake_cupy, driver):
    waits, plain = FakeCupyKernel(), FakeCupyKernel()
    with programmatic_launches() as active:
        assert active and programmatic_launches_active()
        StepKernel(waits, "add_rmsnorm")((1,), (32,), ())
        StepKernel(plain, "dequantize_int4_to_half")((1,), (32,), ())  # prefill only: it does not wait
    assert not programmatic_launches_active()
    assert waits.calls == [] and len(driver.launches) == 1
    assert len(plain.calls) == 1


def test_step_kernel_forwards_attributes_both_ways():
    cupy_kernel = FakeCupyKernel()
    kernel = StepKernel(cupy_kernel, "paged_attention_decode")
    kernel.max_dynamic_shared_size_bytes = 100_000
    assert cupy_kernel.max_dynamic_shared_size_bytes == 100_000
    assert kernel.max_threads_per_block == 1024 and kernel.kernel.ptr == 0xF00D
    assert kernel.waits and "paged_attention_decode" in repr(kernel)


def test_without_cuda_bindings_launches_stay_plain_and_it_is_said_once(fake_cupy, no_bindings):
    cupy_kernel = FakeCupyKernel()
    with pytest.warns(RuntimeWarning, match="programmatic dependent launch is off: cuda.bindings is not installed"):
        with programmatic_launches() as active:
            StepKernel(cupy_kernel, "add_rmsnorm")((1,), (32,), ())
    assert not active and len(cupy_kernel.calls) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        with programmatic_launches() as active:
            assert not active
    with pytest.raises(RuntimeError, match="cuda.bindings is not installed"):
        ProgrammaticKernel(cupy_kernel, "add_rmsnorm")


class StandInStream:
    """A stream whose capture only records what was issued while it was open."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        pass

    def end_capture(self):
        return types.SimpleNamespace(upload=lambda stream: None, launch=lambda stream: None)


class StandInBackend:
    launches_per_token = 3

    def __init__(self):
        self.stream = StandInStream()
        self.modes = []

    def decode_step_launches(self, stream):
        self.modes.append(programmatic_launches_active())
        return self.launches_per_token


@pytest.mark.parametrize("pdl", [False, True])
def test_decode_graph_records_its_mode(driver, pdl):
    backend = StandInBackend()
    graph = cuda_graph.DecodeGraph(backend, pdl=pdl)
    assert backend.modes == [pdl] and graph.pdl is pdl and graph.mode == ("pdl" if pdl else "plain")
    assert not programmatic_launches_active()  # the mode ends with the capture


def test_decode_graph_without_cuda_bindings_is_plain(no_bindings):
    backend = StandInBackend()
    with pytest.warns(RuntimeWarning, match="plain launches"):
        graph = cuda_graph.DecodeGraph(backend, pdl=True)
    assert backend.modes == [False] and graph.mode == "plain"


def test_capture_failure_leaves_the_mode_off(driver):
    backend = StandInBackend()
    backend.decode_step_launches = lambda stream: 1 / 0
    with pytest.raises(ZeroDivisionError):
        cuda_graph.DecodeGraph(backend, pdl=True)
    assert not programmatic_launches_active()


# ---------------------------------------------------------------------------- the kernel sources


DECODE_KERNELS = {  # kernel -> file, every kernel a decode step can launch (Path B and Path A)
    **{name: "elementwise.cu" for name in ("embed_tokens", "rope_write_kv", "silu_mul_rows")},
    "add_rmsnorm_cluster": "rmsnorm.cu",
    **{name: "gemv_int4.cu" for name in ("gemv_int4_from_hidden", "gemv_int4_from_q_dim",
                                          "gemv_int4_from_intermediate", "gemv_int4_gate_up_silu")},
    "lm_head_logits": "lm_head.cu",
    "argmax_select_next": "sampler.cu",
    "paged_attention_decode": "paged_attention.cu",
    "paged_attention_combine": "paged_attention.cu",
    **{f"{kind}_{width}": "gemv_int4_int8.cu" for kind in ("quantize_activations_int8", "gemv_int4_int8")
       for width in ("hidden", "q_dim", "intermediate")},
}


def test_kernels_allowed_to_start_early_are_those_whose_file_waits():
    """A kernel launched early without the wait would read its inputs too soon; one that waits
    but is launched plainly only loses the overlap. When a file starts to wait, its kernels
    belong in KERNELS_THAT_WAIT."""
    waits = {name: "wait_for_previous_kernel()" in (KERNELS / file).read_text() for name, file in DECODE_KERNELS.items()}
    listed = {name for name in DECODE_KERNELS if name in KERNELS_THAT_WAIT}
    assert {name for name, w in waits.items() if w} == listed
    for name, file in DECODE_KERNELS.items():  # the table names real kernels (Path A's by their macro)
        spelled = re.sub(r"_(hidden|q_dim|intermediate)$", "_##SUFFIX", name) if file == "gemv_int4_int8.cu" else name
        assert spelled in (KERNELS / file).read_text(), name
    assert "paged_attention_prefill" in KERNELS_THAT_WAIT


def test_every_waiting_kernel_also_lets_the_next_one_launch():
    """Textual: each entry point of a waiting kernel calls let_next_kernel_launch() (the wait
    itself may sit in a helper several entry points share, as int4_tile_dot in gemv_int4.cu)."""
    for name, file in DECODE_KERNELS.items():
        if name not in KERNELS_THAT_WAIT:
            continue
        source = (KERNELS / file).read_text()
        if f"{name}(" not in source:  # named through a macro (Path A's, the attention decode)
            assert "let_next_kernel_launch();" in source, file
            continue
        body = source[source.index(f"{name}("):]
        body = body[: body.find('extern "C"') if 'extern "C"' in body else len(body)]
        assert "let_next_kernel_launch();" in body or "_split_k<" in body, name


# ---------------------------------------------------------------------------- GPU


PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def pdl_available():
    driver, reason = cuda_launch.driver_module()
    if driver is None:
        pytest.skip(f"PDL falls back to plain launches here: {reason}")


@pytest.fixture(scope="module")
def engines(pdl_available):
    from nanoqwen.cli import DEFAULT_MODEL
    from nanoqwen.engine import Engine

    cuda, numpy_engine = Engine(DEFAULT_MODEL, backend="cuda"), Engine(DEFAULT_MODEL, backend="numpy")
    yield cuda, numpy_engine
    cuda.close()
    numpy_engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", PROMPTS)
def test_pdl_graph_tokens_equal_plain_graph_and_numpy(engines, prompt):
    cuda, numpy_engine = engines
    backend = cuda.backend
    want = numpy_engine.generate(prompt, max_new_tokens=32, stop_token_ids=[]).token_ids
    tokens = {}
    try:
        for pdl in (True, False):
            backend.pdl = pdl
            tokens[pdl] = cuda.generate(prompt, max_new_tokens=32, stop_token_ids=[]).token_ids
            assert backend.decode_graph().pdl is pdl
    finally:
        backend.pdl = True
    assert tokens[True] == tokens[False] == want


def _step_buffers(backend) -> dict:
    """Every device buffer one decode step writes, by name."""
    names = ("residual", "normed", "qkv_out", "q", "attn_out", "o_out", "mlp_hidden", "gate_up_out",
             "down_out", "logits", "candidate_values", "candidate_indices")
    buffers = {name: getattr(backend, name) for name in names if getattr(backend, name) is not None}
    buffers.update(state=backend.state, kv_pool=backend.kv_pool)
    for name in ("partial_max_sum", "partial_acc"):
        buffers[f"attention.{name}"] = getattr(backend.attention, name)
    for layer, gemvs in enumerate(backend.int8_layers or ()):
        for projection, gemv in gemvs.items():
            buffers[f"int8[{layer}].{projection}.xq"], buffers[f"int8[{layer}].{projection}.xscale"] = gemv.xq, gemv.xscale
    return buffers


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["fp16", "int8"])
def test_every_kernel_of_a_step_writes_the_same_bits_with_and_without_pdl(pdl_available, activations):
    """Graphs of the step's first k launches, k = 1 .. all, each run from the same state with
    every buffer poisoned: after each, all buffers equal bitwise between PDL and plain."""
    import cupy as cp

    from nanoqwen.cli import DEFAULT_MODEL
    from nanoqwen.engine import Engine

    engine = Engine(DEFAULT_MODEL, backend="cuda", activations=activations)
    try:
        backend = engine.backend
        ids = np.array(engine.tokenizer.encode(PROMPTS[1]), dtype=np.int32)
        pages = engine.allocator.allocate(4)
        token = int(np.argmax(backend.prefill(ids, 0, pages)))
        backend.set_step_inputs(token, len(ids), pages)
        stream = backend.stream
        with stream:
            state, kv_pool = backend.state.copy(), backend.kv_pool.copy()
        with profile.LaunchRecorder(backend) as recorder:
            backend.decode_step_launches(stream)
        stream.synchronize()
        thunks = [thunk for _, thunk in recorder.launches]
        buffers = _step_buffers(backend)

        def run(count: int, pdl: bool) -> dict:
            with stream:
                backend.state[...] = state
                backend.kv_pool[...] = kv_pool
                for name, buffer in buffers.items():
                    if name not in ("state", "kv_pool"):
                        buffer.fill(np.nan if buffer.dtype.kind == "f" else -1)
            with programmatic_launches(pdl) as active:
                assert active is pdl
                graph = cuda_graph.capture(stream, lambda: [thunk() for thunk in thunks[:count]])
            graph.launch(stream)
            stream.synchronize()
            return {name: cp.asnumpy(buffer).view(np.uint8) for name, buffer in buffers.items()}

        for count in range(1, len(thunks) + 1):
            plain, pdl = run(count, False), run(count, True)
            for name in buffers:
                assert np.array_equal(plain[name], pdl[name]), (
                    f"after launch {count - 1} ({recorder.launches[count - 1][0]}) {name} differs with PDL")
        engine.allocator.free(pages)
    finally:
        engine.close()


LATE_WRITER = r"""
extern "C" __global__ void write_late(const unsigned* q_source, unsigned* q, int q_words, const unsigned* kv_source,
                                      unsigned* kv, const long long* kv_words, int kv_word_count, long long delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may start now
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (unsigned long long)delay_ns);
  const int first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  for (int i = first; i < q_words; i += stride) q[i] = q_source[i];
  for (int i = first; i < kv_word_count; i += stride) kv[kv_words[i]] = kv_source[kv_words[i]];
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_attention_started_early_waits_for_its_inputs(pdl_available, splits, graph):
    """A kernel that lets attention launch at once, then, 50 us later, writes q and the new
    token's K and V rows over NaN, as rope_write_kv does in a step: attention must wait for them
    (its loads, and its bulk copies of the tail page). The pages wholly before the new token are
    in place beforehand, as earlier steps leave them: the kernel may request those before its
    wait. 37 positions end in a page holding 5 rows; 3 splits make the combine kernel run too."""
    import cupy as cp

    from nanoqwen.reference import ops
    from nanoqwen.cli import DEFAULT_MODEL
    from nanoqwen.config import PAGE_SIZE
    from nanoqwen.cuda.attention import PagedAttention, random_paged_cache, relative_error
    from nanoqwen.loader import load

    model = load(DEFAULT_MODEL)
    config = model.config
    model.close()
    seq_len, rng = 37, np.random.default_rng(7)
    attention = PagedAttention(config, num_pages=16, max_seq_len=256, splits=splits)
    pool, table = random_paged_cache(config, seq_len, rng)
    q = (2.0 * rng.standard_normal(config.q_dim)).astype(np.float32)
    reference = ops.paged_attention(q.reshape(1, config.num_heads, config.head_dim), pool, 0, table,
                                          np.array([seq_len - 1])).reshape(-1)
    write_late = cp.RawKernel(LATE_WRITER, "write_late")
    table_d = cp.full(256 // PAGE_SIZE, -1, dtype=cp.int32)
    table_d[: len(table)] = cp.asarray(table)
    q_source, kv_source = cp.asarray(q), cp.asarray(pool[0])
    # The new token's rows: position seq_len - 1 of every KV head's K and V slice in the tail page.
    new_rows = np.zeros(pool[0].shape, dtype=bool)
    new_rows[table[-1], :, :, (seq_len - 1) % PAGE_SIZE, :] = True
    new_words = cp.asarray(np.flatnonzero(new_rows.reshape(-1, 2).all(axis=1)).astype(np.int64))
    q_d, kv = cp.full_like(q_source, np.nan), kv_source.copy()
    kv.view(cp.uint32).reshape(-1)[new_words] = np.uint32(0x7E007E00)  # fp16 NaN pairs
    out = cp.full(config.q_dim, np.nan, cp.float16)
    seq_len_d = cp.asarray(np.array([seq_len], np.int32))
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)

    def issue():
        write_late((8,), (256,), (q_source, q_d, np.int32(q_d.size), kv_source, kv, new_words,
                                  np.int32(new_words.size), np.int64(50_000)))
        attention.decode(q_d, kv, table_d, seq_len_d, out, stream=stream)

    with stream, programmatic_launches() as active:
        assert active
        if graph:
            captured = cuda_graph.capture(stream, issue)
            captured.launch(stream)
        else:
            issue()
    stream.synchronize()
    assert relative_error(out.get(), reference) < 2e-3
