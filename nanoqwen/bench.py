"""`nanoqwen bench`: the article's protocol (a 512-token prompt, 128 greedy tokens) on the GPU.

It reports time to first token, decode ms/token and tokens/s, the bytes one decoded token must
read (the byte floor, over the read bandwidth it measures on the GPU first) with the achieved GB/s
and the share of the floor, eager against graph decode, the graph with programmatic dependent
launch against without (`step.pdl`), and where the microseconds of one step go, kernel by
kernel. It also times sampled decoding
(`sampled_decode`): temperature, top-k (with top-p or not) and top-p alone draw on the device,
except the steps of a top-p alone whose run is longer than the 1,024 tokens the device keeps,
which the host draws from the step's logits. With `--baseline` it
times transformers' Qwen2ForCausalLM (bf16, random weights, the same shapes) in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .byte_floor import bytes_per_token
from .cli import ascii_int, subcommand
from .config import ModelConfig
from .cuda.profile import (
    TIMING_STEPS,
    kernel_table,
    launch_timeline,
    pdl_comparison,
    time_decode_steps,
    time_host_loop,
)
from .errors import BackendUnavailableError, GenerationError
from .format import output_file_problem
from .sampling import GREEDY, MAX_SEED

# Sampled decoding, timed beside the greedy protocol: temperature and top-k (with top-p or not) are
# drawn in the decode graph; so is a top-p alone, but for the steps whose run is longer than the
# device keeps, which the host draws (nanoqwen.cuda.sampler.may_hand_back).
SAMPLED_SETTINGS = {
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top-k 40": dict(temperature=0.7, top_k=40),
    "temperature 0.7, top-k 40, top-p 0.95": dict(temperature=0.7, top_k=40, top_p=0.95),
    "temperature 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95),
    # above the 1,024 the device keeps: every step's logits go to the host, which draws
    "temperature 0.7, top-k 2000 (drawn on the host)": dict(temperature=0.7, top_k=2000),
}


def transformers_baseline(config: ModelConfig, prompt_tokens: int, new_tokens: int, seed: int) -> dict:
    """transformers' Qwen2ForCausalLM, bf16 random weights on the GPU: prefill and decode timing."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf_config = Qwen2Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: no 30 GB fp32 detour
    try:
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    ids = torch.randint(0, config.vocab_size, (1, prompt_tokens), device="cuda")
    with torch.inference_mode():
        model(ids[:, :16])
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return {
        "engine": f"transformers {__import__('transformers').__version__} Qwen2ForCausalLM, bf16, eager generate",
        "prefill_ms": prefill * 1e3,
        "decode_ms_per_token": (total - prefill) / (new_tokens - 1) * 1e3,
    }


def run_bench(model_path, prompt_tokens: int = 512, new_tokens: int = 128, repeats: int = 3,
              baseline: bool = False, seed: int = 0, activations: str = "fp16", command: str | None = None,
              prefill_weights: str = "auto") -> dict:
    """Measure `model_path` on the GPU (see the module docstring); returns the report dict."""
    from .backends import cuda_available
    from .engine import Engine
    from .kvcache import pages_needed
    from .loader import load

    if not cuda_available():
        raise BackendUnavailableError("nanoqwen bench measures the CUDA backend: it needs CuPy and a Hopper GPU")
    import cupy as cp

    from .cuda.timing import read_bandwidth

    model = load(model_path)
    config = model.config
    context = prompt_tokens + max(new_tokens, TIMING_STEPS + 1)
    if context > config.max_position_embeddings:
        model.close()
        raise GenerationError(
            f"the protocol needs {context} positions (prompt {prompt_tokens} + {max(new_tokens, TIMING_STEPS + 1)}); "
            f"the model allows {config.max_position_embeddings}"
        )
    report = {
        "date": datetime.date.today().isoformat(),
        "gpu": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
        "command": command,
        "versions": {"python": platform.python_version(), "cupy": cp.__version__, "numpy": np.__version__},
        "model": str(model_path),
        "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
        "read_bandwidth_bytes_per_s": read_bandwidth(),  # this GPU's: the floor divides by it
        "protocol": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "greedy": True, "repeats": repeats,
                     "activations": activations},
    }
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, prompt_tokens).tolist()
    engine = None
    try:
        engine = Engine(model, backend="cuda", max_context=context, activations=activations,
                        prefill_weights=prefill_weights)
        report["protocol"]["prefill_weights"] = engine.backend.prefill_weights
        report["end_to_end"] = _end_to_end(engine, ids, new_tokens, repeats, report["read_bandwidth_bytes_per_s"])
        report["sampled_decode"] = _sampled_decode(engine, ids, new_tokens, repeats, seed)
        report["step"], report["timeline"] = _step_costs(engine, ids, pages_needed(prompt_tokens + TIMING_STEPS + 1))
    finally:
        if engine is not None:
            engine.close()
        model.close()
    if baseline:
        try:
            report["baseline"] = transformers_baseline(config, prompt_tokens, new_tokens, seed)
        except Exception as e:  # the baseline is optional: report why it did not run
            report["baseline"] = {"engine": "transformers", "error": f"{type(e).__name__}: {e}"}
    return report


