"""Inputs that used to escape as the wrong exception: each now fails with a clear, named error.

Corrupt tokenizer blobs and odd group sizes (the loader), non-finite logits and a closed
engine (the engine), GPUs older than Hopper (backend choice), malformed chat messages, and
token ids, positions and page tables a backend must refuse before it indexes anything.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import types
from importlib.machinery import ModuleSpec
from pathlib import Path

import numpy as np
import pytest

import nanoqwen
from nanoqwen import backends as backends_module
from nanoqwen import engine as engine_module
from nanoqwen.reference.backend import NumpyBackend
from nanoqwen.config import ModelConfig
from nanoqwen.engine import Engine
from nanoqwen.errors import BackendUnavailableError, CheckpointError, ContextLengthError, GenerationError
from nanoqwen.kvcache import PAGE_SIZE, check_positions, check_tokens
from nanoqwen.random_model import write_random_model
from nanoqwen.testing import DEFAULT_CONFIG, make_hf_checkpoint, make_nanoqwen

CONFIG = ModelConfig(**DEFAULT_CONFIG)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """tokenizer.json and tokenizer_config.json as the hub ships them (from the test checkpoint)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return nanoqwen.load(make_nanoqwen(tmp_path_factory.mktemp("model")))


@pytest.fixture
def engine(model):
    return Engine(model, backend="numpy")


def model_with_tokenizer(tmp_path, tokenizer_dir, **replacements: bytes):
    """A valid file whose tokenizer blobs are the checkpoint's, except those replaced."""
    directory = tmp_path / "tok"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    for name, data in replacements.items():
        (directory / f"{name}.json").write_bytes(data)
    return write_random_model(tmp_path / "model.nanoqwen", CONFIG, seed=3, tokenizer_dir=directory)


# ---- 1. corrupt tokenizer blobs are format errors naming the blob ----

CORRUPT_BLOBS = [
    ("tokenizer", b'{"version": "1.0", "model": \xff\xfe}', "tokenizer/tokenizer.json.*not UTF-8"),
    ("tokenizer", b'{"version": "1.0", "model": ', "tokenizer/tokenizer.json"),
    ("tokenizer", b'{"model": {"type": "NoSuchModel"}}', "tokenizer/tokenizer.json"),
    ("tokenizer_config", b"\xc3\x28{}", "tokenizer/tokenizer_config.json.*not UTF-8"),
    ("tokenizer_config", b'{"chat_template": ', "tokenizer/tokenizer_config.json.*invalid JSON"),
    ("tokenizer_config", b"[1, 2]", "tokenizer/tokenizer_config.json.*not an object"),
    ("tokenizer_config", b'{"chat_template": [{"nom": "default"}]}', "tokenizer/tokenizer_config.json.*chat_template"),
]


@pytest.mark.parametrize("blob, data, match", CORRUPT_BLOBS, ids=[m.split(".*")[-1] + f"-{i}" for i, (_, _, m) in enumerate(CORRUPT_BLOBS)])
def test_corrupt_tokenizer_blob_is_a_format_error_before_any_backend(tmp_path, tokenizer_dir, monkeypatch, blob, data, match):
    path = model_with_tokenizer(tmp_path, tokenizer_dir, **{blob: data})
    nanoqwen.load(path).close()  # the file itself is intact: its CRC-32s match the bad blob

    def no_backend(*args, **kwargs):
        raise AssertionError("the backend was built before the tokenizer was checked")

    monkeypatch.setattr(engine_module, "make_backend", no_backend)
    with pytest.raises(nanoqwen.NanoqwenFormatError, match=match) as error:
        Engine(path, backend="numpy")
    assert str(path) in str(error.value)


def test_flipped_byte_in_a_tokenizer_blob_fails_the_cheap_load(tmp_path, tokenizer_dir):
    path = model_with_tokenizer(tmp_path, tokenizer_dir)
    raw = bytearray(path.read_bytes())
    offset = raw.find((tokenizer_dir / "tokenizer_config.json").read_bytes())
    assert offset > 0
    raw[offset + 3] ^= 0x20
    path.write_bytes(bytes(raw))
    with pytest.raises(nanoqwen.NanoqwenFormatError, match="tokenizer/tokenizer_config.json' fails its CRC-32"):
        nanoqwen.load(path)


