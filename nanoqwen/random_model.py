"""Random-weight .nanoqwen files of any shape, written straight from a ModelConfig.

A real 7B file is 4.5 GB of weights nobody may download on a test machine. The loader, the
kernels and the benchmarks only need *a* file with the right shapes and plausible values:
packed words of random nibbles, fp16 scales of the size real weights have, fp16 embeddings,
norms and biases. This module writes one tensor at a time through `NanoqwenWriter`, so memory
stays at the largest tensor (the 1 GiB embedding of the 7B), and fills each tensor in
row chunks on all cores.

    python -m nanoqwen.random_model qwen7b.nanoqwen --preset qwen2.5-coder-7b
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm  # a text bar everywhere: tqdm.auto warns in a Jupyter kernel without ipywidgets

from .config import ModelConfig
from .convert import read_tokenizer
from .errors import CheckpointError, ConfigError
from .format import MAX_TENSORS, NanoqwenWriter
from .loader import TOKENIZER_PREFIX
from .tokenizer import TOKENIZER_CONFIG_JSON, TOKENIZER_FILES, TOKENIZER_JSON

QWEN25_CODER_7B = ModelConfig(
    num_layers=28,
    hidden_size=3584,
    intermediate_size=18944,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

def _qwen25_coder(layers: int, hidden: int, mlp: int, heads: int, kv_heads: int, vocab: int, tied: bool) -> ModelConfig:
    """A published Qwen2.5-Coder shape (the models' config.json files): every size shares RoPE's
    theta, the norm's eps and the 32K context; head_dim is hidden / heads."""
    return ModelConfig(num_layers=layers, hidden_size=hidden, intermediate_size=mlp, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=hidden // heads, vocab_size=vocab,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied)


PRESETS = {
    "qwen2.5-coder-0.5b": _qwen25_coder(24, 896, 4864, 14, 2, 151936, tied=True),
    "qwen2.5-coder-1.5b": _qwen25_coder(28, 1536, 8960, 12, 2, 151936, tied=True),
    "qwen2.5-coder-3b": _qwen25_coder(36, 2048, 11008, 16, 2, 151936, tied=True),
    "qwen2.5-coder-7b": QWEN25_CODER_7B,
    "qwen2.5-coder-14b": _qwen25_coder(48, 5120, 13824, 40, 8, 152064, tied=False),
    "qwen2.5-coder-32b": _qwen25_coder(64, 5120, 27648, 40, 8, 152064, tied=False),
}

# Trained linear weights have a standard deviation near 0.02; the largest of 128 such values
# is ~2.7 sigma, so a group's scale max|w| / 7 sits near 0.008.
TYPICAL_SCALE = 0.008
WEIGHT_STD = 0.02
CHUNK_ELEMENTS = 1 << 22  # work unit of one thread: 4M elements, 16 MB of uint32


def _fill_packed(rng: np.random.Generator, out: np.ndarray) -> None:
    """Random uint32 words whose eight nibbles are in 1..15 (nibble 0, q = -8, is never stored)."""
    out[...] = rng.integers(0, 1 << 32, size=out.shape, dtype=np.uint32)
    # Bit 4n of `any_bit` is the OR of nibble n's four bits, so it is 0 exactly for a zero nibble.
    any_bit = out | (out >> 1)
    any_bit |= any_bit >> 2
    np.invert(any_bit, out=any_bit)
    any_bit &= 0x11111111
    out |= any_bit << 3  # a zero nibble becomes 8, that is q = 0


def _fill_float16(rng: np.random.Generator, out: np.ndarray, mean: float, std: float) -> None:
    out[...] = rng.standard_normal(size=out.shape, dtype=np.float32) * std + mean


def _fill_scales(rng: np.random.Generator, out: np.ndarray) -> None:
    out[...] = TYPICAL_SCALE * np.exp(0.25 * rng.standard_normal(size=out.shape, dtype=np.float32))


def _filler(name: str):
    if name.endswith(".qweight"):
        return _fill_packed
    if name.endswith(".scales"):
        return _fill_scales
    if name.endswith("norm.weight"):  # RMSNorm gains scatter around 1
        return lambda rng, out: _fill_float16(rng, out, 1.0, 0.1)
    return lambda rng, out: _fill_float16(rng, out, 0.0, WEIGHT_STD)


def random_tensor(name: str, dtype: str, shape: tuple[int, ...], seed: int, index: int, pool: ThreadPoolExecutor):
    """One tensor, filled in row chunks in parallel; chunk c of tensor `index` always gets the
    same random stream, so the file depends on the seed only, not on the number of threads."""
    out = np.empty(shape, dtype={"u32": np.uint32, "f16": np.float16}[dtype])
    rows_per_chunk = max(1, CHUNK_ELEMENTS // (out.size // shape[0]))
    fill = _filler(name)

    def fill_chunk(chunk: int) -> None:
        rng = np.random.default_rng([seed, index, chunk])
        fill(rng, out[chunk * rows_per_chunk : (chunk + 1) * rows_per_chunk])

    list(pool.map(fill_chunk, range(-(-shape[0] // rows_per_chunk))))
    return out


def write_random_model(
    path: str | os.PathLike,
    config: ModelConfig,
    seed: int = 0,
    tokenizer_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> Path:
    """Write a valid .nanoqwen file of `config`'s shapes with random weights; returns its path.

    `tokenizer_dir`, when given, must hold tokenizer.json and tokenizer_config.json, which are
    stored as the file's tokenizer blobs (as the converter does), with chat_template.jinja and
    generation_config.json where it has them. They are stored unchecked, so that tests can make
    files with broken tokenizers; the command line checks them first, as the converter does.
    """
    one, two = (len(dataclasses.replace(config, num_layers=n).tensor_specs()) for n in (1, 2))
    tensors = one + (config.num_layers - 1) * (two - one)  # counted before a huge spec list is built to refuse it
    if tensors > MAX_TENSORS:
        raise ValueError(f"{config.num_layers:,} layers make {tensors:,} tensors, more than the {MAX_TENSORS:,} "
                         "a .nanoqwen file may hold")
    entries = [(name, dtype, shape) for name, (dtype, shape) in config.tensor_specs().items()]
    blobs = {}
    if tokenizer_dir is not None:
        required = (TOKENIZER_JSON, TOKENIZER_CONFIG_JSON)
        for file_name in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / file_name
            if not source.exists():
                if file_name in required:
                    raise FileNotFoundError(f"{source}: tokenizer_dir must hold {' and '.join(required)}")
                continue
            blobs[TOKENIZER_PREFIX + file_name] = np.frombuffer(source.read_bytes(), np.uint8)
    entries += [(name, "u8", blob.shape) for name, blob in blobs.items()]

    total = sum(int(np.prod(shape)) * (4 if dtype == "u32" else 2) for _, dtype, shape in entries if dtype != "u8")
    with NanoqwenWriter(path, config, entries) as writer, ThreadPoolExecutor(os.cpu_count()) as pool:
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"write {writer.path.name}", disable=not progress) as bar:
            for index, (name, dtype, shape) in enumerate(entries):
                if dtype == "u8":
                    continue
                tensor = random_tensor(name, dtype, shape, seed, index, pool)
                writer.write(name, tensor)
                bar.update(tensor.nbytes)
                del tensor
        for name, blob in blobs.items():
            writer.write(name, blob)
        return writer.close()


def main(argv=None) -> None:
    from .cli import ascii_int

    parser = argparse.ArgumentParser(prog="python -m nanoqwen.random_model",
                                     description="Write a .nanoqwen file with random weights.")
    parser.add_argument("out", help="path of the .nanoqwen file to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-coder-7b",
                        help="the published shape to copy (default: the 7B, a 5.5 GB file)")
    parser.add_argument("--layers", type=ascii_int, default=None, metavar="N",
                        help="keep the preset's widths but only N layers (a reference that must fit in memory)")
    parser.add_argument("--seed", type=ascii_int, default=0)
    parser.add_argument("--tokenizer-dir", help="directory with tokenizer.json and tokenizer_config.json")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be a non-negative integer, got {args.seed}")
    try:
        config = PRESETS[args.preset]
        if args.layers is not None:
            config = dataclasses.replace(config, num_layers=args.layers)
        if args.tokenizer_dir is not None:
            read_tokenizer(Path(args.tokenizer_dir), config.vocab_size)  # a tokenizer the engine can run
        out = write_random_model(args.out, config, args.seed, args.tokenizer_dir, progress=True)
    except (ConfigError, CheckpointError, OSError, ValueError) as e:  # bad --layers or tokenizer, no folder, full disk
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:  # the writer has removed its temporary file
        parser.exit(130, "\n")
    print(f"{out}: {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
