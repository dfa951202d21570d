"""Converting Hugging Face Qwen2 checkpoints: values survive, bad checkpoints are refused by name,
and an interrupted conversion leaves nothing behind."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import nanoqwen  # noqa: E402
from nanoqwen.convert import convert, resolve_source  # noqa: E402
from nanoqwen.format import NanoqwenWriter  # noqa: E402
from nanoqwen.quant import dequantize_int4, quantize_int4  # noqa: E402
from nanoqwen.safetensors_reader import SafetensorsCheckpoint# noqa: E402
from nanoqwen.errors import CheckpointError

# The smallest tokenizer that builds (convert refuses one that does not), copied byte for byte.
TOKENIZER = {
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}\n',
    "tokenizer_config.json": '{"chat_template": "{{ messages }} \u2713"}'.encode(),
}


def hf_checkpoint(directory, tied=False, dtype=torch.float32, max_shard_size=None, seed=0):
    """A tiny random Qwen2ForCausalLM saved by transformers itself, plus tokenizer files."""
    config = transformers.Qwen2Config(
        vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).to(dtype)
    with torch.no_grad():  # transformers initializes norms to 1 and biases to 0: make them tell apart
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.normal_(1.0 if "norm" in name else 0.0, 0.1)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    for name, data in TOKENIZER.items():
        (directory / name).write_bytes(data)
    return {name: p.detach().float().numpy() for name, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for key, kwargs in {
        "untied": {},
        "tied": {"tied": True, "seed": 1},
        "sharded": {"max_shard_size": "300KB", "seed": 2},
        "bf16": {"dtype": torch.bfloat16, "seed": 3},
    }.items():
        directory = tmp_path_factory.mktemp(key)
        made[key] = (directory, hf_checkpoint(directory, **kwargs))
    return made


@pytest.mark.parametrize("key", ["untied", "tied", "sharded", "bf16"])
def test_converted_tensors_match_the_checkpoint(checkpoints, key, tmp_path):
    directory, weights = checkpoints[key]
    summary = convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    model = nanoqwen.load(summary["out"], verify_checksums=True)
    assert summary["bytes"] == (tmp_path / "m.nanoqwen").stat().st_size
    # save_pretrained writes generation_config.json beside the tokenizer files the fixture wrote
    stored = {**TOKENIZER, "generation_config.json": (directory / "generation_config.json").read_bytes()}
    assert summary["tokenizer"] == sorted("tokenizer/" + name for name in stored)
    assert model.tokenizer_files == stored
    assert model.config.tie_word_embeddings == (key == "tied")
    assert ("lm_head.weight" in model.tensors) == (key != "tied")
    checked = set()
    for name, array in model.tensors.items():
        if name.startswith("tokenizer/") or name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            w = weights[prefix + ".weight"]
            scales = model.tensors[prefix + ".scales"]
            # the converter's packing is exactly quant.quantize_int4 of the source weight ...
            expected_q, expected_s = quantize_int4(w)
            np.testing.assert_array_equal(array, expected_q)
            np.testing.assert_array_equal(scales, expected_s)
            # ... so its error obeys the contract's bound
            bound = np.repeat(scales.astype(np.float64), 128, axis=1) / 2 * (1 + 1e-6)
            assert (np.abs(dequantize_int4(array, scales) - w) <= bound).all(), name
            checked.add(prefix + ".weight")
        else:
            assert array.dtype == np.float16
            np.testing.assert_array_equal(array, weights[name].astype(np.float16), err_msg=name)
            checked.add(name)
    expected = set(weights)
    if key == "tied":  # transformers lists the tied head in state_dict, the file stores it once
        expected.discard("lm_head.weight")
        np.testing.assert_array_equal(model.lm_head, weights["lm_head.weight"].astype(np.float16))
    assert checked == expected


def test_sharded_checkpoint_reads_through_its_index(checkpoints):
    directory, weights = checkpoints["sharded"]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    checkpoint = SafetensorsCheckpoint(directory)
    assert set(checkpoint.entries) == set(index["weight_map"])
    assert len({path for path, *_ in checkpoint.entries.values()}) == len(set(index["weight_map"].values()))


def test_bf16_checkpoint_is_read_exactly(checkpoints):
    directory, weights = checkpoints["bf16"]
    checkpoint = SafetensorsCheckpoint(directory)
    name = "model.layers.1.mlp.down_proj.weight"
    assert checkpoint.entries[name][1] == "BF16"
    np.testing.assert_array_equal(checkpoint.read(name), weights[name])


def copy_checkpoint(checkpoints, tmp_path, key="untied"):
    target = tmp_path / "checkpoint"
    shutil.copytree(checkpoints[key][0], target)
    return target


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def edit_tensors(directory, edit):
    tensors = safetensors_numpy.load_file(directory / "model.safetensors")
    edit(tensors)
    safetensors_numpy.save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "not a Qwen2 causal LM"),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, "not a Qwen2 causal LM"),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "layer_types": None},
         r"sliding-window.*layers \[1\]"),
        ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
         r"layers \[0\] of type 'sliding_attention'"),
        ({"use_sliding_window": True, "sliding_window": 64, "layer_types": None, "num_hidden_layers": 10**10},
         r"sliding-window.*layers \[28, 29, 30, 31, 32, 33, 34, 35\]"),  # at once, without a list of 10^10 layers
        ({"use_sliding_window": True, "sliding_window": 16, "layer_types": "sliding_attention"},
         "layer_types must be a list of strings"),  # transformers refuses it too
        ({"use_sliding_window": True, "sliding_window": 16, "layer_types": [0, 1]}, "layer_types must be a list of strings"),
        ({"architectures": None}, "not a Qwen2 causal LM"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "'yarn' RoPE scaling"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, "'yarn' RoPE scaling"),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}}, "full_attention asks for 'linear'"),
        ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "RoPE's base more than once"),
        ({"rope_scaling": {"rope_type": None, "type": "linear", "factor": 4.0}}, "asks for 'linear' RoPE scaling"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 5.0}, "x": "y"}},
         r"rope_parameters mixes objects per attention type \('full_attention'\) with other entries"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e-300}}, r"rope_theta=1e-300 must be positive, and it and its inverse finite in float32"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e300}}, r"rope_theta=1e\+300 must be positive, and it and its inverse finite in float32"),
        ({"rms_norm_eps": 1e-50}, "rms_norm_eps=1e-50 must be positive and finite in float32"),
        ({"hidden_size": 200}, "not a multiple of the INT4 group size"),
        ({"head_dim": 24}, r"num_heads x head_dim = 96 is not a multiple of the INT4 group size"),
        ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads"),
    ],
)
def test_refuses_unsupported_configs(checkpoints, tmp_path, changes, match):
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_config(directory, **changes)
    with pytest.raises(CheckpointError, match=match):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_a_tied_checkpoint_with_its_own_lm_head_converts_only_if_they_agree(checkpoints, tmp_path):
    """transformers versions disagree on which matrix such a checkpoint's lm_head is."""
    directory = copy_checkpoint(checkpoints, tmp_path, "tied")
    embedding = safetensors_numpy.load_file(directory / "model.safetensors")["model.embed_tokens.weight"]
    edit_tensors(directory, lambda t: t.__setitem__("lm_head.weight", embedding.copy()))
    convert(str(directory), tmp_path / "same.nanoqwen", progress=False)
    edit_tensors(directory, lambda t: t.__setitem__("lm_head.weight", embedding[::-1].copy()))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert not list(tmp_path.glob("m.nanoqwen*"))