def _end_to_end(engine, ids: list[int], new_tokens: int, repeats: int, bandwidth: float) -> dict:
    """The user's view: engine.generate, timed by the engine itself; the floor at `bandwidth` bytes/s."""
    engine.generate(ids[:32], max_new_tokens=8, stop_token_ids=[])  # compile, upload, capture
    runs = [engine.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[]) for _ in range(repeats)]
    decode_ms = 1e3 / statistics.median(r.decode_tokens_per_second for r in runs)
    floor = bytes_per_token(engine.config, len(ids) + new_tokens // 2)  # the run's mean context
    floor_bytes = sum(floor.values())
    floor_ms = floor_bytes / bandwidth * 1e3
    return {
        "time_to_first_token_ms": statistics.median(r.prefill_seconds for r in runs) * 1e3,
        "decode_ms_per_token": decode_ms,
        "decode_tokens_per_s": 1e3 / decode_ms,
        "byte_floor_context": len(ids) + new_tokens // 2,
        "byte_floor_per_token": floor,
        "byte_floor_total": floor_bytes,
        "achieved_GB_per_s": floor_bytes / decode_ms / 1e6,
        "floor_ms_at_read_bandwidth": floor_ms,
        "share_of_floor": floor_ms / decode_ms,
        "greedy_tokens_identical_across_repeats": all(r.token_ids == runs[0].token_ids for r in runs),
    }


def _sampled_decode(engine, ids: list[int], new_tokens: int, repeats: int, seed: int) -> dict:
    """Decode ms/token of engine.generate under each of SAMPLED_SETTINGS (median of `repeats`), and
    how many of the decode steps' tokens the host drew (CudaBackend.host_draws)."""
    result = {}
    for label, settings in SAMPLED_SETTINGS.items():
        host_draws = engine.backend.host_draws
        runs = [engine.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[], seed=seed + r, **settings)
                for r in range(repeats)]
        result[label] = {"settings": settings,
                         "decode_ms_per_token": 1e3 / statistics.median(r.decode_tokens_per_second for r in runs),
                         "decode_steps": sum(len(r.token_ids) - 1 for r in runs),
                         "drawn_on_the_host": engine.backend.host_draws - host_draws}
    return result


def _step_costs(engine, ids: list[int], pages: int):
    """One decode step: eager launches against the captured graph, and per-kernel costs."""
    backend, prompt_tokens = engine.backend, len(ids)
    backend.set_sampler(GREEDY)  # the protocol's step, whatever an earlier request drew with
    page_table = engine.allocator.allocate(pages)
    try:
        backend.prefill(np.array(ids, dtype=np.int32), 0, page_table)
        eager = lambda: backend.decode_step_launches(backend.stream)  # noqa: E731
        graph = backend.decode_graph()
        step = {
            "launches_per_token": backend.launches_per_token,
            "eager_ms_per_token_wall": time_host_loop(backend, eager, TIMING_STEPS, prompt_tokens, page_table),
            "graph_ms_per_token_wall": time_host_loop(backend, graph.launch, TIMING_STEPS, prompt_tokens, page_table),
            "graph_ms_per_step_gpu": time_decode_steps(backend, graph.launch, TIMING_STEPS, prompt_tokens, page_table),
        }
        step["pdl"] = pdl_comparison(backend, prompt_tokens, page_table)
        backend.set_step_inputs(1, prompt_tokens, page_table)
        timeline, empty_us = launch_timeline(backend)
    finally:
        backend.forget_step_inputs()  # the timings advanced the device state behind the engine's back
        engine.allocator.free(page_table)
    attributed_us = timeline[-1][2]
    step.update(
        attributed_us=attributed_us,
        unattributed_us=step["graph_ms_per_step_gpu"] * 1e3 - attributed_us,
        empty_kernel_us_per_launch=empty_us,
        kernels=kernel_table(timeline),
    )
    return step, [(n, round(s, 2), round(e, 2)) for n, s, e in timeline]


def pdl_line(pdl: dict | None) -> str:
    """The PDL on/off figure as one table cell."""
    if pdl is None:
        return "not measured (a report from before the comparison existed)"
    if not pdl["measured"]:
        return f"not measured: {pdl['reason']}"
    return (f"{pdl['graph_ms_per_step_gpu_on']:.3f} ms on, {pdl['graph_ms_per_step_gpu_off']:.3f} ms off per step "
            f"(GPU events): {pdl['saving_us_per_step_gpu']:+.1f} us saved; engine graph {pdl['engine_graph']}")


