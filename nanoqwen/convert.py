"""Convert a Hugging Face Qwen2 checkpoint into a .nanoqwen file, one tensor at a time.

Everything the engine would refuse is refused here, before a byte is written: a configuration
it does not run (ModelConfig.from_hf), layers the configuration does not count, tensors of the
wrong shape or with no place in the model, a tokenizer that does not build or whose ids exceed
the vocabulary, a chat template that does not compile. The output is written by NanoqwenWriter (a new temporary file renamed
into place) and may not lie inside the checkpoint, whose files it would replace.
"""

from __future__ import annotations

import json
import re
import resource
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm  # a text bar everywhere: tqdm.auto warns in a Jupyter kernel without ipywidgets

from .config import MAX_DIMENSION, ModelConfig
from .errors import CheckpointError, ConfigError, GenerationError
from .format import NanoqwenWriter, check_out
from .jsonlimits import JSONLimitError, parse_json, read_json_file
from .loader import TOKENIZER_PREFIX
from .quant import quantize_int4
from .safetensors_reader import SafetensorsCheckpoint
from .tokenizer import (CHAT_TEMPLATE_JINJA, GENERATION_CONFIG_JSON, TOKENIZER_CONFIG_JSON, TOKENIZER_FILES, TOKENIZER_JSON,
                        Tokenizer)

ROWS_PER_CHUNK = 4096  # quantize big matrices in slices so temporaries stay ~100 MB
LAYER_TENSOR = re.compile(r"model\.layers\.([0-9]+)\.")  # [0-9]: \d matches the digits of every script