@pytest.mark.parametrize("changes", [
    {"hidden_act": "swish"},
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, "layer_types": "absent"},  # none from 2 on
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},  # layer_types: both full
    {"use_sliding_window": False, "layer_types": ["sliding_attention", "sliding_attention"]},
    {"rms_norm_eps": None, "max_position_embeddings": None, "architectures": "absent"},
])
def test_accepts_what_transformers_runs_as_plain_qwen2(checkpoints, tmp_path, changes):
    directory = copy_checkpoint(checkpoints, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None or value == "absent":
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    loaded = nanoqwen.load(convert(str(directory), tmp_path / "m.nanoqwen", progress=False)["out"]).config
    want = transformers.Qwen2Config.from_pretrained(directory)
    assert (loaded.rms_norm_eps, loaded.max_position_embeddings) == (want.rms_norm_eps, want.max_position_embeddings)
    assert want.sliding_window is None or set(want.layer_types) == {"full_attention"}  # no window runs there either


def test_refuses_missing_config_and_missing_weights(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


def test_refuses_a_tensor_stored_in_two_files(checkpoints, tmp_path):
    """A folder without model.safetensors or an index is read whole: which of two copies counts
    would be a guess."""
    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / "model.safetensors").rename(directory / "weights.safetensors")
    norm = safetensors_numpy.load_file(directory / "weights.safetensors")["model.norm.weight"]
    safetensors_numpy.save_file({"model.norm.weight": norm + 1}, directory / "patch.safetensors")
    with pytest.raises(CheckpointError, match="'model.norm.weight' is stored twice"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "model.safetensors"])