def format_report(report: dict) -> str:
    e, s = report["end_to_end"], report.get("step", {})
    bandwidth = e["byte_floor_total"] / (e["floor_ms_at_read_bandwidth"] / 1e3)  # what the floor divided by
    lines = [
        f"nanoqwen bench  {report['date']}  {report['gpu']}",
        f"model {report['model']}  prompt {report['protocol']['prompt_tokens']}  new {report['protocol']['new_tokens']} "
        f"(greedy, {report['protocol']['activations']} activations)",
        "",
        "| metric | value |",
        "| --- | ---: |",
        f"| time to first token | {e['time_to_first_token_ms']:.2f} ms "
        f"(prefill weights: {report['protocol'].get('prefill_weights', 'expand')}) |",
        f"| decode | {e['decode_ms_per_token']:.3f} ms/token ({e['decode_tokens_per_s']:.1f} tokens/s) |",
        f"| byte floor per token | {e['byte_floor_total'] / 1e9:.3f} GB -> {e['floor_ms_at_read_bandwidth']:.3f} ms at {bandwidth / 1e12:.2f} TB/s |",
        f"| achieved | {e['achieved_GB_per_s']:.0f} GB/s, {100 * e['share_of_floor']:.1f}% of the floor |",
    ]
    lines += [f"| decode, sampled ({label}) | {row['decode_ms_per_token']:.3f} ms/token"
              + (f" ({row['drawn_on_the_host']} of {row['decode_steps']} steps drawn on the host)"
                 if row.get("drawn_on_the_host") else "") + " |"
              for label, row in report.get("sampled_decode", {}).items()]
    if s:
        lines += [
            f"| launches per token | {s['launches_per_token']} |",
            f"| eager step (wall) | {s['eager_ms_per_token_wall']:.3f} ms |",
            f"| graph step (wall) | {s['graph_ms_per_token_wall']:.3f} ms |",
            f"| graph step (GPU events) | {s['graph_ms_per_step_gpu']:.3f} ms |",
            f"| programmatic dependent launch | {pdl_line(s.get('pdl'))} |",
            f"| sum of per-kernel in-graph costs | {s['attributed_us']:.1f} us ({s['unattributed_us']:+.1f} us unattributed) |",
            f"| empty kernel in a graph (gap floor) | {s['empty_kernel_us_per_launch']:.2f} us per launch |",
            "",
            "| kernel | launches | us per step | us per launch | share |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [f"| {k['kernel']} | {k['launches']} | {k['us']:.1f} | {k['us_per_launch']:.2f} | {100 * k['share']:.1f}% |" for k in s["kernels"]]
    if "baseline" in report:
        b = report["baseline"]
        if "error" in b:
            lines += ["", f"baseline: {b['engine']} failed: {b['error']}"]
        else:
            lines += ["", f"baseline: {b['engine']}: prefill {b['prefill_ms']:.1f} ms, decode {b['decode_ms_per_token']:.2f} ms/token"]
    return "\n".join(lines)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a .nanoqwen file (the 7B: see `python -m nanoqwen.random_model`)")
    p.add_argument("--prompt-tokens", type=ascii_int, default=512)
    p.add_argument("--new-tokens", type=ascii_int, default=128)
    p.add_argument("--repeats", type=ascii_int, default=3)
    p.add_argument("--seed", type=ascii_int, default=0)
    p.add_argument("--baseline", action="store_true", help="also time transformers on the same shapes (needs torch)")
    p.add_argument("--activations", choices=("fp16", "int8"), default="fp16", help="decode projections' input precision")
    p.add_argument("--prefill-weights", choices=("auto", "cache", "expand"), default="auto",
                   help="prefill's fp16 matrices: kept (cache), dequantized per prompt (expand), or kept if they fit (auto)")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")


@subcommand("bench", "time prefill and decode on the GPU (512-token prompt, 128 greedy tokens)", _arguments)
def main(args: argparse.Namespace) -> int:
    if (args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1 or args.seed < 0
            or args.seed + args.repeats > MAX_SEED):  # the sampled runs take seeds seed .. seed + repeats - 1
        print("nanoqwen bench: needs --prompt-tokens >= 1, --new-tokens >= 2, --repeats >= 1 and --seed >= 0, "
              "with --seed + --repeats at most 2**64", file=sys.stderr)
        return 2
    json_path = None if args.json is None else Path(args.json)
    problem = None if json_path is None else output_file_problem(args.json)
    if problem is not None:
        print(f"nanoqwen bench: --json: {problem}", file=sys.stderr)
        return 2  # before minutes of measuring, not after
    report = run_bench(args.model, args.prompt_tokens, args.new_tokens, args.repeats, args.baseline, args.seed,
                       args.activations, command=" ".join(["nanoqwen"] + sys.argv[1:]),
                       prefill_weights=args.prefill_weights)
    print(format_report(report))
    if json_path is not None:  # whole or not at all: written beside it, then renamed over it
        partial = json_path.with_name(f".{json_path.name}.partial")
        partial.write_text(json.dumps(report, indent=1))
        os.replace(partial, json_path)
    return 0
