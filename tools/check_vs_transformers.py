"""The nanoqwen engine against transformers' Qwen2ForCausalLM, at any model's shapes.

    export PYTHONUNBUFFERED=1
    python -m nanoqwen.random_model /tmp/qwen7b.nanoqwen --preset qwen2.5-coder-7b
    python3 tools/check_vs_transformers.py --model /tmp/qwen7b.nanoqwen --steps 32 \
        --json "$OUT/check_7b.json"
    # on a CPU, with a small model: --backend numpy --device cpu

Both sides hold the same weights: transformers gets nanoqwen's INT4 projections dequantized
(on `--device`, with torch) and its fp16 tensors upcast, and computes in fp32. So every
difference comes from the engine's own numerics (fp16 activations, fp16 K/V), not from
quantization.

1. transformers runs a seeded random prompt (45 tokens: two full KV pages and a partly filled
   third), then `--steps` greedy decode steps through its KV cache (use_cache=True and a
   DynamicCache). Its logits at every step and its greedy tokens are kept; then it is freed.
2. The engine's backend (`--backend`) prefills the same prompt and decodes the same tokens,
   teacher-forced (each step gets transformers' token, so one near-tie cannot derail the rest),
   into a page table shuffled over the pool (4096 positions, as the engine's default), whose
   every row is first poisoned with NaN, so a read of a row no token wrote shows up.
3. `Engine.generate` (the path users run: on CUDA, `decode_next`'s device-side argmax) must
   pick the tokens the engine's own teacher-forced logits pick, for as long as its inputs
   are the same ones: up to and including the first step where the engine and transformers
   choose differently.

Tolerance per step: ROUNDING_TOLERANCE_FACTOR (12) times the rms of what first-order fp16
rounding noise, injected into the reference where the engine rounds, does to that step's logits
(`nanoqwen.testing.rounding_noise`: the reference runs a second time, teacher-forced, with the
noise; for the CUDA backend also that of prefill's fp16 weights). The bound is measured on the
model, since the gains that carry a rounding to the logits depend on its weights. PASS needs
every step's largest logit error within it, the greedy tokens to agree at every step whose top-2
margin exceeds twice the tolerance (below that, two correct implementations may pick either: a
near-tie), `Engine.generate` to agree with the engine's own logits (point 3), and at least 32
decode steps.
A table per step is printed last, then PASS or FAIL; the exit code is 1 on FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

import nanoqwen
from nanoqwen.config import PAGE_SIZE
from nanoqwen.engine import DEFAULT_MAX_CONTEXT, Engine
from nanoqwen.backends import BACKENDS, cuda_unavailable_reason
from nanoqwen.errors import NanoqwenError
from nanoqwen.kvcache import pages_needed
from nanoqwen.quant import NIBBLE_OF_ELEMENT, ZERO_POINT, dequantize_int4
from nanoqwen.testing import ROUNDING_TOLERANCE_FACTOR, _hf_config, rounding_noise, rounding_tolerance
from record import output_path

MIN_DECODE_STEPS = 32
DEFAULT_PROMPT_TOKENS = 45  # pages 0, 1 full, page 2 holds 13 of 16 rows
# Below this fraction of rms(logits), the engine's own top two are tied as far as run-to-run
# differences in summation order go: generate may then pick either.
EXACT_TIE = 1e-4
SPARE_PAGES = 3  # at least this many pages the sequence does not own, so its table can be shuffled


@contextmanager
def phase(name: str, seconds: dict[str, float]):
    """Time one phase of the run into `seconds`, printing as it starts and ends."""
    print(f"[{name}] ...", flush=True)
    began = time.perf_counter()
    yield
    seconds[name] = time.perf_counter() - began
    print(f"[{name}] {seconds[name]:.2f} s", flush=True)


def _host_tensor(array: np.ndarray):
    """A torch view of a (read-only, memory-mapped) numpy array. Only ever read: the copy to
    the device, or an operation making a new tensor, comes right after."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(array))


