"""Converting Hugging Face Qwen2 checkpoints: values survive, bad checkpoints are refused by name,
and an interrupted conversion leaves nothing behind."""

import json
import shutil

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

TOKENIZER = {
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE", "vocab": {}}}\n',
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
    assert summary["tokenizer"] == ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
    assert model.tokenizer_files == TOKENIZER
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
        ({"use_sliding_window": True}, "sliding-window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling 'yarn'"),
        ({"hidden_size": 200}, "not a multiple of the INT4 group size"),
        ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads"),
    ],
)
def test_refuses_unsupported_configs(checkpoints, tmp_path, changes, match):
    directory = copy_checkpoint(checkpoints, tmp_path)
    edit_config(directory, **changes)
    with pytest.raises(CheckpointError, match=match):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    assert not list(tmp_path.glob("m.nanoqwen*"))


def test_refuses_missing_config_and_missing_weights(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        convert(str(directory), tmp_path / "m.nanoqwen", progress=False)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
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
