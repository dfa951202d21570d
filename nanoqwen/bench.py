"""`nanoqwen bench`: the article's protocol (a 512-token prompt, 128 greedy tokens) on the GPU.

It reports time to first token, decode ms/token and tokens/s, the bytes one decoded token must
read (the byte floor) with the achieved GB/s and the share of the floor, eager against graph
decode, the graph with programmatic dependent launch against without (`step.pdl`), and where
the microseconds of one step go, kernel by kernel. It also times sampled decoding
(`sampled_decode`): temperature, top-k (with top-p or not) and top-p alone draw on the device,
except the steps of a top-p alone whose run is longer than the 1,024 tokens the device keeps,
which the host draws from the step's logits. With `--baseline` it
times transformers' Qwen2ForCausalLM (bf16, random weights, the same shapes) in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from .cli import subcommand
from .config import ModelConfig
from .errors import BackendUnavailableError
from .sampling import GREEDY

READ_BANDWIDTH = 4.49e12  # bytes/s: a read-only streaming kernel on the H200 (shared/notes)
# Sampled decoding, timed beside the greedy protocol: temperature and top-k (with top-p or not) are
# drawn in the decode graph; so is a top-p alone, but for the steps whose run is longer than the
# device keeps, which the host draws (nanoqwen.cuda.backend.may_hand_back).
SAMPLED_SETTINGS = {
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top-k 40": dict(temperature=0.7, top_k=40),
    "temperature 0.7, top-k 40, top-p 0.95": dict(temperature=0.7, top_k=40, top_p=0.95),
    "temperature 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95),
}


def bytes_per_token(config: ModelConfig, context: int) -> dict[str, int]:
    """Bytes one decode step must read at `context` cached positions, by kind."""
    c, g = config, config.group_size
    linear_params = c.num_layers * (
        c.hidden_size * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    return {
        "int4 weights": linear_params // 2,
        "fp16 scales": linear_params // g * 2,
        "fp16 lm_head": c.vocab_size * c.hidden_size * 2,
        "kv cache": 2 * c.num_layers * c.kv_dim * 2 * context,
        "embedding row, biases, norms": 2 * (c.hidden_size + c.num_layers * (c.q_dim + 2 * c.kv_dim + 2 * c.hidden_size) + c.hidden_size),
    }


def int4_bytes(out_features: int, in_features: int, group_size: int) -> int:
    """Packed nibbles plus one fp16 scale per group."""
    return out_features * in_features // 2 + out_features * in_features // group_size * 2


def kernel_bytes(config: ModelConfig, context: int, rope_in_qkv: bool = True) -> dict[str, int]:
    """The byte floor of one decode step (`bytes_per_token`), by the kernel that reads each byte:
    the step's kernels with RoPE in the q|k|v GEMV (the fp16 engine's default), or, not
    `rope_in_qkv`, with the plain GEMV and rope_write_kv (CudaBackend.rope_in_qkv)."""
    L, H, I, g = config.num_layers, config.hidden_size, config.intermediate_size, config.group_size
    qkv = config.q_dim + 2 * config.kv_dim
    qkv_bytes = L * (int4_bytes(qkv, H, g) + 2 * qkv)  # + q, k, v biases
    return {
        "embed_tokens": 2 * H,  # one row of the embedding
        "add_rmsnorm_cluster": (2 * L + 1) * 2 * H,  # a norm weight each: 2 per layer + the final norm
        **({"gemv_int4_qkv_rope": qkv_bytes} if rope_in_qkv else {"gemv_int4_from_hidden": qkv_bytes, "rope_write_kv": 0}),
        "attention_decode": L * 2 * config.kv_dim * 2 * context,  # K and V of every cached position
        "gemv_int4_from_q_dim": L * int4_bytes(H, config.q_dim, g),
        "gemv_int4_gate_up_silu": L * int4_bytes(2 * I, H, g),
        "gemv_int4_from_intermediate": L * int4_bytes(H, I, g),
        "lm_head_logits": config.vocab_size * H * 2,
        "argmax_select_next": 0,
    }


def _median_ms(samples) -> float:
    return statistics.median(samples) * 1e3


def time_decode_steps(backend, step, steps: int, start_position: int, page_table) -> float:
    """Median ms of `steps` replays of `step()` (each one decode step), GPU-timed per step."""
    import cupy as cp

    backend.set_step_inputs(1, start_position, page_table)
    stream = backend.stream
    times = []
    for _ in range(steps):
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record(stream)
        step()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(begin, end) / 1e3)
    return _median_ms(times)


def time_host_loop(backend, step, steps: int, start_position: int, page_table) -> float:
    """Wall-clock ms per step of `steps` steps issued back to back (what a user waits)."""
    backend.set_step_inputs(1, start_position, page_table)
    backend.stream.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    backend.stream.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def kernel_table(timeline) -> list[dict]:
    per_kernel = defaultdict(lambda: [0, 0.0])
    for name, start, end in timeline:
        per_kernel[name][0] += 1
        per_kernel[name][1] += end - start
    total = sum(t for _, t in per_kernel.values())
    return [
        {"kernel": name, "launches": n, "us": round(t, 1), "us_per_launch": round(t / n, 2), "share": round(t / total, 4)}
        for name, (n, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    ]


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


TIMING_STEPS = 64  # decode steps each step-level timing runs past the prompt
STEP_PROMPT_TOKENS = 512  # the protocol's prompt: the context every step-level timing starts from
PDL_ROUNDS = 3  # alternations of the PDL and plain graphs; each figure is the median over rounds


def prompted_backend(model, prompt_tokens: int = STEP_PROMPT_TOKENS):
    """A CudaBackend of `model` holding a random prompt of `prompt_tokens` tokens, with pages for
    TIMING_STEPS decode steps after it: where the step-level tools (tools/sweep_gemv_stages.py,
    tools/step_ablation.py) start. Prefill dequantizes per prompt, so no fp16 copies take memory.
    Returns (backend, page_table)."""
    from .cuda.backend import CudaBackend
    from .kvcache import pages_needed

    pages = pages_needed(prompt_tokens + TIMING_STEPS + 1)
    backend = CudaBackend(model, num_pages=pages, prefill_weights="expand")
    page_table = np.arange(pages, dtype=np.int32)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, prompt_tokens).astype(np.int32)
    backend.prefill(prompt, 0, page_table)
    return backend, page_table


def step_launch_names(backend) -> list[str]:
    """The kernel of every launch of one decode step of a CudaBackend, in launch order, the
    attention object's two kernels included; nothing is launched."""
    names = []
    kept = dict(backend.kernels)
    attention = backend.attention
    kept_attention = (attention._decode, attention._combine)

    def recorder(name):
        return lambda *args, **kwargs: names.append(name)

    try:
        for name in kept:
            backend.kernels[name] = recorder(name)
        attention._decode, attention._combine = recorder(attention.decode_kernel), recorder("paged_attention_combine")
        backend.decode_step_launches(backend.stream)
    finally:
        backend.kernels.update(kept)
        attention._decode, attention._combine = kept_attention
    return names