def test_bad_chat_template_is_a_generation_error(tmp_path, tokenizer_dir):
    path = model_with_tokenizer(tmp_path, tokenizer_dir, tokenizer_config=b'{"chat_template": "{% for %}"}')
    engine = Engine(path, backend="numpy")
    with pytest.raises(GenerationError, match="chat template"):
        engine.generate("hi", chat=True)
    assert engine.generate("hi", max_new_tokens=2).token_ids  # plain prompts still work


# ---- 2. the INT4 group size is fixed by the format ----


def test_group_size_other_than_128_is_refused(tmp_path):
    path = write_random_model(tmp_path / "g64.nanoqwen", ModelConfig(**DEFAULT_CONFIG, group_size=64))
    with pytest.raises(nanoqwen.NanoqwenFormatError, match="invalid model configuration.*group_size is 64.*128"):
        nanoqwen.load(path)


# ---- 4. non-finite logits ----


def test_numpy_greedy_decode_raises_like_sample_on_nan(engine):
    backend = engine.backend
    pages = engine.allocator.allocate(1)
    try:
        backend.prefill(np.array([1, 2, 3]), 0, pages)
        backend.kv_pool[...] = np.nan  # every cached row is NaN: attention, then the logits, follow
        with pytest.raises(FloatingPointError, match="not finite"):
            backend.decode_next(4, 3, pages)
    finally:
        engine.allocator.free(pages)
        backend.kv_pool[...] = 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_a_generation_error_and_the_engine_survives(engine, monkeypatch, temperature):
    expected = engine.generate([5, 6, 7], max_new_tokens=4, stop_token_ids=[]).token_ids
    real_decode = engine.backend.decode

    def nan_decode(*args):
        return np.full_like(real_decode(*args), np.nan)

    monkeypatch.setattr(engine.backend, "decode", nan_decode)
    with pytest.raises(GenerationError, match="non-finite logits.*nanoqwen inspect --verify"):
        engine.generate([5, 6, 7], max_new_tokens=4, temperature=temperature, seed=0)
    monkeypatch.undo()
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert engine.generate([5, 6, 7], max_new_tokens=4, stop_token_ids=[]).token_ids == expected


# ---- 5. a closed engine ----


def test_closed_engine_refuses_every_call(tmp_path):
    closed_backends = []
    engine = Engine(make_nanoqwen(tmp_path), backend="numpy")
    engine.backend.close = lambda: closed_backends.append(True)  # a backend may hold device memory
    stream = engine.stream("x", max_new_tokens=5, stop_token_ids=[])
    next(stream)
    engine.close()
    engine.close()  # idempotent
    assert engine.backend is None and closed_backends == [True]
    for call in (lambda: engine.generate("x"), lambda: engine.stream("x"), lambda: engine.encode_prompt("x"),
                 lambda: engine.check_settings(speculate=2), lambda: next(stream)):
        with pytest.raises(GenerationError, match="engine is closed"):
            call()
    assert "closed" in repr(engine)


# ---- 6. the CUDA backend needs Hopper ----


def fake_cupy(monkeypatch, capability: str, devices: int = 1):
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = ModuleSpec("cupy", None)
    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: devices),
        Device=lambda index: types.SimpleNamespace(compute_capability=capability),
    )
    monkeypatch.setitem(sys.modules, "cupy", cupy)


def test_pre_hopper_gpu_falls_back_to_numpy_and_cuda_says_why(model, monkeypatch):
    fake_cupy(monkeypatch, "80")  # an A100
    assert not backends_module.cuda_available()
    assert Engine(model, backend="auto").backend.name == "numpy"
    with pytest.raises(BackendUnavailableError, match="compute capability 8.0.*9.0 or newer"):
        Engine(model, backend="cuda")
    fake_cupy(monkeypatch, "90", devices=0)
    with pytest.raises(BackendUnavailableError, match="no NVIDIA GPU"):
        Engine(model, backend="cuda")