def resolve_source(source: str) -> Path:
    """A local checkpoint directory, or a hub id fetched with huggingface_hub (needs a network)."""
    if not source:  # Path("") is the working directory
        raise CheckpointError("the checkpoint path is empty: give a checkpoint directory or a hub id")
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists() or source.count("/") != 1:
        raise CheckpointError(f"{source}: not a checkpoint directory (and not a hub id like 'Qwen/Qwen2.5-Coder-7B-Instruct')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["*.json", "*.jinja", "*.safetensors"]))
    except Exception as e:  # no huggingface_hub, no network, no such repository: all one message
        reason = " ".join(str(e).split())  # huggingface_hub's messages run over several lines; an error is one
        raise CheckpointError(f"{source}: cannot fetch it from the Hugging Face hub ({type(e).__name__}: {reason})") from e


def quantize_rows(weight: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [quantize_int4(weight[r : r + ROWS_PER_CHUNK], group_size) for r in range(0, weight.shape[0], ROWS_PER_CHUNK)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def refuse_out_inside(out: Path, directory: Path) -> None:
    """OUT may not lie in the checkpoint: the final rename would replace one of its files."""
    if (out.parent.resolve() / out.name).is_relative_to(directory.resolve()):
        raise CheckpointError(f"{out}: lies inside the checkpoint {directory}, whose files it could replace; write OUT elsewhere")


def read_config(directory: Path) -> ModelConfig:
    """The checkpoint's config.json as a ModelConfig; CheckpointError names the file and the problem."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{directory}: no config.json")
    try:
        return ModelConfig.from_hf(parse_json(read_json_file(config_path)))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{config_path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: invalid JSON ({e})") from None
    except (JSONLimitError, ConfigError) as e:
        raise CheckpointError(f"{config_path}: {e}") from None


def check_layers(config: ModelConfig, checkpoint: SafetensorsCheckpoint) -> None:
    """The checkpoint's layers are exactly 0..num_layers-1, judged from tensor names alone, so a
    num_hidden_layers of a billion fails here, not after building a billion layers' tensor list."""
    layers: dict[str, str] = {}  # index as written -> a tensor of that layer
    for name in checkpoint.entries:
        if match := LAYER_TENSOR.match(name):
            layers.setdefault(match.group(1), name)
    for index, name in layers.items():
        # more digits than any u32 is no layer (and int() of a thousand digits is not cheap)
        if len(index) > len(str(MAX_DIMENSION)) or index != str(int(index)) or int(index) >= config.num_layers:
            raise CheckpointError(
                f"checkpoint tensor {name!r} belongs to no layer of the {config.num_layers} that config.json's "
                "num_hidden_layers counts"
            )
    if len(layers) < config.num_layers:
        raise CheckpointError(
            f"config.json says num_hidden_layers={config.num_layers}, the checkpoint holds tensors of {len(layers)} layers"
        )


def read_tokenizer(directory: Path, vocab_size: int) -> dict[str, bytes]:
    """The checkpoint's tokenizer files by name, once they have built a tokenizer the engine can run:
    every id inside the model's vocabulary, a chat template that compiles."""
    files = {}
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.exists():
            try:
                files[name] = read_json_file(path)
            except JSONLimitError as e:
                raise CheckpointError(f"{path}: {e}") from None
            if not files[name]:
                raise CheckpointError(f"{path}: is empty; remove it, or give it what transformers saves there")
    tokenizer = Tokenizer.from_checkpoint_files(files, directory)
    if tokenizer is not None:
        if tokenizer.largest_token_id >= vocab_size:
            raise CheckpointError(
                f"{directory / TOKENIZER_JSON}: token id {tokenizer.largest_token_id} lies outside the model's "
                f"vocabulary 0..{vocab_size - 1} (config.json's vocab_size)"
            )
        outside = [i for i in tokenizer.generation_stop_ids if i >= vocab_size]
        if outside:
            raise CheckpointError(f"{directory / GENERATION_CONFIG_JSON}: eos_token_id {outside[0]} lies outside the "
                                  f"model's vocabulary 0..{vocab_size - 1} (config.json's vocab_size)")
        try:
            tokenizer.compiled_template()
        except GenerationError as e:
            template_file = CHAT_TEMPLATE_JINJA if CHAT_TEMPLATE_JINJA in files else TOKENIZER_CONFIG_JSON
            raise CheckpointError(f"{directory / template_file}: {e}") from None
    return files


def refuse_an_lm_head_tying_would_drop(config: ModelConfig, checkpoint: SafetensorsCheckpoint) -> None:
    """A checkpoint that says its lm_head is the embedding (tie_word_embeddings) but stores an
    lm_head.weight of other values: transformers 4 ties them, transformers 5 keeps the stored one.
    Either choice would be silently wrong for someone, so the converter asks."""
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    if config.tie_word_embeddings and head in checkpoint and not checkpoint.same_values(head, embedding):
        raise CheckpointError(
            f"config.json sets tie_word_embeddings, but the checkpoint's {head} differs from {embedding}: "
            f"set tie_word_embeddings to false to convert the stored {head}, or remove it to tie them"
        )


def source_tensors(specs: dict, checkpoint: SafetensorsCheckpoint) -> list[tuple[str, str, tuple[int, ...]]]:
    """(.nanoqwen name, checkpoint name, checkpoint shape) of every tensor to read, each checked
    for presence and shape before a byte is written."""
    sources = []
    for name, (dtype, shape) in specs.items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            hf_name = name[: -len(".qweight")] + ".weight"
            hf_shape = (shape[0], shape[1] * 8)
        else:
            hf_name, hf_shape = name, shape
        if hf_name not in checkpoint:
            raise CheckpointError(f"checkpoint is missing tensor {hf_name!r}")
        if checkpoint.shape(hf_name) != hf_shape:
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {list(checkpoint.shape(hf_name))}, "
                f"the configuration requires {list(hf_shape)}"
            )
        sources.append((name, hf_name, hf_shape))
    return sources


# Buffers some checkpoints store beside the weights, which the configuration already determines
# (RoPE's inverse frequencies follow from rope_theta); transformers skips them on load too.
DERIVED_BUFFER = re.compile(r"model\.layers\.[0-9]+\.self_attn\.rotary_emb\.inv_freq")


def refuse_unused_tensors(config: ModelConfig, checkpoint: SafetensorsCheckpoint, sources: list) -> None:
    """Every checkpoint tensor has a place in the model: a tensor Qwen2 has no use for (o_proj's
    bias, a q_norm) means another architecture, which dropping it would convert into a silently
    different model."""
    used = {hf_name for _, hf_name, _ in sources}
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # equal to the embedding, or refused by refuse_an_lm_head_tying_would_drop
    unused = [name for name in checkpoint.entries if name not in used and not DERIVED_BUFFER.fullmatch(name)]
    if unused:
        shown = ", ".join(repr(name[:120]) for name in unused[:3])
        raise CheckpointError(f"the checkpoint holds {len(unused)} tensor(s) a Qwen2 model of this configuration has "
                              f"no place for ({shown}{', ...' if len(unused) > 3 else ''}); it is not a plain Qwen2 "
                              "checkpoint, and converting would drop them")


def convert(source: str, out: str | Path, progress: bool = True) -> dict:
    """Write `out` from the checkpoint `source`; returns a summary with the peak RSS."""
    check_out(out)  # before minutes of quantization, not at the final rename
    out = Path(out)
    directory = resolve_source(source)
    refuse_out_inside(out, directory)
    config = read_config(directory)
    checkpoint = SafetensorsCheckpoint(directory)
    check_layers(config, checkpoint)
    specs = config.tensor_specs()
    sources = source_tensors(specs, checkpoint)
    refuse_unused_tensors(config, checkpoint, sources)
    refuse_an_lm_head_tying_would_drop(config, checkpoint)
    tokenizer_blobs = {TOKENIZER_PREFIX + name: np.frombuffer(data, np.uint8)
                       for name, data in read_tokenizer(directory, config.vocab_size).items()}
    entries = [(name, dtype, shape) for name, (dtype, shape) in specs.items()]
    entries += [(name, "u8", blob.shape) for name, blob in tokenizer_blobs.items()]

    total = sum(int(np.prod(s)) for _, _, s in sources)
    with NanoqwenWriter(out, config, entries) as writer:
        with tqdm(total=total, unit="param", unit_scale=True, desc=f"convert {out.name}", disable=not progress) as bar:
            for name, hf_name, hf_shape in sources:
                weight = checkpoint.read(hf_name, hf_shape)
                if name.endswith(".qweight"):
                    try:
                        qweight, scales = quantize_rows(weight, config.group_size)
                    except ValueError as e:
                        raise CheckpointError(f"tensor {hf_name!r}: {e}") from None
                    writer.write(name, qweight)
                    writer.write(name[: -len(".qweight")] + ".scales", scales)
                else:
                    with np.errstate(over="ignore"):
                        half = weight.astype(np.float16)
                    # NaN propagates through min and max, so two reductions check every value
                    # without a tensor-sized boolean temporary
                    if not (np.isfinite(half.min()) and np.isfinite(half.max())):
                        raise CheckpointError(f"tensor {hf_name!r} holds NaN, Inf or values beyond the fp16 range")
                    writer.write(name, half)
                    del half
                del weight
                bar.update(int(np.prod(hf_shape)))
        for name, blob in tokenizer_blobs.items():
            writer.write(name, blob)
        writer.close()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "out": str(out),
        "bytes": out.stat().st_size,
        "parameters": total,
        "peak_rss_bytes": peak_kib * (1 if sys.platform == "darwin" else 1024),
        "tokenizer": sorted(tokenizer_blobs),
    }