def step_timing_record(tool: str, argv: list[str], rows: list[dict]) -> dict:
    """A step-level tool's rows with where and when they were measured (UTC date and minute, the
    GPU's name, the command) and the protocol they start from, ready for results/."""
    import cupy as cp

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
        "command": " ".join([tool, *argv]),
        "prompt_tokens": STEP_PROMPT_TOKENS,
        "steps_per_timing": TIMING_STEPS,
        "rows": rows,
    }


def report_step_timings(tool: str, argv: list[str], rows: list[dict], header: list[str], cells: list[list],
                        json_path=None) -> None:
    """Print a step-level tool's results as a Markdown table (`cells`, one list per row, under
    `header`) and, given `json_path`, write `rows` there as a step_timing_record."""
    from .book.notebook import markdown_table

    print(markdown_table(header, cells))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(step_timing_record(tool, argv, rows), indent=1))


def pdl_comparison(backend, start_position: int, page_table, rounds: int = PDL_ROUNDS) -> dict:
    """The decode step captured twice, with programmatic dependent launch and without, timed in
    alternation in the same run: GPU events per step and a host loop per token for each."""
    from .cuda.graph import DecodeGraph
    from .cuda.launch import driver_module

    graphs = {"on": DecodeGraph(backend, pdl=True), "off": DecodeGraph(backend, pdl=False)}
    result = {"engine_graph": backend.decode_graph().mode, "pdl_graph": graphs["on"].mode}
    if not graphs["on"].pdl:
        return {**result, "measured": False, "reason": driver_module()[1]}
    gpu, wall = {"on": [], "off": []}, {"on": [], "off": []}
    for _ in range(rounds):
        for name in ("off", "on"):
            launch = graphs[name].launch
            gpu[name].append(time_decode_steps(backend, launch, TIMING_STEPS, start_position, page_table))
            wall[name].append(time_host_loop(backend, launch, TIMING_STEPS, start_position, page_table))
    result.update(measured=True, rounds=rounds)
    for name in ("on", "off"):
        result[f"graph_ms_per_step_gpu_{name}"] = statistics.median(gpu[name])
        result[f"graph_ms_per_token_wall_{name}"] = statistics.median(wall[name])
    result["saving_us_per_step_gpu"] = (result["graph_ms_per_step_gpu_off"] - result["graph_ms_per_step_gpu_on"]) * 1e3
    return result