def test_prefill_weights_policy_is_checked(model):
    with pytest.raises(ValueError, match="prefill_weights must be one of auto, cache, expand, got 'fp16'"):
        Engine(model, backend="numpy", prefill_weights="fp16")
    with pytest.raises(BackendUnavailableError, match="CUDA backend only"):
        Engine(model, backend="numpy", prefill_weights="cache")
    assert Engine(model, backend="numpy", prefill_weights="expand").backend.name == "numpy"


def test_a_decode_form_switch_drops_the_graph_and_refuses_what_the_path_lacks():
    from nanoqwen.cuda.backend import CudaBackend

    backend = object.__new__(CudaBackend)  # the switches need no GPU: only the attributes they touch
    backend.activations, backend._graph = "int8", None
    backend.rope_in_qkv, backend.pdl = False, True
    backend._graph = "captured"
    backend.pdl = True  # unchanged: the graph stays
    assert backend._graph == "captured"
    backend.pdl = False
    assert backend._graph is None and backend.pdl is False
    with pytest.raises(ValueError, match="rope_in_qkv needs fp16 activations"):
        backend.rope_in_qkv = True
    assert backend.rope_in_qkv is False


def test_hopper_gpu_counts_as_available(monkeypatch):
    for capability in ("90", "100"):
        fake_cupy(monkeypatch, capability)
        assert backends_module.cuda_unavailable_reason() is None


# ---- 9. chat messages ----

BAD_CONVERSATIONS = [
    ([{"role": "user", "content": None}], "chat message 0: 'content' must be a string"),
    ([{"role": "system", "content": "be brief"}, {"role": 3, "content": "hi"}], "chat message 1: 'role' must be a string"),
    ([{"role": "user", "content": ["hi"]}], "'content' must be a string, got list"),
    ([{"role": "user", "content": "hi"}, "and then"], "chat message 1 must be a dict"),
    ([], "empty conversation"),
]


@pytest.mark.parametrize("messages, match", BAD_CONVERSATIONS)
def test_bad_chat_messages_name_the_message(engine, messages, match):
    with pytest.raises(GenerationError, match=match):
        engine.generate(messages, chat=True)
    if messages:
        with pytest.raises(GenerationError, match=match):
            engine.stream(messages)  # a list of messages is a chat without chat=True too
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_context_length_error_is_a_generation_error(engine):
    with pytest.raises(ContextLengthError):
        engine.generate([{"role": "user", "content": "word " * 3000}])


# ---- 10. the shared input checks, and the numpy backend that uses them ----


def test_check_tokens():
    assert check_tokens([0, 511], 512).dtype == np.int32
    assert check_tokens(np.array([3], np.uint64), 512).tolist() == [3]
    for bad, match in [([], "at least one"), ([[1]], "1-D"), ([1.0], "integer"), ([True], "integer"),
                       ([512], r"0\.\.511"), ([-1], r"0\.\.511")]:
        with pytest.raises(ValueError, match=match):
            check_tokens(bad, 512)


