#!/usr/bin/env python3
"""Train nano-coder: a 7M-parameter Qwen2-architecture code model, in one short run.

nanoqwen's readers and its CI have neither a GPU nor the model hub, so the package ships a
small model with exactly Qwen2.5-Coder's architecture (RMSNorm, GQA attention with q/k/v
biases, RoPE, SwiGLU MLP, tied embeddings) and tokenizer conventions (byte-level BPE, ChatML
and FIM special tokens). This script makes it from nothing but the Python files on the
machine it runs on:

  1. corpus     Python sources of the stdlib and site-packages (corpus.py)
  2. tokenizer  byte-level BPE, 8192 ids, Qwen's special tokens (bpe.py)
  3. tokens     the corpus encoded on all cores; ~30% of training text turned into FIM examples
  4. training   bf16 autocast, AdamW, warmup + cosine, for a fixed wall-clock budget
  5. checkpoint fp16 safetensors + configs + tokenizer + train_log.json (held-out loss, samples)

The whole command must end within 600 s on one H200 (data preparation included), so every
stage is capped and training stops at a deadline rather than after a number of steps.
See README.md beside this file for the exact command and the recorded run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers

# Our helpers live beside this script (running `python tools/nano_coder/train.py` puts this
# folder first on sys.path, so plain imports work without making tools/ a package).
import bpe
import corpus as corpus_mod

T0 = time.time()  # wall clock of the whole command: the 600 s budget counts from here


def log(msg: str) -> None:
    # flush: the run is watched (and cut off) from outside; buffered lines would be lost.
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder for the checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    # Data
    p.add_argument("--roots", nargs="*", default=None,
                   help="folders to take *.py from (default: the stdlib and site-packages)")
    p.add_argument("--max-corpus-mb", type=float, default=400.0,
                   help="cap on corpus bytes (the H200 image holds ~360 MB of .py files <= 200 KB)")
    p.add_argument("--max-file-kb", type=float, default=200.0)
    p.add_argument("--heldout-percent", type=float, default=1.0)
    p.add_argument("--tokenizer-sample-mb", type=float, default=40.0)
    p.add_argument("--fim-rate", type=float, default=0.3)
    p.add_argument("--fim-segment-chars", type=int, default=1500)
    # Training
    p.add_argument("--train-seconds", type=float, default=300.0,
                   help="wall-clock budget of the training loop (torch.compile included)")
    p.add_argument("--deadline-seconds", type=float, default=570.0,
                   help="hard end of the whole command; training is shortened to meet it")
    p.add_argument("--reserve-seconds", type=float, default=40.0,
                   help="time kept after training for evaluation, samples and saving")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=None, help="default: 128 on GPU, 8 on CPU")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.02,
                   help="fraction of the time budget spent warming the learning rate up")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the model (auto: on for CUDA)")
    p.add_argument("--eval-windows", type=int, default=None,
                   help="held-out windows of seq-len tokens (default: 1024 on GPU, 16 on CPU)")
    p.add_argument("--log-every-seconds", type=float, default=10.0)
    p.add_argument("--sample-tokens", type=int, default=None,
                   help="new tokens per greedy sample (default: 64 on GPU, 16 on CPU)")
    args = p.parse_args(argv)
    option = lambda name: f"--{name.replace('_', '-')} {getattr(args, name)}"
    for name in ("train_seconds", "deadline_seconds", "max_corpus_mb", "max_file_kb", "tokenizer_sample_mb", "lr",
                 "grad_clip"):
        if not 0 < getattr(args, name) < math.inf:
            p.error(f"{option(name)}: must be a positive number")
    for name in ("reserve_seconds", "log_every_seconds", "weight_decay"):  # 0: no reserve, every step, none
        if not 0 <= getattr(args, name) < math.inf:
            p.error(f"{option(name)}: must be a number >= 0")
    for name in ("fim_rate", "min_lr_ratio", "warmup_frac"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"{option(name)}: must lie between 0 and 1")
    # A piece of FIM text needs a character; a training window a token to predict from another.
    for name, least in (("fim_segment_chars", 1), ("seq_len", 2), ("batch_size", 1), ("eval_windows", 1),
                        ("sample_tokens", 1)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            p.error(f"{option(name)}: must be at least {least}")
    if not 0 < args.heldout_percent < 100:
        p.error(f"--heldout-percent must lie between 0 and 100, got {args.heldout_percent}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out}: exists and is not a folder")
    missing = [root for root in args.roots or [] if not os.path.isdir(root)]
    if missing:
        p.error(f"--roots {missing[0]}: no such folder")
    return args


def training_device(name: str):
    """The torch device --device names, once it is known to work here (before minutes of corpus work)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        sys.exit(f"train.py: --device {name!r}: {e}")
    if device.type not in ("cpu", "cuda"):
        sys.exit(f"train.py: --device {name!r}: choose auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"train.py: --device {name!r}: this torch sees no CUDA GPU (use --device cpu)")
    return device


def replace_folder(staging: Path, out: Path) -> None:
    """Put the finished checkpoint at `out`, replacing a folder there only now that the new one is
    whole: an interrupted or failed run leaves the old checkpoint as it was, never a mix."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old)


# Model shape. Hidden and intermediate sizes are multiples of 128 because nanoqwen quantizes
# linear weights to INT4 in groups of 128 along the input dimension.
MODEL_SHAPE = dict(
    vocab_size=bpe.VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,  # head_dim = 256 / 4 = 64
    num_key_value_heads=2,  # GQA: two query heads share each K/V head, as in Qwen2.5-Coder-7B (28:4)
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,  # the lm_head reuses the embedding: 2M fewer parameters to ship
)
ROPE_THETA = 10000.0

SAMPLE_PROMPTS = [
    ("def", "def fibonacci(n):"),
    ("softmax", "import numpy as np\n\ndef softmax(x):"),
    # FIM in PSM order: the model should write the middle, then <|endoftext|>.
    ("fim", "<|fim_prefix|>def is_even(n):\n    return <|fim_suffix|>\n\n\nprint(is_even(4))\n<|fim_middle|>"),
]


# ---------------------------------------------------------------------------------------------
# Stage 3: tokens
# ---------------------------------------------------------------------------------------------
def encode_corpus(tok, docs, ids, fim_rate, segment_chars, rng, batch_docs=2000):
    """Encode documents into one uint16 stream; each document is followed by <|endoftext|>.

    With fim_rate > 0, parts of documents become PSM FIM examples (corpus.fim_plan).
    Returns (tokens, number of FIM examples).
    """
    # Source files may contain the *text* "<|endoftext|>" (tokenizer code does). Such text must
    # become ordinary tokens, or the model would learn that documents end in the middle of a
    # string literal. encode_special_tokens=True makes this copy treat special-token text as
    # plain text; special ids are inserted below, explicitly, where the format puts them.
    enc = tok.__class__.from_str(tok.to_str())
    enc.encode_special_tokens = True
    eot, fp, fm, fs = (ids[t] for t in ("<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"))

    out, n_fim = [], 0
    for start in range(0, len(docs), batch_docs):
        plans = [corpus_mod.fim_plan(d.text, rng, fim_rate, segment_chars) if fim_rate > 0
                 else [d.text] for d in docs[start : start + batch_docs]]
        # One flat list of strings per batch: encode_batch_fast runs it on all cores in Rust
        # (the "fast" variant skips computing character offsets, which we do not need).
        pieces = []
        for plan in plans:
            for part in plan:
                pieces.extend(part if isinstance(part, tuple) else (part,))
        encoded = iter(enc.encode_batch_fast(pieces, add_special_tokens=False))

        def nxt():
            return np.asarray(next(encoded).ids, dtype=np.uint16)

        for plan in plans:
            for part in plan:
                if isinstance(part, tuple):
                    pre, mid, suf = nxt(), nxt(), nxt()  # encoded in (prefix, middle, suffix) order
                    # ...and emitted in PSM order, each example closed by <|endoftext|>.
                    out += [np.array([fp], np.uint16), pre, np.array([fs], np.uint16), suf,
                            np.array([fm], np.uint16), mid, np.array([eot], np.uint16)]
                    n_fim += 1
                else:
                    out.append(nxt())
            out.append(np.array([eot], np.uint16))
    tokens = np.concatenate(out) if out else np.zeros(0, np.uint16)
    return tokens, n_fim


# ---------------------------------------------------------------------------------------------
# Stage 4: model and training
# ---------------------------------------------------------------------------------------------
def make_config(ids):
    import inspect

    from transformers import Qwen2Config

    kw = dict(MODEL_SHAPE)
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x had a top-level rope_theta.
    if "rope_parameters" in inspect.signature(Qwen2Config.__init__).parameters:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    else:
        kw["rope_theta"] = ROPE_THETA
    eot = ids["<|endoftext|>"]
    # Like Qwen2.5-Coder (base): <|endoftext|> is both BOS (never prepended) and EOS.
    return Qwen2Config(**kw, bos_token_id=eot, eos_token_id=eot, use_sliding_window=False)


def lr_at(progress: float, args) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr, as a function of time spent.

    The schedule follows the fraction of the *time* budget used, not a step count: the number of
    steps that fit into 300 s is only known once training runs.
    """
    if progress < args.warmup_frac:
        return args.lr * progress / args.warmup_frac
    t = min(1.0, (progress - args.warmup_frac) / max(1e-9, 1.0 - args.warmup_frac))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(model, data, seq_len, n_windows, batch, device, autocast):
    """Mean next-token cross-entropy over fixed held-out windows of seq_len predictions.

    The windows are spread evenly over the whole held-out stream (documents are in path order,
    so the first windows alone would all come from one or two packages). They are the same at
    every evaluation of a run. Returns (loss, number of predicted tokens).
    """
    import torch
    import torch.nn.functional as F

    last = len(data) - seq_len - 1  # last valid window start
    n_windows = max(1, min(n_windows, (len(data) - 1) // seq_len))
    starts = np.linspace(0, max(0, last), n_windows).astype(np.int64).tolist()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, n_windows, batch):
            x = torch.stack([data[i : i + seq_len + 1] for i in starts[s : s + batch]])
            x = x.to(device, non_blocking=True).long()
            with autocast():
                logits = model(input_ids=x[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                   reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    return total / count, count


def greedy(model, tok, prompt, n_new, device, eot):
    """Greedy decoding without a KV cache: simple and exactly reproducible by any runtime."""
    import torch

    ids = tok.encode(prompt, add_special_tokens=False).ids  # special-token text -> special ids
    out = []
    with torch.no_grad():
        for _ in range(n_new):
            x = torch.tensor([ids + out], device=device)
            nxt = int(model(input_ids=x, use_cache=False).logits[0, -1].float().argmax())
            out.append(nxt)
            if nxt == eot:
                break
    return tok.decode(out, skip_special_tokens=False), out


def main(argv=None):
    args = parse_args(argv)
    device = training_device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Everything is written beside --out first, and moves there only when the run has finished.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))

    def stop(signum, frame):  # wherever the run is: an exception raised here could land in a __del__ and be lost
        shutil.rmtree(staging, ignore_errors=True)
        os._exit(128 + signum)

    for name in ("SIGTERM", "SIGHUP"):  # not where they are ignored (nohup)
        if signal.getsignal(getattr(signal, name)) == signal.SIG_DFL:
            signal.signal(getattr(signal, name), stop)
    try:
        train(args, device, staging, argv)
        replace_folder(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def train(args, device, folder: Path, argv):
    """The whole pipeline, writing the checkpoint into `folder`."""
    random.seed(args.seed)
    np.random.seed(args.seed)

    # ---- 1. corpus -------------------------------------------------------------------------
    roots = ([(f"root{i}", r) for i, r in enumerate(args.roots)] if args.roots
             else corpus_mod.default_roots())
    log(f"corpus: scanning {', '.join(f'{l}={p}' for l, p in roots)}")
    corpus = corpus_mod.build_corpus(
        roots,
        max_corpus_bytes=int(args.max_corpus_mb * 2**20),
        max_file_bytes=int(args.max_file_kb * 1000),
        heldout_percent=args.heldout_percent,
    )
    st = corpus.stats
    for label, r in st["roots"].items():
        log(f"  root {label}: {r['path']}: {r['candidate_files']} candidate files, {r.get('used_files', 0)} used")
    log(f"corpus: {st['train_files']} train files ({st['train_bytes'] / 2**20:.1f} MiB), "
        f"{st['heldout_files']} held-out files ({st['heldout_bytes'] / 2**20:.2f} MiB); "
        f"skipped {st['skipped_duplicates']} duplicates, {st['skipped_not_utf8']} non-UTF-8")
    if not corpus.train or not corpus.heldout:
        sys.exit("corpus too small: need at least one training and one held-out file")
    t_corpus = time.time() - T0

    # ---- 2. tokenizer ----------------------------------------------------------------------
    # The BPE only needs a representative sample; a hash-ordered one spans every package.
    cap = int(args.tokenizer_sample_mb * 2**20)
    sample, n = [], 0
    for d in sorted(corpus.train, key=lambda d: corpus_mod.stable_hash("bpe:" + d.key)):
        if n >= cap:
            break
        sample.append(d.text)
        n += len(d.text)
    t = time.time()
    tok = bpe.train_tokenizer(sample, total_chars=n)
    del sample
    ids = bpe.special_ids(tok)
    bpe.save_tokenizer(tok, str(folder), model_max_length=MODEL_SHAPE["max_position_embeddings"])
    log(f"tokenizer: BPE trained on {n / 2**20:.1f} MiB in {time.time() - t:.1f}s; "
        f"{tok.get_vocab_size()} ids, specials {ids}")
    t_tokenizer = time.time() - T0 - t_corpus

    # ---- 3. tokens -------------------------------------------------------------------------
    t = time.time()
    train_tokens, n_fim = encode_corpus(tok, corpus.train, ids, args.fim_rate, args.fim_segment_chars,
                                        random.Random(args.seed))
    heldout_tokens, _ = encode_corpus(tok, corpus.heldout, ids, 0.0, args.fim_segment_chars, None)
    log(f"tokens: {len(train_tokens):,} train ({st['train_bytes'] / max(1, len(train_tokens)):.2f} bytes/token, "
        f"{n_fim:,} FIM examples), {len(heldout_tokens):,} held-out, in {time.time() - t:.1f}s")
    t_encode = time.time() - t
    corpus_desc = {**st, "train_tokens": int(len(train_tokens)), "heldout_tokens": int(len(heldout_tokens)),
                   "fim_examples": n_fim, "tokenizer_sample_bytes": n}
    del corpus  # release the text (hundreds of MB); only tokens are needed from here on

    # ---- 4. model --------------------------------------------------------------------------
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import GenerationConfig, Qwen2ForCausalLM

    args.device = str(device)
    cuda = device.type == "cuda"
    batch = (128 if cuda else 8) if args.batch_size is None else args.batch_size
    eval_windows = (1024 if cuda else 16) if args.eval_windows is None else args.eval_windows
    sample_tokens = (64 if cuda else 16) if args.sample_tokens is None else args.sample_tokens
    use_compile = args.compile == "on" or (args.compile == "auto" and cuda)
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")  # TF32 for the few fp32 matmuls left

    config = make_config(ids)
    config._attn_implementation = "sdpa"  # fused (flash) attention kernels
    model = Qwen2ForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    log(f"model: Qwen2ForCausalLM, {n_params / 1e6:.2f}M parameters, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if cuda else ""))

    # bf16 autocast on the GPU (fp32 master weights, bf16 matmuls); plain fp32 on the CPU,
    # where bf16 is often slower.
    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    # Weight decay on matrices only: decaying norms' gains and biases just pulls them to zero.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda,
    )

    # The whole token stream lives on the device (int32: ~400 MB for 100M tokens, nothing for an
    # H200): a batch is a gather of random windows, with no data loader and no host-to-device
    # copy per step. Random windows ignore document boundaries, as in most LM pre-training.
    data = torch.from_numpy(train_tokens.astype(np.int32)).to(device)
    heldout = torch.from_numpy(heldout_tokens.astype(np.int32))
    T = args.seq_len
    if len(data) < T + 2:
        sys.exit(f"only {len(data)} training tokens: fewer than one window of {T}")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    arange = torch.arange(T + 1, device=device)

    def get_batch():
        starts = torch.randint(0, len(data) - T - 1, (batch,), device=device, generator=gen)
        x = data[starts[:, None] + arange].long()
        return x[:, :-1], x[:, 1:]

    def step_fn(m, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        inp, tgt = get_batch()
        with autocast():
            logits = m(input_ids=inp, use_cache=False).logits
        # fp32 loss: a softmax over 8192 classes in bf16 loses precision.
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # Time budget: what was asked, but never past the command's deadline (minus what evaluation,
    # samples and saving need), so a slow data stage shortens training instead of killing the run.
    budget = min(args.train_seconds, args.deadline_seconds - args.reserve_seconds - (time.time() - T0))
    if budget < args.train_seconds:
        log(f"train: budget cut from {args.train_seconds:.0f}s to {budget:.0f}s to meet the deadline")
    budget = max(budget, 1.0)

    # torch.compile fuses the many small elementwise kernels of a model this narrow, which
    # matters more than usual: at hidden size 256 most of the time is memory traffic. The first
    # compiled step pays for compilation (~25 s on the H200); it counts against the budget.
    train_model = torch.compile(model) if use_compile else model
    compiled = False
    log(f"train: batch {batch} x {T} = {batch * T:,} tokens/step, lr {args.lr}, budget {budget:.0f}s, "
        f"compile {'on' if use_compile else 'off'}")

    # Held-out loss at 25%, 50% and 75% of the budget (and at the end): on a corpus that is
    # seen several times, a rising held-out loss would reveal overfitting.
    eval_points = [0.25, 0.5, 0.75]
    evals = []

    def run_eval(step, tokens_seen, when):
        # The uncompiled module (same weights): a new batch shape would make the compiled one
        # recompile. No mode switch needed either: Qwen2 has no dropout at attention_dropout=0.
        hl, n_tok = evaluate(model, heldout, T, eval_windows, batch, device, autocast)
        evals.append({"at": when, "step": step, "tokens_seen": tokens_seen, "heldout_loss": hl})
        log(f"eval: step {step} held-out loss {hl:.4f} (ppl {math.exp(hl):.2f}) over {n_tok:,} tokens")
        return hl, n_tok

    step, tokens_seen = 0, 0
    recent, history = [], []
    t_train = time.time()
    # The learning-rate schedule runs on its own clock, started after the first step, so that
    # the time spent compiling does not eat the warmup (the first step runs at lr 0).
    sched_t0, sched_len = t_train, budget
    last_log_t, last_log_tokens = t_train, 0
    model.train()  # never switched while training: the compiled graph would recompile
    while time.time() - t_train < budget:
        progress = min(1.0, (time.time() - sched_t0) / sched_len)
        lr = lr_at(progress, args) if step > 0 else 0.0
        if step == 0 and train_model is not model:
            try:
                loss = step_fn(train_model, lr)
                loss.item()  # wait for the step: compilation errors surface here at the latest
                compiled = True
                log(f"train: torch.compile ok, first step took {time.time() - t_train:.1f}s")
            except Exception as e:  # noqa: BLE001 -- any compiler failure: fall back, do not die
                log(f"train: torch.compile failed ({type(e).__name__}: {str(e)[:300]}); running eager")
                opt.zero_grad(set_to_none=True)
                train_model = model
                continue
        else:
            loss = step_fn(train_model, lr)
        step += 1
        tokens_seen += batch * T
        if step == 1:
            sched_t0 = time.time()
            sched_len = max(1e-3, t_train + budget - sched_t0)
        recent.append(loss)
        if len(recent) > 50:
            recent.pop(0)
        if eval_points and progress >= eval_points[0]:
            run_eval(step, tokens_seen, eval_points.pop(0))
        now = time.time()
        if now - last_log_t >= args.log_every_seconds:
            cur = torch.stack(recent[-10:]).mean().item()  # the only host sync in the loop
            now = time.time()
            tps = (tokens_seen - last_log_tokens) / (now - last_log_t)
            history.append({"step": step, "t": round(now - t_train, 1), "loss": round(cur, 4),
                            "lr": lr, "tokens_per_s": round(tps)})
            log(f"step {step:6d}  loss {cur:.4f}  lr {lr:.2e}  {tps:,.0f} tok/s  "
                f"{(now - t_train) / budget:6.1%} of {budget:.0f}s")
            last_log_t, last_log_tokens = now, tokens_seen
    if cuda:
        torch.cuda.synchronize()
    train_wall = time.time() - t_train
    final_train_loss = torch.stack(recent).mean().item() if recent else float("nan")
    log(f"train: {step} steps, {tokens_seen:,} tokens in {train_wall:.1f}s ({tokens_seen / train_wall:,.0f} "
        f"tok/s); train loss (mean of the last {len(recent)} steps) {final_train_loss:.4f}")

    # ---- 5. evaluation, samples, checkpoint ------------------------------------------------
    model.eval()
    heldout_loss, heldout_count = run_eval(step, tokens_seen, 1.0)
    if not recent:
        sys.exit("train.py: no training step finished within --train-seconds: no checkpoint is written")
    if not (math.isfinite(final_train_loss) and math.isfinite(heldout_loss)):
        sys.exit(f"train.py: the run ended with train loss {final_train_loss} and held-out loss {heldout_loss} "
                 f"after {step} steps: no checkpoint is written (a lower --lr may keep it from diverging)")

    # Samples from the fp32 training weights (greedy, so reproducible given the weights).
    samples = []
    for name, prompt in SAMPLE_PROMPTS:
        text, out_ids = greedy(model, tok, prompt, sample_tokens, device, ids["<|endoftext|>"])
        samples.append({"name": name, "prompt": prompt, "completion": text, "completion_ids": out_ids})
        log(f"sample {name}: {prompt!r} -> {text!r}")

    # fp16 checkpoint: half the size of fp32, and the dtype nanoqwen's converter reads.
    model = model.to("cpu").half()
    eot = ids["<|endoftext|>"]
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False, max_new_tokens=256
    )
    model.save_pretrained(folder, safe_serialization=True)
    files = {f: os.path.getsize(folder / f) for f in sorted(os.listdir(folder))}

    train_log = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3"] + (sys.argv if argv is None else [sys.argv[0]] + list(argv))),
        "python": sys.executable,
        "device": (torch.cuda.get_device_name(device) if cuda
                   else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "seed": args.seed,
        "args": vars(args),
        "hyperparameters": {
            **MODEL_SHAPE, "rope_theta": ROPE_THETA, "parameters": n_params,
            "batch_size": batch, "seq_len": T, "tokens_per_step": batch * T,
            "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), weight decay on matrices only",
            "lr": args.lr,
            "schedule": (f"first step at lr 0 (compilation), then linear warmup over {args.warmup_frac:.0%} "
                         f"of the remaining time, cosine to {args.min_lr_ratio} x lr"),
            "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
            "precision": "bf16 autocast, fp32 weights and loss" if cuda else "fp32",
            "torch_compile": compiled,
            "fim": {"rate": args.fim_rate, "segment_chars": args.fim_segment_chars, "order": "PSM"},
        },
        "special_token_ids": ids,
        "corpus": corpus_desc,
        "timing_s": {"corpus": round(t_corpus, 1), "tokenizer": round(t_tokenizer, 1),
                     "encode": round(t_encode, 1), "train_budget": round(budget, 1),
                     "train": round(train_wall, 1), "total": round(time.time() - T0, 1)},
        "steps": step,
        "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / max(1, len(train_tokens)), 2),
        "final_train_loss": final_train_loss,
        "evals": evals,
        "heldout_loss": heldout_loss,
        "heldout_perplexity": math.exp(heldout_loss),
        "heldout_eval_tokens": heldout_count,
        "loss_history": history,
        "samples": samples,
        "samples_note": "greedy, from the fp32 weights before the fp16 cast, no KV cache",
        "files_bytes": files,
    }
    with open(folder / "train_log.json", "w") as f:
        json.dump(train_log, f, indent=2, ensure_ascii=False)
        f.write("\n")
    total_mb = sum(os.path.getsize(folder / f) for f in os.listdir(folder)) / 2**20
    if total_mb > 16:
        log(f"WARNING: the checkpoint is {total_mb:.1f} MiB, above the 16 MiB meant for the package")
    # The one-line summary, last, for whoever reads only the tail of the log.
    print(f"nano-coder: done in {time.time() - T0:.0f}s | {step} steps, {tokens_seen / 1e6:.1f}M tokens "
          f"({train_log['epochs']} epochs) | train loss {final_train_loss:.3f} | "
          f"held-out loss {heldout_loss:.3f} (ppl {math.exp(heldout_loss):.2f}) | compile {compiled} | "
          f"{total_mb:.1f} MiB in {args.out}", flush=True)


if __name__ == "__main__":
    main()