def test_refuses_a_fifo_in_the_checkpoint_without_waiting(checkpoints, tmp_path, name):
    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / name).unlink()
    os.mkfifo(directory / name)
    with pytest.raises(CheckpointError, match=f"{name}: is not a regular file"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


def test_refuses_missing_shard(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path, "sharded")
    shard = sorted(directory.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard named in the index is missing"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


def test_refuses_missing_tensor_by_name(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert not list(tmp_path.glob("m.nanoqwen*"))


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.bias", "model.norm.weight"])
def test_refuses_misshaped_tensor_by_name(checkpoints, tmp_path, name):
    directory = copy_checkpoint(checkpoints, tmp_path)

    def grow(tensors):
        tensors[name] = np.concatenate([tensors[name], tensors[name][:1]])

    edit_tensors(directory, grow)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape .* the configuration requires"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


@pytest.mark.parametrize(
    "name, value",
    [("model.layers.0.input_layernorm.weight", np.nan), ("model.embed_tokens.weight", 1e6), ("model.layers.1.mlp.gate_proj.weight", np.inf)],
)
def test_refuses_values_fp16_cannot_hold_by_name(checkpoints, tmp_path, name, value):
    directory = copy_checkpoint(checkpoints, tmp_path)

    def poison(tensors):
        tensors[name].reshape(-1)[3] = value

    edit_tensors(directory, poison)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}'.*(NaN|Inf)"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_refuses_unsupported_dtype(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_tensors(directory, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].astype(np.float64)))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype F64"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


@pytest.mark.parametrize("failing_call", [1, 9, 40])
def test_interrupted_conversion_leaves_nothing(checkpoints, tmp_path, monkeypatch, failing_call):
    directory = checkpoints["sharded"][0]
    out = tmp_path / "out"
    out.mkdir()
    real_write = NanoqwenWriter.write
    calls = []

    def write_then_fail(self, name, array):
        calls.append(name)
        if len(calls) == failing_call:
            assert self.partial.exists()  # the bytes so far live only in the .partial file
            raise KeyboardInterrupt  # what Ctrl-C does mid-conversion
        real_write(self, name, array)

    monkeypatch.setattr(NanoqwenWriter, "write", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert(str(directory), out / "m.nanoqwen", progress=False)
    assert len(calls) == failing_call
    assert list(out.iterdir()) == []


def test_failure_at_the_final_rename_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    import nanoqwen.format

    def refuse(*args):
        raise OSError("disk vanished")

    monkeypatch.setattr(nanoqwen.format.os, "replace", refuse)
    with pytest.raises(OSError, match="disk vanished"):
        convert(str(checkpoints["untied"][0]), tmp_path / "m.nanoqwen", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_resolve_source_refuses_what_is_neither_a_directory_nor_a_hub_id(tmp_path):
    (tmp_path / "file.safetensors").write_bytes(b"")
    for source in (str(tmp_path / "file.safetensors"), "no-slash-name", "a/b/c"):
        with pytest.raises(CheckpointError, match="not a checkpoint directory"):
            resolve_source(source)
    with pytest.raises(CheckpointError, match="the checkpoint path is empty"):
        resolve_source("")  # not the working directory


# ---- what the engine would refuse, refused before a byte is written ----


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'; nanoqwen runs only 'silu'"),
        ({"max_position_embeddings": 2**32}, "max_position_embeddings=4294967296 does not fit"),
        ({"max_position_embeddings": 1}, "max_position_embeddings=1 holds no token past a prompt's first"),
        ({"num_hidden_layers": 1}, r"tensor 'model\.layers\.1\..*' belongs to no layer of the 1 that config.json's"),
        ({"num_hidden_layers": 3}, "num_hidden_layers=3, the checkpoint holds tensors of 2 layers"),
    ],
)
def test_refuses_what_the_engine_does_not_run(checkpoints, tmp_path, changes, match):
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_config(directory, **changes)
    with pytest.raises(CheckpointError, match=match):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_a_billion_layers_fail_at_once(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_config(directory, num_hidden_layers=10**9)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="num_hidden_layers=1000000000, the checkpoint holds tensors of 2 layers"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert time.perf_counter() - start < 5  # no billion-layer tensor list was built


def test_a_layer_index_in_another_script_is_no_layer(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_tensors(directory, lambda t: t.__setitem__("model.layers.\u0661.extra", t["model.norm.weight"]))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) a Qwen2 model .* no place for \('model.layers.\u0661.extra'\)"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)  # not layer 1: a tensor of no layer
    edit_tensors(directory, lambda t: t.__setitem__("model.layers.01.extra", t["model.norm.weight"]))
    with pytest.raises(CheckpointError, match="'model.layers.01.extra' belongs to no layer"):
        convert(str(directory), tmp_path / "again.nanoqwen", progress=False)


@pytest.mark.parametrize(
    "name, data, match",
    [
        ("tokenizer.json", b'{"model": {"type": "BPE"}}', "tokenizer.json: Missing vocab/merges"),
        ("tokenizer.json", b"\xff", "tokenizer.json: not UTF-8"),
        ("tokenizer.json", b'{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 320}, "merges": []}}',
         r"tokenizer.json: token id 320 lies outside the model's vocabulary 0\.\.319"),
        ("tokenizer_config.json", b'{"chat_template": "{% for %}"}', "tokenizer_config.json: the tokenizer's chat template failed"),
        ("chat_template.jinja", b"{% for %}", "chat_template.jinja: the tokenizer's chat template failed"),
        ("chat_template.jinja", b"\xff", "chat_template.jinja: not UTF-8"),
        ("chat_template.jinja", b"", "chat_template.jinja: is empty"),
        ("generation_config.json", b'{"eos_token_id": "<|im_end|>"}', "generation_config.json: eos_token_id must be"),
        ("generation_config.json", b'{"eos_token_id": [1, 320]}',
         r"generation_config.json: eos_token_id 320 lies outside the model's vocabulary 0\.\.319"),
        ("generation_config.json", b"[1]", "generation_config.json: a JSON list, not an object"),
        ("tokenizer_config.json", b"", "tokenizer_config.json: is empty"),
        ("tokenizer_config.json", b'{"eos_token": 5}', "tokenizer_config.json: eos_token must be a string"),
        ("tokenizer_config.json", b'{"a":' * 100 + b"1" + b"}" * 100, "tokenizer_config.json: nested 100 levels deep"),
    ],
)
def test_refuses_a_tokenizer_the_engine_could_not_build(checkpoints, tmp_path, name, data, match):
    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / name).write_bytes(data)
    with pytest.raises(CheckpointError, match=match) as error:
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert str(directory / name) in str(error.value)
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_chat_template_jinja_comes_before_the_configs_template(checkpoints, tmp_path):
    """transformers 5 saves a tokenizer's template to chat_template.jinja and reads it ahead of
    tokenizer_config.json's; the converted file chats with that template."""
    from nanoqwen.tokenizer import Tokenizer

    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / "chat_template.jinja").write_text("{{ 'system: be brief\n' }}{{ messages[0]['content'] }}")
    summary = convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    tokenizer = Tokenizer.from_files(nanoqwen.load(summary["out"]).tokenizer_files)
    assert tokenizer.chat_prompt([{"role": "user", "content": "hi"}]) == "system: be brief\nhi"


def test_generation_stops_where_generation_config_says(checkpoints, tmp_path):
    """transformers' generate stops at generation_config.json's eos_token_id; so does the engine."""
    directory = copy_checkpoint(checkpoints, tmp_path)
    prompt = [3, 1, 4, 1, 5]
    first = nanoqwen.Engine(convert(str(directory), tmp_path / "a.nanoqwen", progress=False)["out"], backend="numpy")
    free = first.generate(prompt, max_new_tokens=3)
    assert free.finish_reason == "length" and len(free.token_ids) == 3
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [free.token_ids[1], 319]}))
    engine = nanoqwen.Engine(convert(str(directory), tmp_path / "b.nanoqwen", progress=False)["out"], backend="numpy")
    assert engine.tokenizer.stop_token_ids == (free.token_ids[1], 319)
    stopped = engine.generate(prompt, max_new_tokens=3)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:1]