def test_check_positions():
    table = np.array([4, 0, 2], np.int64)
    assert check_positions(0, 3 * PAGE_SIZE, table, num_pages=5, max_seq_len=64).tolist() == [4, 0, 2]
    assert check_positions(np.int64(17), 1, table[:2], 5, 64).dtype == np.int32
    cases = [
        ((-1, 1, table), "outside 0..63"),
        ((60, 5, table), "outside 0..63"),  # past the backend's capacity
        ((2 * PAGE_SIZE, 1, table[:2]), "need 3 pages; the page table has 2"),
        ((0, 1, np.arange(5)), "at most 4"),  # longer than any sequence of the backend
        ((0, 1, np.array([5])), "ids outside 0..4"),
        ((0, 1, np.array([-1])), "ids outside 0..4"),
        ((0, 1, np.array([1, 1])), "names a page twice"),
        ((0, 1, np.array([1.0])), "1-D integer array"),
        ((0, 1, np.array([[1]])), "1-D integer array"),
        ((0, 0, table), "count >= 1"),
        ((0.0, 1, table), "integer start"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            check_positions(*args, num_pages=5, max_seq_len=64)


def test_numpy_backend_refuses_what_the_cuda_backend_refuses(model):
    backend = NumpyBackend(model, num_pages=4)  # 64 positions
    pages = np.array([3, 1, 0, 2], np.int32)
    for call, match in [
        (lambda: backend.prefill(np.array([1, 512]), 0, pages), r"token ids must lie in 0\.\.511"),
        (lambda: backend.decode(-1, 0, pages), r"token ids must lie in 0\.\.511"),
        (lambda: backend.decode(1.5, 0, pages), "integer"),
        (lambda: backend.prefill(np.array([], np.int32), 0, pages), "at least one"),
        (lambda: backend.decode(1, 64, pages), "outside 0..63"),
        (lambda: backend.decode(1, 0, pages.astype(np.float32)), "integer array"),
        (lambda: backend.decode(1, 0, np.array([1, 1])), "twice"),
        (lambda: backend.decode_next(1, 16, pages[:1]), "need 2 pages"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_only_the_last_prefill_chunk_computes_logits(model, monkeypatch):
    from nanoqwen.reference import backend as backend_numpy
    from nanoqwen.reference import ops

    monkeypatch.setattr(backend_numpy, "PREFILL_CHUNK", 16)
    calls = []
    real = ops.fp16_linear
    monkeypatch.setattr(ops, "fp16_linear", lambda x, w: calls.append(w.dtype) or real(x, w))
    backend = NumpyBackend(model, num_pages=4)
    logits = backend.prefill(np.arange(1, 41), 0, np.arange(4))  # chunks of 16, 16, 8
    assert logits.shape == (model.config.vocab_size,) and calls == [np.float32]  # once, on the cached fp32 head


def test_lm_head_is_cached_only_within_the_budget(model):
    projections = 4 * sum(getattr(layer, p).out_features * getattr(layer, p).in_features
                          for layer in NumpyBackend(model, 1).layers for p in ("q", "k", "v", "o", "gate", "up", "down"))
    head = 4 * model.lm_head.size
    assert NumpyBackend(model, 1, weight_cache_bytes=projections + head)._lm_head_fp32 is not None
    tight = NumpyBackend(model, 1, weight_cache_bytes=projections + head - 1)
    assert tight.weights_cached and tight._lm_head_fp32 is None
    only_head = NumpyBackend(model, 1, weight_cache_bytes=head)
    assert not only_head.weights_cached and only_head._lm_head_fp32 is not None
    pages = np.arange(1, dtype=np.int32)
    reference = NumpyBackend(model, 1).prefill(np.array([1, 2, 3]), 0, pages)
    np.testing.assert_allclose(tight.prefill(np.array([1, 2, 3]), 0, pages), reference, rtol=1e-5, atol=1e-5)


# ---- 7. the command line: every user error is one line ----


def cli_run(capsys, *argv):
    from nanoqwen import cli

    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exit_info:  # argparse's usage errors
        status = exit_info.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(result, message):
    status, _, stderr = result
    assert status == 1, stderr
    assert message in stderr and "Traceback" not in stderr and stderr.count("\n") == 1, stderr


@pytest.mark.parametrize("argument", ["{model}", "some/other.nanoqwen"])
def test_generate_without_prompt_is_a_usage_error(capsys, model, argument):
    status, stdout, stderr = cli_run(capsys, "generate", argument.format(model=model.path), "--backend", "numpy")
    assert status == 2 and "missing PROMPT" in stderr and not stdout


def test_generate_with_non_finite_logits_is_one_line(capsys, model, monkeypatch):
    monkeypatch.setattr(NumpyBackend, "decode", lambda self, *args: np.full(model.config.vocab_size, np.nan, np.float32))
    result = cli_run(capsys, "generate", model.path, "x", "--max-new-tokens", 3, "--backend", "numpy")
    assert_one_line_error(result, "nanoqwen inspect --verify")


def test_generate_with_a_corrupt_tokenizer_is_one_line(capsys, tmp_path, tokenizer_dir):
    path = model_with_tokenizer(tmp_path, tokenizer_dir, tokenizer=b"\xff")
    assert_one_line_error(cli_run(capsys, "generate", path, "x", "--backend", "numpy"), "tokenizer/tokenizer.json")


def test_chat_suggests_reset_when_the_conversation_outgrows_the_context(capsys, model, monkeypatch):
    turn = "word " * 70  # 326 tokens as a chat: one turn and its 300-token reply fit in 700, two turns do not
    lines = iter([turn, turn, "/reset", "hello", "/exit"])
    monkeypatch.setattr("nanoqwen.cli._read_turn", lambda limit: next(lines))
    status, stdout, stderr = cli_run(capsys, "chat", model.path, "--backend", "numpy", "--max-new-tokens", 300,
                                     "--max-context", 700)
    assert status == 0
    assert stderr.count("too long for the context: /reset") == 1, stderr  # the second turn; after /reset it works


# ---- 8. the converter and the safetensors reader ----


@pytest.fixture
def checkpoint(tokenizer_dir, tmp_path):
    return Path(shutil.copytree(tokenizer_dir, tmp_path / "hf"))


@pytest.mark.parametrize("text, match", [
    ("{not json", "invalid JSON"),
    (b"\xff\xfe\x00{", "config.json"),
    ("[1, 2]", "JSON object"),
    ('{"hidden_size": null}', "hidden_size is missing or null"),
    ('{"hidden_size": "128"}', "hidden_size must be an integer, got '128'"),
    ('{"hidden_size": true}', "hidden_size must be an integer, got True"),
    ('{"hidden_size": 128.0}', "hidden_size must be an integer"),
    ('{"num_attention_heads": 0}', "num_attention_heads must be a positive integer"),
    ('{"rms_norm_eps": "small"}', "rms_norm_eps must be a number"),
    ('{"rope_theta": [1]}', "rope_theta must be a number"),
    ('{"rope_parameters": "yarn"}', "rope_parameters must be an object"),
    ('{"tie_word_embeddings": "no"}', "tie_word_embeddings must be true or false"),
    ('{"architectures": "Qwen2ForCausalLM"}', "not a Qwen2 causal LM"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nested more than the 32 levels of JSON"),
    ('{"hidden_act": "gelu"}', "hidden_act is 'gelu'; nanoqwen runs only 'silu'"),
    ('{"max_position_embeddings": 4294967296}', "max_position_embeddings=4294967296 does not fit the .nanoqwen header's 32-bit"),
    ('{"rope_theta": 1' + "0" * 400 + "}", "rope_theta is too large to be a float: an integer of 401 digits"),
])
def test_bad_config_json_is_a_checkpoint_error_naming_the_file(checkpoint, tmp_path, text, match):
    import json

    from nanoqwen.convert import convert

    config_path = checkpoint / "config.json"
    if isinstance(text, bytes) or not text.startswith("{\""):
        config_path.write_bytes(text if isinstance(text, bytes) else text.encode())
    else:
        config = json.loads(config_path.read_text())
        config.update(json.loads(text))
        config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match) as error:
        convert(str(checkpoint), tmp_path / "m.nanoqwen", progress=False)
    assert str(config_path) in str(error.value)


def test_convert_checks_its_output_path_before_any_work(capsys, tmp_path, monkeypatch):
    from nanoqwen import convert as convert_module

    def no_work(source):
        raise AssertionError("the checkpoint was read before the output path was checked")

    monkeypatch.setattr(convert_module, "resolve_source", no_work)
    with pytest.raises(IsADirectoryError, match="is a folder"):
        convert_module.convert("anything", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_module.convert("anything", tmp_path / "no" / "m.nanoqwen")
    assert_one_line_error(cli_run(capsys, "convert", "anything", tmp_path), "is a folder")
    assert_one_line_error(cli_run(capsys, "convert", "anything", tmp_path / "no" / "m.nanoqwen"), "does not exist")
    # a trailing slash names a folder: Path() would drop it and write a file called "out"
    assert_one_line_error(cli_run(capsys, "convert", "anything", f"{tmp_path / 'out'}/"), "names a folder")
    assert not (tmp_path / "out").exists()
    assert_one_line_error(cli_run(capsys, "convert", "anything", ""), "the output path is empty")


def test_a_write_that_fails_names_the_output_and_leaves_nothing(checkpoint, tmp_path):
    """A file-size limit (as a full disk would) stops the conversion midway; Python ignores SIGXFSZ,
    so the write raises EFBIG."""
    out = tmp_path / "out" / "m.nanoqwen"
    out.parent.mkdir()
    limited = f"ulimit -f 64 && exec {sys.executable} -m nanoqwen convert {checkpoint} {out} --quiet"
    result = subprocess.run(["bash", "-c", limited], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"cannot write {out} (File too large)" in result.stderr, result.stderr
    assert not list(out.parent.iterdir())


def test_conversion_refusals_are_one_cli_line(capsys, checkpoint, tmp_path):
    (checkpoint / "config.json").write_bytes(b'{"a":' * 5000 + b"1" + b"}" * 5000)
    assert_one_line_error(cli_run(capsys, "convert", checkpoint, tmp_path / "m.nanoqwen"), "nested more than the 32 levels")
    assert_one_line_error(cli_run(capsys, "convert", checkpoint, checkpoint / "config.json"), "lies inside the checkpoint")
    assert_one_line_error(cli_run(capsys, "convert", "", tmp_path / "m.nanoqwen"), "the checkpoint path is empty")
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_hub_download_failure_is_a_checkpoint_error(monkeypatch):
    from nanoqwen.convert import resolve_source

    hub = types.ModuleType("huggingface_hub")
    hub.__spec__ = ModuleSpec("huggingface_hub", None)

    def offline(*args, **kwargs):
        raise ConnectionError("no network.\nCheck your connection")  # huggingface_hub writes several lines

    hub.snapshot_download = offline
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    with pytest.raises(CheckpointError, match="Qwen/Nope: cannot fetch it.*no network. Check your connection") as error:
        resolve_source("Qwen/Nope")
    assert "\n" not in str(error.value)


def safetensors_bytes(header, data: bytes = b"\0" * 16) -> bytes:
    import json

    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


GOOD_ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
BAD_SAFETENSORS = [
    (b"", "too short"),
    (b"\x05\0\0", "too short"),
    (struct.pack("<Q", 2**62) + b"{}", "header length 4611686018427387904 exceeds"),
    (struct.pack("<Q", 100) + b"{}" + b"\0" * 20, "header length 100 exceeds"),
    (safetensors_bytes(b"{not json"), "not valid JSON"),
    (safetensors_bytes(b"\xff\xfe"), "not valid JSON"),
    (safetensors_bytes([GOOD_ENTRY]), "JSON list, not an object"),
    (safetensors_bytes({"w": {"shape": [2, 2], "data_offsets": [0, 16]}}), "'w' needs 'dtype'"),
    (safetensors_bytes({"w": {"dtype": "F32", "data_offsets": [0, 16]}}), "'w' needs"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": [2, 2]}}), "'w' needs"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]}}), "'w' needs"),
    (safetensors_bytes({"w": [1, 2]}), "'w' needs"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": "2x2", "data_offsets": [0, 16]}}), "'w' has a malformed"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}}), "'w' has a malformed"),
    (safetensors_bytes({"w": {"dtype": 7, "shape": [2, 2], "data_offsets": [0, 16]}}), "'w' has a malformed"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 2**40]}}), "outside the 16-byte data"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}}), "outside"),
    (safetensors_bytes(b'{"w":' * 5000 + b"1" + b"}" * 5000), "header nested more than the 32 levels of JSON"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": [[[[[[[[2]]]]]]]] * 5, "data_offsets": [0, 16]}}), "'w' has a malformed"),
    # json.loads keeps the last of two equal names, the safetensors library refuses the file
    (safetensors_bytes(b'{"w": ' + json.dumps(GOOD_ENTRY).encode() + b', "w": ' + json.dumps(GOOD_ENTRY).encode() + b"}"),
     "header names 'w' more than once"),
    # the byte ranges must tile the data, as the safetensors library requires
    (safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}), r"bytes \[4, 12\) of tensor 'b' overlap"),
    (safetensors_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}), r"leave bytes \[0, 8\) unused"),
    (safetensors_bytes({"w": GOOD_ENTRY}, b"\0" * 20), "the tensors' bytes end at 16, the file's data at 20"),
]