def dequantize_int4_torch(qweight: np.ndarray, scales: np.ndarray, device):
    """`nanoqwen.quant.dequantize_int4` with torch on `device`: uint32 [out, in/8], fp16
    [out, in/group] -> fp32 [out, in]. The words travel as int32 (torch has no uint32 shift):
    an arithmetic shift smears the sign bit into the bits above, which the nibble mask drops."""
    import torch

    out_features, words = qweight.shape
    groups = scales.shape[1]
    packed = _host_tensor(qweight.view(np.int32)).to(device)
    shifts = torch.tensor([4 * n for n in NIBBLE_OF_ELEMENT], dtype=torch.int32, device=device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [out, in/8, 8]: element e of each word
    q = (nibbles - ZERO_POINT).to(torch.float32).reshape(out_features, groups, -1)
    scale = _host_tensor(scales).to(device).to(torch.float32)
    return (q * scale[..., None]).reshape(out_features, words * 8)


def hf_source(model, name: str, device):
    """The fp32 tensor on `device` that transformers' parameter `name` must hold."""
    if name.endswith(".weight") and f"{name[:-len('.weight')]}.qweight" in model.tensors:
        base = name[: -len(".weight")]
        return dequantize_int4_torch(model.tensors[f"{base}.qweight"], model.tensors[f"{base}.scales"], device)
    if name == "lm_head.weight":
        array = model.lm_head  # the embedding when tied
    elif name in model.tensors:
        array = model.tensors[name]
    else:
        raise KeyError(f"transformers' parameter {name!r} has no counterpart in {model.path}")
    return _host_tensor(array).to(device).float()


def hf_reference(model, device):
    """transformers' Qwen2ForCausalLM in fp32 on `device` with `model`'s weights (INT4 ones
    dequantized): `nanoqwen.testing.reference_model`, built where it runs. The module is made
    under `torch.device(device)`, so the 30 GB of a 7B never pass through the host, and its
    computed buffers (RoPE's inv_freq) are real, which a meta-device build would not give."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device(device):
        reference = Qwen2ForCausalLM(_hf_config(model.config)).to(torch.float32)
    used = set()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():  # a tied lm_head is listed once, as the embedding
            source = hf_source(model, name, device)
            if source.shape != parameter.shape:
                raise ValueError(f"{name}: nanoqwen gives {list(source.shape)}, transformers wants {list(parameter.shape)}")
            parameter.copy_(source)
            used.add(name)
            del source
    tied = reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    if tied != model.config.tie_word_embeddings:
        raise RuntimeError(f"transformers tied lm_head: {tied}; the file says tie_word_embeddings={model.config.tie_word_embeddings}")
    return reference.eval()


def check_dequantize(model, device) -> int:
    """Exact agreement of the torch dequantization with nanoqwen.quant on layer 0's k_proj
    (the real file's bits, on the device that builds the reference). Returns elements checked."""
    k = model.layer(0).k
    expected = dequantize_int4(k.qweight, k.scales)
    got = dequantize_int4_torch(k.qweight, k.scales, device).cpu().numpy()
    if not np.array_equal(got, expected):
        bad = np.argwhere(got != expected)[0]
        raise AssertionError(f"torch dequantization differs from nanoqwen.quant at k_proj{list(bad)}: "
                             f"{got[tuple(bad)]} vs {expected[tuple(bad)]}")
    return expected.size


def run_reference(reference, prompt: np.ndarray, steps: int, device, forced: list[int] | None = None
                  ) -> tuple[np.ndarray, list[int], float]:
    """Greedy (or, given `forced`, teacher-forced: step s is fed forced[s]): prefill, then `steps`
    cached decode steps. Returns logits [steps + 1, vocab] (row s: after the prompt and s
    generated tokens), the tokens fed, and the largest difference between the cached decode's
    last logits and one uncached forward over the whole sequence (the reference checking itself)."""
    import inspect

    import torch
    from transformers import DynamicCache

    # The forward argument was `past_key_values` up to transformers 5.2x, then `cache`. The
    # cache fills in place, so it never has to be read back from an output.
    keyword = "cache" if "cache" in inspect.signature(reference.forward).parameters else "past_key_values"
    cache = DynamicCache(config=reference.config)

    def last_logits(ids) -> np.ndarray:
        ids = torch.tensor(np.asarray(ids)[None], dtype=torch.long, device=device)
        return reference(input_ids=ids, use_cache=True, **{keyword: cache}).logits[0, -1].float().cpu().numpy()

    with torch.no_grad():
        rows = [last_logits(prompt)]
        tokens = [forced[0] if forced else int(np.argmax(rows[-1]))]
        for step in range(steps):
            rows.append(last_logits([tokens[-1]]))
            tokens.append(forced[step + 1] if forced else int(np.argmax(rows[-1])))
        if cache.get_seq_length() != len(prompt) + steps:
            raise RuntimeError(f"transformers' cache holds {cache.get_seq_length()} positions, "
                               f"{len(prompt) + steps} were fed: the decode steps did not use it")
        whole = torch.tensor(np.concatenate([prompt, tokens[:-1]])[None], dtype=torch.long, device=device)
        uncached = reference(input_ids=whole, use_cache=False).logits[0, -1].float().cpu().numpy()
    return np.stack(rows), tokens, float(np.abs(uncached - rows[-1]).max())


def poison_kv_pool(backend) -> None:
    """NaN in every cache row: one no token wrote, if read, turns the logits to NaN."""
    pool = backend.kv_pool
    pool.fill(np.nan)
    if not isinstance(pool, np.ndarray):  # a CuPy array: finish before the backend's own stream reads it
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


def run_engine(engine: Engine, prompt: np.ndarray, tokens: list[int], seed: int) -> tuple[np.ndarray, list[int]]:
    """Teacher-forced: prefill `prompt`, then decode tokens[0], tokens[1], ... at the positions
    after it. Returns logits [len(tokens), vocab] (prefill's last, then one per decode step)
    and the page table used: the sequence's pages, shuffled among all of the pool's."""
    every_page = engine.allocator.allocate(engine.allocator.num_pages)
    try:
        needed = pages_needed(len(prompt) + len(tokens) - 1)
        page_table = np.random.default_rng(seed).permutation(every_page)[:needed].astype(np.int32)
        rows = [np.array(engine.backend.prefill(prompt.astype(np.int32), 0, page_table), dtype=np.float32)]
        for step, token in enumerate(tokens[:-1]):
            rows.append(np.array(engine.backend.decode(token, len(prompt) + step, page_table), dtype=np.float32))
    finally:
        engine.allocator.free(every_page)
    return np.stack(rows), page_table.tolist()


def compare(expected: np.ndarray, perturbed: np.ndarray, got: np.ndarray, factor: float) -> list[dict]:
    """One record per step: logit errors, the tolerance, transformers' top-2 margin, agreement."""
    records = []
    for step, (want, noisy, have) in enumerate(zip(expected, perturbed, got)):
        error = np.abs(have.astype(np.float64) - want)
        tol = rounding_tolerance(want, noisy, factor)
        top2 = np.sort(want)[-2:]
        margin = float(top2[1] - top2[0])
        own_top2 = np.sort(have)[-2:]
        max_error = float(error.max()) if np.isfinite(error).all() else float("nan")
        records.append(dict(
            step=step,
            max_abs_error=max_error,
            rms_error=float(np.sqrt(np.mean(error**2))),
            reference_rms=float(np.sqrt(np.mean(np.square(want, dtype=np.float64)))),
            tolerance=float(tol),
            error_over_tolerance=max_error / tol,
            margin=margin,
            reference_token=int(np.argmax(want)),
            nanoqwen_token=int(np.argmax(have)),
            nanoqwen_margin=float(own_top2[1] - own_top2[0]),
            agree=bool(np.argmax(want) == np.argmax(have)),
            near_tie=bool(margin <= 2 * tol),  # two implementations within tol of the truth may pick either
        ))
    return records


def verdict(records: list[dict], steps: int, generated: list[int], reference_tokens: list[int],
            generate_error: str | None = None) -> tuple[list[str], dict]:
    """Failure reasons (empty: PASS) and the counts the report shows."""
    failures = []
    if steps < MIN_DECODE_STEPS:
        failures.append(f"only {steps} decode steps compared; at least {MIN_DECODE_STEPS} are required")
    not_finite = [r["step"] for r in records if not np.isfinite(r["max_abs_error"])]
    if not_finite:
        failures.append(f"NaN/Inf logits at steps {not_finite}: a kernel read a KV row no token wrote, or overflowed")
    over = [r["step"] for r in records if np.isfinite(r["max_abs_error"]) and r["max_abs_error"] > r["tolerance"]]
    if over:
        worst = max((r for r in records if r["step"] in over), key=lambda r: r["error_over_tolerance"])
        failures.append(f"logit error above tolerance at steps {over} (worst: step {worst['step']}, "
                        f"{worst['max_abs_error']:.4g} > {worst['tolerance']:.4g})")
    disagree = [r for r in records if not r["agree"]]
    real = [r["step"] for r in disagree if not r["near_tie"]]
    if real:
        failures.append(f"greedy tokens disagree at steps {real} where transformers' top-2 margin exceeds 2 x tolerance")
    # Engine.generate feeds back its own tokens: the same inputs as the teacher-forced run up
    # to the first step where the engine's choice differs from transformers'.
    diverged = next((r["step"] for r in records if not r["agree"]), len(records) - 1)
    checked = min(diverged + 1, len(generated))
    for r in records[:checked]:
        if generated[r["step"]] != r["nanoqwen_token"]:
            if r["nanoqwen_margin"] > EXACT_TIE * r["reference_rms"]:
                failures.append(f"Engine.generate's token {r['step']} is {generated[r['step']]}; the engine's own "
                                f"logits (teacher-forced, same inputs) pick {r['nanoqwen_token']} by a margin of "
                                f"{r['nanoqwen_margin']:.3g}")
            break  # an exact tie went the other way: from here on generate's inputs differ
    if generate_error:
        failures.append(f"Engine.generate raised {generate_error}")
    elif len(generated) < diverged + 1:
        failures.append(f"Engine.generate made {len(generated)} tokens, {steps + 1} were asked for")
    counts = dict(
        steps_compared=len(records),
        decode_steps=steps,
        disagreements=len(disagree),
        disagreements_at_near_ties=sum(r["near_tie"] for r in disagree),
        disagreements_within_measured_error=sum(r["margin"] <= 2 * r["max_abs_error"] for r in disagree),
        near_tie_steps=sum(r["near_tie"] for r in records),
        generate_tokens_checked=checked,
        generate_tokens_equal_to_transformers=next(
            (i for i, (a, b) in enumerate(zip(generated, reference_tokens)) if a != b), min(len(generated), len(reference_tokens))),
        worst_error_over_tolerance=max((r["error_over_tolerance"] for r in records if np.isfinite(r["error_over_tolerance"])),
                                       default=float("nan")),
    )
    return failures, counts


def environment(device, backend: str) -> dict:
    import torch
    import transformers

    info = dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=shlex.join([sys.executable, *sys.argv]),
        python=platform.python_version(),
        numpy=np.__version__,
        torch=torch.__version__,
        transformers=transformers.__version__,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        host=platform.node(),
        device=str(device),
        backend=backend,
        gpu=torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None,
    )
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except ImportError:
        info["cupy"] = None
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        info["git_commit"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") or None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def _json_scalar(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def table(records: list[dict], prompt_tokens: int) -> str:
    lines = ["| step | position | max err | tol | err/tol | margin | tokens (hf / nq) | agree |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in records:
        agree = "yes" if r["agree"] else ("near-tie" if r["near_tie"] else "NO")
        lines.append(f"| {r['step']} | {prompt_tokens - 1 + r['step']} | {r['max_abs_error']:.3e} | {r['tolerance']:.3e} | "
                     f"{r['error_over_tolerance']:.3f} | {r['margin']:.3e} | {r['reference_token']} / {r['nanoqwen_token']} | "
                     f"{agree} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="a .nanoqwen file")
    parser.add_argument("--steps", type=int, default=MIN_DECODE_STEPS,
                        help=f"teacher-forced decode steps, at least {MIN_DECODE_STEPS} (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt and the page table's shuffle")
    parser.add_argument("--backend", choices=[b for b in BACKENDS if b != "auto"], default="cuda")
    parser.add_argument("--device", default="cuda", help="torch device of the transformers reference")
    parser.add_argument("--tolerance-factor", type=float, default=ROUNDING_TOLERANCE_FACTOR,
                        help="k in k * rms(the logits' change under injected fp16 rounding noise)")
    parser.add_argument("--max-context", type=int, help="the engine's KV pool, in tokens (default: 4096 or what the run needs)")
    parser.add_argument("--no-poison", action="store_true", help="leave the KV pool zeroed instead of NaN")
    parser.add_argument("--json", type=output_path, help="write every number here")
    args = parser.parse_args(argv)
    if not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    # A verdict needs this many steps: fewer would run the whole check only to fail at the end.
    if args.steps < MIN_DECODE_STEPS:
        parser.error(f"--steps {args.steps}: at least {MIN_DECODE_STEPS} decode steps are required")
    if args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens ({args.prompt_tokens}) must be >= 1")
    if args.seed < 0:
        parser.error(f"--seed ({args.seed}) must be >= 0")
    if not 0 < args.tolerance_factor < float("inf"):  # NaN too: no error exceeds a NaN tolerance
        parser.error(f"--tolerance-factor ({args.tolerance_factor}) must be a positive, finite number")
    return args


def unusable_device(args, torch) -> str | None:
    """Why --device or --backend cannot run on this machine, naming the option to change; None when both can."""
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        return f"--device {args.device}: {e}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu"
    if args.backend == "cuda" and (reason := cuda_unavailable_reason()) is not None:
        return f"--backend cuda: needs CuPy and a Hopper GPU ({reason}); use --backend numpy"
    return None


def main(argv=None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    import torch

    if (problem := unusable_device(args, torch)) is not None:
        print(f"check_vs_transformers: {problem}", file=sys.stderr)
        return 2
    # fp32 means fp32: no TF32 in the reference's matmuls.
    torch.set_float32_matmul_precision("highest")
    device = torch.device(args.device)
    seconds: dict[str, float] = {}
    report = dict(environment=environment(device, args.backend))
    print(f"{report['environment']['command']}\n{report['environment']['date']}  gpu: {report['environment']['gpu']}  "
          f"torch {torch.__version__}  transformers {report['environment']['transformers']}", flush=True)

    with phase("open .nanoqwen", seconds):
        model = nanoqwen.load(args.model)
    c = model.config
    print(model, flush=True)
    total = args.prompt_tokens + args.steps + 1  # the prefill's token and one per step, as Engine.generate is asked
    if total > c.max_position_embeddings:
        raise SystemExit(f"prompt ({args.prompt_tokens}) + steps ({args.steps}) + the prefill's token exceed the "
                         f"model's context {c.max_position_embeddings}")
    prompt = np.random.default_rng(args.seed).integers(0, c.vocab_size, args.prompt_tokens).astype(np.int64)

    with phase("dequantization self-check", seconds):
        checked = check_dequantize(model, device)
    print(f"torch dequantization == nanoqwen.quant.dequantize_int4 on {checked:,} weights of layer 0's k_proj", flush=True)
    with phase("build transformers fp32 reference", seconds):
        reference = hf_reference(model, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if device.type == "cuda":
        print(f"torch GPU memory after build: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB", flush=True)
    with phase("transformers: prefill + decode", seconds):
        expected, reference_tokens, drift = run_reference(reference, prompt, args.steps, device)
    print(f"reference self-check: cached decode vs one uncached forward, last step, max |diff| {drift:.3e}", flush=True)
    with phase("transformers with fp16 rounding noise (the tolerance)", seconds):
        with rounding_noise(reference, seed=args.seed, prefill_weights_fp16=args.backend == "cuda"):
            perturbed, _, _ = run_reference(reference, prompt, args.steps, device, forced=reference_tokens)
    del reference
    if device.type == "cuda":
        report["torch_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()  # give the 30 GB back before the engine uploads its own copy

    with phase(f"build nanoqwen engine ({args.backend})", seconds):
        # The engine's usual context (the decode kernel then splits 4096 positions, most of
        # them past the sequence), or more if the sequence and the spare pages need it.
        wanted = max(DEFAULT_MAX_CONTEXT, (pages_needed(total) + SPARE_PAGES) * PAGE_SIZE)
        engine = Engine(model, backend=args.backend, max_context=args.max_context or min(c.max_position_embeddings, wanted))
    if not args.no_poison:
        poison_kv_pool(engine.backend)
    with phase("nanoqwen: teacher-forced prefill + decode", seconds):
        got, page_table = run_engine(engine, prompt, reference_tokens, args.seed)
    with phase("nanoqwen: Engine.generate (greedy)", seconds):
        try:
            generated, generate_error = engine.generate(prompt.tolist(), max_new_tokens=args.steps + 1,
                                                        stop_token_ids=[]).token_ids, None
        except Exception as e:  # e.g. NaN logits: reported as a failure next to the numbers that explain it
            generated, generate_error = [], f"{type(e).__name__}: {e}"
    engine.close()

    records = compare(expected, perturbed, got, args.tolerance_factor)
    failures, counts = verdict(records, args.steps, generated, reference_tokens, generate_error)
    report.update(
        model=dict(path=str(args.model), config=dataclasses.asdict(c), bytes=model.nbytes),
        prompt=prompt.tolist(), page_table=page_table, kv_pool_poisoned=not args.no_poison,
        tolerance=dict(formula="k * rms(the step's logit change under first-order fp16 rounding noise injected "
                               "where the engine rounds, nanoqwen.testing.rounding_noise)",
                       k=args.tolerance_factor, prefill_weights_fp16=args.backend == "cuda"),
        reference_tokens=reference_tokens, generate_tokens=generated,
        reference_cache_drift=drift, counts=counts, steps=records,
        seconds=seconds, passed=not failures, failures=failures,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=_json_scalar))

    print("\nphase seconds: " + ", ".join(f"{name} {s:.2f}" for name, s in seconds.items())
          + f"; total {time.perf_counter() - began:.1f} s")
    print(f"worst error / tolerance {counts['worst_error_over_tolerance']:.3f} (k = {args.tolerance_factor}); "
          f"disagreements {counts['disagreements']} (at near-ties {counts['disagreements_at_near_ties']}, "
          f"within measured error {counts['disagreements_within_measured_error']}); near-tie steps "
          f"{counts['near_tie_steps']}; Engine.generate checked over {counts['generate_tokens_checked']} tokens, "
          f"equal to transformers' greedy tokens for the first {counts['generate_tokens_equal_to_transformers']}")
    if args.json:
        print(f"json: {args.json}")
    print()
    print(table(records, args.prompt_tokens))
    for failure in failures:
        print(f"FAIL: {failure}")
    print(f"{'PASS' if not failures else 'FAIL'}: nanoqwen ({args.backend}) vs transformers fp32 ({device}), "
          f"{len(records)} steps ({args.steps} decode), prompt {args.prompt_tokens} tokens, "
          f"{c.num_layers} layers, hidden {c.hidden_size}")
    return 0 if not failures else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NanoqwenError as e:  # a file that is not a .nanoqwen model, a context too long: the message says it
        sys.exit(f"check_vs_transformers: {e}")