def run_bench(model_path, prompt_tokens: int = 512, new_tokens: int = 128, repeats: int = 3,
              baseline: bool = False, seed: int = 0, activations: str = "fp16", command: str | None = None,
              prefill_weights: str = "auto") -> dict:
    """Measure `model_path` on the GPU (see the module docstring); returns the report dict."""
    from .engine import Engine, cuda_available
    from .kvcache import pages_needed
    from .loader import load

    if not cuda_available():
        raise BackendUnavailableError("nanoqwen bench measures the CUDA backend: it needs CuPy and a Hopper GPU")
    import cupy as cp

    model = load(model_path)
    config = model.config
    context = prompt_tokens + max(new_tokens, TIMING_STEPS + 1)
    if context > config.max_position_embeddings:
        model.close()
        raise ValueError(
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
        "protocol": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "greedy": True, "repeats": repeats,
                     "activations": activations},
    }
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, prompt_tokens).tolist()
    engine = None
    try:
        engine = Engine(model, backend="cuda", max_context=context, activations=activations,
                        prefill_weights=prefill_weights)
        report["protocol"]["prefill_weights"] = engine.backend.prefill_weights
        report["end_to_end"] = _end_to_end(engine, ids, new_tokens, repeats)
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


def _end_to_end(engine, ids: list[int], new_tokens: int, repeats: int) -> dict:
    """The user's view: engine.generate, timed by the engine itself."""
    engine.generate(ids[:32], max_new_tokens=8, stop_token_ids=[])  # compile, upload, capture
    runs = [engine.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[]) for _ in range(repeats)]
    decode_ms = 1e3 / statistics.median(r.decode_tokens_per_second for r in runs)
    floor = bytes_per_token(engine.config, len(ids) + new_tokens // 2)  # the run's mean context
    floor_bytes = sum(floor.values())
    return {
        "time_to_first_token_ms": statistics.median(r.prefill_seconds for r in runs) * 1e3,
        "decode_ms_per_token": decode_ms,
        "decode_tokens_per_s": 1e3 / decode_ms,
        "byte_floor_context": len(ids) + new_tokens // 2,
        "byte_floor_per_token": floor,
        "byte_floor_total": floor_bytes,
        "achieved_GB_per_s": floor_bytes / decode_ms / 1e6,
        "floor_ms_at_read_bandwidth": floor_bytes / READ_BANDWIDTH * 1e3,
        "share_of_floor": floor_bytes / READ_BANDWIDTH * 1e3 / decode_ms,
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
    from .cuda.graph import step_timeline

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
        timeline, empty_us = step_timeline(backend)
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
        f"| byte floor per token | {e['byte_floor_total'] / 1e9:.3f} GB -> {e['floor_ms_at_read_bandwidth']:.3f} ms at 4.49 TB/s |",
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
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true", help="also time transformers on the same shapes (needs torch)")
    p.add_argument("--activations", choices=("fp16", "int8"), default="fp16", help="decode projections' input precision")
    p.add_argument("--prefill-weights", choices=("auto", "cache", "expand"), default="auto",
                   help="prefill's fp16 matrices: kept (cache), dequantized per prompt (expand), or kept if they fit (auto)")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")


@subcommand("bench", "time prefill and decode on the GPU (512-token prompt, 128 greedy tokens)", _arguments)
def main(args: argparse.Namespace) -> int:
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        print("nanoqwen bench: needs --prompt-tokens >= 1, --new-tokens >= 2 and --repeats >= 1", file=sys.stderr)
        return 2
    report = run_bench(args.model, args.prompt_tokens, args.new_tokens, args.repeats, args.baseline, args.seed,
                       args.activations, command=" ".join(["nanoqwen"] + sys.argv[1:]),
                       prefill_weights=args.prefill_weights)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
