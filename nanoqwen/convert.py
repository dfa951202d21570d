"""Convert a Hugging Face Qwen2 checkpoint into a .nanoqwen file, one tensor at a time."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .config import ModelConfig
from .errors import ConfigError, CheckpointError
from .format import NanoqwenWriter
from .jsonlimits import JSONLimitError, parse_json, read_json_file
from .loader import TOKENIZER_PREFIX
from .quant import quantize_int4
from .safetensors_reader import SafetensorsCheckpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ROWS_PER_CHUNK = 4096  # quantize big matrices in slices so temporaries stay ~100 MB


def resolve_source(source: str) -> Path:
    """A local checkpoint directory, or a hub id fetched with huggingface_hub (needs a network)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists() or source.count("/") != 1:
        raise CheckpointError(f"{source}: not a checkpoint directory (and not a hub id like 'Qwen/Qwen2.5-Coder-7B-Instruct')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # no huggingface_hub, no network, no such repository: all one message
        raise CheckpointError(f"{source}: cannot fetch it from the Hugging Face hub ({type(e).__name__}: {e})") from e


def quantize_rows(weight: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [quantize_int4(weight[r : r + ROWS_PER_CHUNK], group_size) for r in range(0, weight.shape[0], ROWS_PER_CHUNK)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


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


def convert(source: str, out: str | Path, progress: bool = True) -> dict:
    """Write `out` from the checkpoint `source`; returns a summary with the peak RSS."""
    out = Path(out)
    # Fail before minutes of quantization, not at the final rename.
    if out.is_dir():
        raise IsADirectoryError(f"{out}: is a directory; OUT must be the path of the .nanoqwen file to write")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out}: the folder {out.parent} does not exist")
    directory = resolve_source(source)
    config = read_config(directory)
    checkpoint = SafetensorsCheckpoint(directory)

    specs = config.tensor_specs()
    entries = [(name, dtype, shape) for name, (dtype, shape) in specs.items()]
    tokenizer_blobs = {}
    for file_name in TOKENIZER_FILES:
        if (directory / file_name).exists():
            tokenizer_blobs[TOKENIZER_PREFIX + file_name] = np.frombuffer((directory / file_name).read_bytes(), np.uint8)
    entries += [(name, "u8", blob.shape) for name, blob in tokenizer_blobs.items()]

    # Check every source tensor's presence and shape before writing a byte.
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