@pytest.mark.parametrize("data, match", BAD_SAFETENSORS, ids=range(len(BAD_SAFETENSORS)))
def test_malformed_safetensors_is_a_checkpoint_error_naming_the_file(tmp_path, data, match):
    import tracemalloc

    from nanoqwen.safetensors_reader import SafetensorsCheckpoint

    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=match) as error:
            SafetensorsCheckpoint(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(error.value) and peak < 2**20  # no buffer the size the header claims


def test_oversized_safetensors_header_and_index_are_refused_before_reading(tmp_path, monkeypatch):
    from nanoqwen import jsonlimits
    from nanoqwen.safetensors_reader import SafetensorsCheckpoint

    monkeypatch.setattr(jsonlimits, "MAX_JSON_BYTES", 100)
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes({"w": GOOD_ENTRY, "pad": "x" * 100}))
    with pytest.raises(CheckpointError, match=r"header holds 1\d\d bytes, more than the 100 bytes of JSON"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # else it is read, as transformers reads it, and the index is not
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "x" * 100}}))
    with pytest.raises(CheckpointError, match="index.json: not a safetensors index.*more than the 100 bytes of JSON"):
        SafetensorsCheckpoint(tmp_path)


def test_valid_safetensors_still_reads(tmp_path):
    from nanoqwen.safetensors_reader import SafetensorsCheckpoint

    values = np.arange(4, dtype=np.float32)
    (tmp_path / "model.safetensors").write_bytes(
        safetensors_bytes({"__metadata__": {"format": "pt"}, "w": GOOD_ENTRY}, values.tobytes()))
    np.testing.assert_array_equal(SafetensorsCheckpoint(tmp_path).read("w", (2, 2)), values.reshape(2, 2))