def test_refuses_an_oversized_tokenizer_file_before_reading_it(checkpoints, tmp_path, monkeypatch):
    from nanoqwen import jsonlimits

    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / "tokenizer.json").write_bytes(b" " * 20_000 + TOKENIZER["tokenizer.json"])
    monkeypatch.setattr(jsonlimits, "MAX_JSON_BYTES", 10_000)  # above config.json's and the header's size
    with pytest.raises(CheckpointError, match="tokenizer.json: holds 20,0.. bytes, more than the 10,000 bytes of JSON"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


# ---- where the output goes ----


@pytest.mark.parametrize("target", ["config.json", "model.safetensors", "new.nanoqwen", "sub/new.nanoqwen"])
def test_refuses_an_output_inside_the_checkpoint(checkpoints, tmp_path, target):
    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / "sub").mkdir()
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError, match="lies inside the checkpoint .*, whose files it could replace"):
        convert(str(directory), directory / target, progress=False)
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before
    assert list((directory / "sub").iterdir()) == []


def test_writers_of_one_path_never_share_a_temporary_file(checkpoints, tmp_path):
    """Two conversions to one OUT at once: each writes its own file, the last rename wins, and
    the result is one of them whole."""
    out = tmp_path / "m.nanoqwen"
    results, errors = {}, []

    def run(key):
        try:
            convert(str(checkpoints[key][0]), out, progress=False)
            results[key] = nanoqwen.load(out, verify_checksums=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(key,)) for key in ("untied", "bf16")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and list(tmp_path.iterdir()) == [out]
    final = nanoqwen.load(out, verify_checksums=True)
    embed = final.tensors["model.embed_tokens.weight"]
    assert any(np.array_equal(embed, checkpoints[key][1]["model.embed_tokens.weight"].astype(np.float16))
               for key in ("untied", "bf16"))


