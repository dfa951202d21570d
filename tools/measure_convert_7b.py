"""Measure the converter at full size: peak memory, wall time and output size for a 7B checkpoint.

Qwen2.5-Coder-7B-Instruct cannot be downloaded on a test machine, but the converter's memory
depends only on tensor names, shapes, dtypes and sharding, not on the values. So this script

1. writes a bfloat16 safetensors checkpoint with exactly the 7B's tensors (~15 GB), sharded
   with a `model.safetensors.index.json` like the published one, streaming from a pool of
   random bf16 values (no torch, memory stays ~100 MB);
2. runs `nanoqwen.convert.convert` in a child process that does nothing else, and reads the
   child's peak resident set (`ru_maxrss`) before and after the conversion;
3. loads the output with `nanoqwen.load(..., verify_checksums=True)`, prints a Markdown table,
   and deletes the checkpoint and the output (unless --keep). It refuses a --workdir that
   already holds either, so it deletes only what it wrote.

    python tools/measure_convert_7b.py --workdir /tmp/convert7b
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHARD_BYTES = 4 * 10**9  # the published checkpoint ships four shards of ~4 GB
POOL_ELEMENTS = 1 << 24  # distinct random bf16 values the checkpoint is cut from


def hf_config(config) -> dict:
    """The config.json of a Qwen2 checkpoint with `config`'s dimensions."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


def hf_tensors(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the Hugging Face checkpoint: the .nanoqwen specs with each
    (.qweight, .scales) pair turned back into the [out, in] `.weight` it is quantized from."""
    tensors = []
    for name, (_, shape) in config.tensor_specs().items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            name, shape = name[: -len(".qweight")] + ".weight", (shape[0], shape[1] * 8)
        tensors.append((name, shape))
    return tensors


def write_checkpoint(directory: Path, config, seed: int = 0) -> int:
    """Write config.json, the shards and the index; returns the checkpoint's size in bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(config), indent=2))
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(POOL_ELEMENTS, dtype=np.float32) * 0.02
    bf16 = (normal.view(np.uint32) >> 16).astype(np.uint16)  # truncate float32 to bfloat16
    pool = np.concatenate([bf16, bf16])  # any window of POOL_ELEMENTS starting in the first half

    shards, current, current_bytes = [], [], 0
    for name, shape in hf_tensors(config):
        nbytes = 2 * int(np.prod(shape))
        if current and current_bytes + nbytes > SHARD_BYTES:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((name, shape))
        current_bytes += nbytes
    shards.append(current)

    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file_name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            nbytes = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file_name
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)  # safetensors pads the header to 8 bytes with spaces
        with open(directory / file_name, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little"))
            f.write(encoded)
            for name, shape in shard:
                left = int(np.prod(shape))
                while left:
                    n = min(left, POOL_ELEMENTS)
                    start = int(rng.integers(POOL_ELEMENTS))
                    f.write(memoryview(pool[start : start + n]).cast("B"))
                    left -= n
        total += (directory / file_name).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident set. Linux's VmHWM belongs to the current address space,
    which exec replaces; ru_maxrss would also count the parent's peak inherited across fork+exec."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def convert_only(source: str, out: str) -> None:
    """Child process: import, convert, report its own peak RSS as one JSON line."""
    import nanoqwen
    from nanoqwen.convert import convert

    after_import = peak_rss_bytes()
    start = time.perf_counter()
    summary = convert(source, out, progress=False)
    summary["convert_s"] = time.perf_counter() - start
    summary["after_import_rss_bytes"] = after_import
    summary["peak_rss_bytes"] = peak_rss_bytes()
    summary["nanoqwen"] = str(Path(nanoqwen.__file__).parent)
    print(json.dumps(summary))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/convert7b"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the .nanoqwen file")
    parser.add_argument("--convert-only", nargs=2, metavar=("SOURCE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.convert_only:
        convert_only(*args.convert_only)
        return

    import nanoqwen
    from nanoqwen.format import termination_raises_system_exit
    from nanoqwen.random_model import QWEN25_CODER_7B

    checkpoint, out = args.workdir / "checkpoint", args.workdir / "qwen2.5-coder-7b-random.nanoqwen"
    # The run deletes the checkpoint and the output when it ends, so both must be its own.
    existing = [path for path in (checkpoint, out) if path.exists() or path.is_symlink()]
    if args.workdir.exists() and not args.workdir.is_dir():
        problem = f"--workdir {args.workdir} is not a folder"
    elif existing:
        problem = f"{existing[0]} already exists; remove it or choose another --workdir"
    else:
        try:
            args.workdir.mkdir(parents=True, exist_ok=True)
            problem = None
        except OSError as e:
            problem = f"cannot make --workdir {args.workdir}: {e.strerror}"
    if problem:
        print(f"measure_convert_7b: {problem}", file=sys.stderr)
        raise SystemExit(2)
    # SIGTERM (what `timeout` sends) ends the run through `finally`, which removes the 15 GB checkpoint
    child = None
    with termination_raises_system_exit():
        try:
            start = time.perf_counter()
            checkpoint_bytes = write_checkpoint(checkpoint, QWEN25_CODER_7B)
            write_s = time.perf_counter() - start
            print(f"wrote {checkpoint_bytes:,} bytes of checkpoint in {write_s:.0f} s", flush=True)

            start = time.perf_counter()
            child = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--convert-only", str(checkpoint), str(out)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            stdout, stderr = child.communicate()
            if child.returncode:
                sys.exit(f"conversion failed ({child.returncode}):\n{stderr}")
            child_s = time.perf_counter() - start
            summary = json.loads(stdout.strip().splitlines()[-1])

            start = time.perf_counter()
            model = nanoqwen.load(out, verify_checksums=True)
            verify_s = time.perf_counter() - start
            assert model.config == QWEN25_CODER_7B

            largest = max(int(np.prod(shape)) for _, shape in hf_tensors(QWEN25_CODER_7B))
            rows = [
                ("nanoqwen package measured", summary["nanoqwen"]),
                ("checkpoint (bf16 safetensors)", f"{checkpoint_bytes:,} bytes in {len(list(checkpoint.glob('*.safetensors')))} shards"),
                ("parameters converted", f"{summary['parameters']:,}"),
                ("output .nanoqwen", f"{summary['bytes']:,} bytes"),
                ("convert() wall time", f"{summary['convert_s']:.1f} s (child process total {child_s:.1f} s)"),
                ("peak RSS after imports", f"{summary['after_import_rss_bytes'] / 2**30:.2f} GiB"),
                ("peak RSS of the converting child", f"{summary['peak_rss_bytes'] / 2**30:.2f} GiB ({summary['peak_rss_bytes']:,} bytes)"),
                ("largest tensor as float32 + its fp16 copy", f"{6 * largest / 2**30:.2f} GiB"),
                ("load + verify_checksums", f"{verify_s:.1f} s"),
            ]
            print("| quantity | value |\n| --- | --- |")
            for label, value in rows:
                print(f"| {label} | {value} |")
        finally:
            if child is not None and child.poll() is None:  # SIGTERM lets its writer remove its partial file
                child.terminate()
                child.wait()
            if not args.keep:
                shutil.rmtree(checkpoint, ignore_errors=True)
                out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