def test_model_safetensors_is_read_ahead_of_an_index_beside_it(tmp_path):
    """transformers loads model.safetensors where the folder has one, whatever index lies beside
    it; the index's shards (here missing, and holding other values) are not read."""
    from nanoqwen.safetensors_reader import SafetensorsCheckpoint

    values = np.arange(4, dtype=np.float32)
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes({"w": GOOD_ENTRY}, values.tobytes()))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    (tmp_path / "other.safetensors").write_bytes(safetensors_bytes({"w": GOOD_ENTRY}, (values + 1).tobytes()))
    np.testing.assert_array_equal(SafetensorsCheckpoint(tmp_path).read("w", (2, 2)), values.reshape(2, 2))


@pytest.mark.parametrize("index, match", [
    ('{"weight_map": {}}', "'weight_map' names no shard"),
    ('{"weight_map": {"w": ".."}}', r"\.\.: is not a regular file \(a folder"),
    ("{oops", "model.safetensors.index.json: not a safetensors index"),
    ('{"metadata": {}}', "not a safetensors index with a 'weight_map'"),
    ('{"weight_map": ["a.safetensors"]}', "'weight_map' must map"),
    ('{"weight_map": {"w": "../elsewhere.safetensors"}}', "'weight_map' must map"),
    ("[" * 5000 + "]" * 5000, "not a safetensors index with a 'weight_map' .JSONLimitError: nested more than the 32 levels"),
])
def test_malformed_index_is_a_checkpoint_error(tmp_path, index, match):
    from nanoqwen.safetensors_reader import SafetensorsCheckpoint

    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=match):
        SafetensorsCheckpoint(tmp_path)