def test_two_open_writers_of_one_path_hold_two_files(tmp_path):
    config = nanoqwen.ModelConfig(num_layers=1, hidden_size=128, intermediate_size=128, num_heads=1, num_kv_heads=1,
                                  head_dim=128, vocab_size=8, max_position_embeddings=16, rope_theta=1e4,
                                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    entries = [(name, dtype, shape) for name, (dtype, shape) in config.tensor_specs().items()]
    first, second = (NanoqwenWriter(tmp_path / "m.nanoqwen", config, entries) for _ in range(2))
    assert first.partial != second.partial and first.partial.exists() and second.partial.exists()
    first.abort()
    second.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_link_planted_at_the_temporary_name_is_not_followed(checkpoints, tmp_path, monkeypatch):
    import nanoqwen.format

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    monkeypatch.setattr(nanoqwen.format.secrets, "token_hex", lambda n: "planted")
    (tmp_path / "m.nanoqwen.planted.partial").symlink_to(victim)
    with pytest.raises(FileExistsError):
        convert(str(checkpoints["untied"][0]), tmp_path / "m.nanoqwen", progress=False)
    assert victim.read_text() == "precious" and not (tmp_path / "m.nanoqwen").exists()


SLOW_CONVERT = """
import sys, time
from nanoqwen.convert import convert
from nanoqwen.format import NanoqwenWriter

real_write = NanoqwenWriter.write
def slow_write(self, name, array):
    real_write(self, name, array)
    print("writing", flush=True)
    time.sleep(60)
NanoqwenWriter.write = slow_write
convert(sys.argv[1], sys.argv[2], progress=False)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_refuses_to_replace_a_fifo(checkpoints, tmp_path):
    fifo = tmp_path / "m.nanoqwen"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="not a regular file"):
        convert(str(checkpoints["untied"][0]), fifo, progress=False)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["m.nanoqwen"]


def test_a_link_is_replaced_only_where_it_names_a_regular_file(checkpoints, tmp_path):
    """The rename replaces a link, not what it names: a link to a file is fine, a link to a device is not."""
    from nanoqwen.format import output_file_problem

    (tmp_path / "file").write_text("kept")
    (tmp_path / "to-file.nanoqwen").symlink_to(tmp_path / "file")
    (tmp_path / "to-null.nanoqwen").symlink_to("/dev/null")
    (tmp_path / "to-nothing.nanoqwen").symlink_to(tmp_path / "missing")
    assert output_file_problem(tmp_path / "to-nothing.nanoqwen") is None
    with pytest.raises(FileExistsError, match="to-null.nanoqwen: exists and is not a regular file"):
        convert(str(checkpoints["untied"][0]), tmp_path / "to-null.nanoqwen", progress=False)
    convert(str(checkpoints["untied"][0]), tmp_path / "to-file.nanoqwen", progress=False)
    assert not (tmp_path / "to-file.nanoqwen").is_symlink() and (tmp_path / "file").read_text() == "kept"
    assert output_file_problem(tmp_path / "to-null.nanoqwen", renamed_over=False) is None  # written in place


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_a_termination_signal_mid_conversion_leaves_nothing(checkpoints, tmp_path, signal_name):
    if not hasattr(signal, signal_name):
        pytest.skip(f"this platform has no {signal_name}")
    number = getattr(signal, signal_name)
    out = tmp_path / "out"
    out.mkdir()
    child = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, str(checkpoints["untied"][0]), str(out / "m.nanoqwen")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "writing\n"
        assert [p.name.endswith(".partial") for p in out.iterdir()] == [True]
        child.send_signal(number)
        assert child.wait(timeout=60) == 128 + number
    finally:
        child.kill()
        child.wait()
    assert list(out.iterdir()) == []


SIGNAL_IN_A_DESTRUCTOR = """
import os, signal, sys, threading, time
from nanoqwen.format import termination_raises_system_exit

class Slow:
    def __del__(self):
        print("in __del__", flush=True)
        time.sleep(1.0)

with termination_raises_system_exit():
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        Slow()  # collected at once: its __del__ is running when the signal arrives
        time.sleep(5)
        print("ran on", flush=True)
    finally:
        print("cleaned up", flush=True)
"""


def test_a_termination_signal_inside_a_destructor_still_ends_the_run():
    """Python prints and drops an exception raised inside __del__; the signal is taken again after it."""
    done = subprocess.run([sys.executable, "-c", SIGNAL_IN_A_DESTRUCTOR], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stdout.split("\n")[:2] == ["in __del__", "cleaned up"] and "Exception ignored" not in done.stderr


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.o_proj.bias", "model.layers.1.self_attn.q_norm.weight",
                                   "some.other.tensor"])
def test_refuses_tensors_a_qwen2_model_has_no_place_for(checkpoints, tmp_path, extra):
    """A bias or norm Qwen2 does not have means another architecture: dropping it would convert a different model."""
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_tensors(directory, lambda t: t.__setitem__(extra, t["model.norm.weight"] + 5))
    with pytest.raises(CheckpointError, match=f"1 tensor\\(s\\) a Qwen2 model of this configuration has no place for \\('{extra}'\\)"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_stored_rope_frequencies_are_skipped_as_transformers_skips_them(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    reference = convert(str(copy_checkpoint(checkpoints, tmp_path / "plain")), tmp_path / "plain.nanoqwen", progress=False)
    inverse_frequencies = (1e4 ** -(np.arange(0, 64, 2) / 64)).astype(np.float32)
    edit_tensors(directory, lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inverse_frequencies
                                                 for i in range(2)}))
    summary = convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert Path(summary["out"]).read_bytes() == Path(reference["out"]).read_bytes()


def test_an_integer_longer_than_python_converts_is_a_checkpoint_error(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    text = (directory / "config.json").read_text()
    (directory / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": ' + "1" * 5000))
    with pytest.raises(CheckpointError, match=r"config.json: holds an integer of more than \d+ digits"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)


def test_a_window_longer_than_any_sequence_is_full_attention(checkpoints, tmp_path):
    """transformers computes the same logits with such a window as without one."""
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_config(directory, use_sliding_window=True, sliding_window=128, max_window_layers=0, layer_types=None)
    assert nanoqwen.load(convert(str(directory), tmp_path / "m.nanoqwen", progress=False)["out"]).config.num_layers == 2
    edit_config(directory, sliding_window=127)
    with pytest.raises(CheckpointError, match=r"sliding-window attention is not supported"):
        convert(str(directory), tmp_path / "again.nanoqwen", progress=False)
