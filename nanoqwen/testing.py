"""Small random Qwen2 models, built offline, for tests and chapters.

    path = make_nanoqwen(tmp_dir, num_layers=2, num_heads=28, num_kv_heads=4, head_dim=32)
    model = nanoqwen.load(path)
    ref = reference_model(model)        # transformers, fp32, the same (dequantized) weights

`make_hf_checkpoint` writes what the Hugging Face hub would hand us (config.json,
model.safetensors in bfloat16, tokenizer.json, tokenizer_config.json), so the converter runs
on the same kind of input as for Qwen2.5-Coder-7B-Instruct. The tokenizer is a byte-level BPE
trained here on a few KB of fixed text, with Qwen's special tokens and a ChatML template.

Why not the Hugging Face initialization: with std 0.02 every layer is a near-identity
perturbation and the logits come out nearly uniform (std ~0.02 * sqrt(hidden)), so greedy
choices hang on differences of 1e-3 that fp16 rounding can flip, and a test comparing two
implementations would pass or fail by chance. Instead each projection gets std
`1/sqrt(fan_in)`, which keeps activations O(1) through every layer (attention scores have
std ~1, so attention is neither uniform nor one-hot), and the lm_head gets `3/sqrt(hidden)`,
so logits have std ~3: a clear winner at most steps, with top-1/top-2 gaps far above rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .loader import Model
from .quant import dequantize_int4

__all__ = ["ACCEPTED_SHAPES", "CHECKED_SHAPES", "CODE_EDIT_PROMPTS", "DEFAULT_CONFIG", "FAMILY_SHAPES", "ROUNDING_TOLERANCE_FACTOR", "fp16_relative_rms",
           "make_hf_checkpoint", "make_nanoqwen", "make_tokenizer", "make_tokenizer_files", "reference_model",
           "rounding_noise", "rounding_tolerance"]

# Small enough to build and run in well under a second; every dimension a multiple of the
# INT4 group (128) where the format requires it, GQA 2:1, untied lm_head like the 7B.
DEFAULT_CONFIG = dict(
    num_layers=2,
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Small models with the features in which the Qwen2 family's sizes differ, for the GPU tests: head_dim
# 64 (0.5B) or 128, GQA ratios of 1, 5, 6, 7 and 8 query heads per KV head, tied or separate lm_head,
# and group counts along K that split unevenly over the GEMVs' warps (hidden 5120 is 40 groups, MLP
# 13824 is 108). Overrides of DEFAULT_CONFIG for make_nanoqwen.
FAMILY_SHAPES = {
    "head_dim 64, 7:1, tied (0.5B-like)": dict(hidden_size=896, intermediate_size=1280, num_heads=14, num_kv_heads=2,
                                               head_dim=64, tie_word_embeddings=True),
    "1:1 (no grouping)": dict(hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=4, head_dim=64),
    "5:1, hidden 640, MLP 1792, tied": dict(hidden_size=640, intermediate_size=1792, num_heads=5, num_kv_heads=1,
                                            head_dim=128, tie_word_embeddings=True),
    "6:1, head_dim 128 (1.5B-like)": dict(hidden_size=768, intermediate_size=2304, num_heads=6, num_kv_heads=1,
                                          head_dim=128, tie_word_embeddings=True),
    "8:1 over 16 query heads": dict(hidden_size=1024, intermediate_size=2048, num_heads=16, num_kv_heads=2, head_dim=64),
    "14B widths: 40 and 108 groups, 5:1": dict(num_layers=1, hidden_size=5120, intermediate_size=13824, num_heads=40,
                                               num_kv_heads=8, head_dim=128, vocab_size=1024),
}

# Shapes no published size has that the converter and both backends accept: head_dim 96, and query
# heads whose total width differs from the hidden size (head_dim given apart from hidden / num_heads).
ACCEPTED_SHAPES = {
    "head_dim 96, 2:1": dict(hidden_size=384, intermediate_size=768, num_heads=4, num_kv_heads=2, head_dim=96),
    "queries wider than hidden (4 x 128 over 256)": dict(hidden_size=256, intermediate_size=512, num_heads=4,
                                                         num_kv_heads=2, head_dim=128),
    "queries narrower than hidden (4 x 64 over 512), 4:1": dict(hidden_size=512, intermediate_size=512, num_heads=4,
                                                                num_kv_heads=1, head_dim=64),
}
CHECKED_SHAPES = {**FAMILY_SHAPES, **ACCEPTED_SHAPES}  # every shape the engine tests run at

# Code edits whose output mostly copies the prompt, the case speculative decoding is for: nano-coder
# continues each by copying the code above it with the change the comment asks for.
CODE_EDIT_PROMPTS = {
    "copy a class": '''class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"


class Vector:
    def __init__(self, x, y):
''',
    "type hints": '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def diagonal(width, height):
    return (width ** 2 + height ** 2) ** 0.5

# The same three functions, with type hints:
def area(width: float, height: float) -> float:
''',
    "rename": '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax

# The same function with `items` renamed to `cart`:
def total_price(cart, tax_rate):
''',
    "add a field": '''class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point(x={self.x}, y={self.y})"

# The same class with a third coordinate z:
class Point:
''',
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")
# Qwen2.5-Instruct's template shape: a default system turn when none is given, then ChatML.
CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LM_HEAD_GAIN = 3.0  # lm_head and embedding std 3/sqrt(hidden): logits std ~3 (see the docstring)
BIAS_STD = 0.1
NORM_JITTER = 0.1  # norm weights 1 + N(0, 0.1): not all ones, so a missed norm weight shows

_CORPUS_LINES = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import numpy as np\nx = np.zeros((4, 4), dtype=np.float32)\n",
    "if value is None:\n    raise ValueError('value must not be None')\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "A paged cache stores keys and values in pages of sixteen tokens.\n",
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9, \u00fcber gro\u00df.\n",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c\u3002\n",
    "Emoji: \U0001f642 \U0001f680 \u2728 and math: \u03b1 + \u03b2 = \u03b3.\n",
    "while left < right:\n    mid = (left + right) // 2\n",
    "with open(path) as f:\n    data = f.read()\n",
)


def _corpus() -> list[str]:
    """A few KB of fixed text: code, prose and multi-byte characters, varied by index."""
    return [line.replace("10", str(7 * n)).replace("x", "xyz"[n % 3]) for n in range(16) for line in _CORPUS_LINES]


def make_tokenizer(vocab_size: int = DEFAULT_CONFIG["vocab_size"]):
    """A byte-level BPE with at most `vocab_size` ids; the special tokens take the last ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # after training, so they get the last ids
    return tok


def make_tokenizer_files(vocab_size: int = DEFAULT_CONFIG["vocab_size"],
                         model_max_length: int = DEFAULT_CONFIG["max_position_embeddings"]) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json of `make_tokenizer`, as a checkpoint ships them."""
    tok = make_tokenizer(vocab_size)
    config = json.dumps(_tokenizer_config(tok, model_max_length), indent=2, ensure_ascii=False)
    return {"tokenizer.json": tok.to_str(pretty=True).encode(), "tokenizer_config.json": config.encode()}


def _tokenizer_config(tok, model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",  # as in Qwen2.5-Instruct
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }


def _hf_config(config: ModelConfig):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,  # transformers 5 moves it into config.rope_parameters
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        architectures=["Qwen2ForCausalLM"],
        attn_implementation="eager",
    )


def make_hf_checkpoint(directory, *, seed: int = 0, tokenizer: bool = True, **config_overrides) -> Path:
    """Write a random Qwen2 checkpoint into `directory`; overrides use ModelConfig's field names."""
    import torch
    from transformers import Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    unknown = set(config_overrides) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"unknown config fields {sorted(unknown)}; choose from {sorted(DEFAULT_CONFIG)}")
    config = ModelConfig(**{**DEFAULT_CONFIG, **config_overrides})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(seed)
    model = Qwen2ForCausalLM(_hf_config(config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                std = LM_HEAD_GAIN / np.sqrt(config.hidden_size)
            elif name.endswith("norm.weight"):
                param.copy_(torch.from_numpy(1 + NORM_JITTER * rng.standard_normal(param.shape, dtype=np.float32)))
                continue
            elif name.endswith(".bias"):
                std = BIAS_STD
            else:  # a projection [out, in]
                std = 1 / np.sqrt(param.shape[1])
            param.copy_(torch.from_numpy(std * rng.standard_normal(param.shape, dtype=np.float32)))
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a progress bar per tiny checkpoint is noise in test logs
    try:
        model.to(torch.bfloat16).save_pretrained(directory)  # Qwen2.5 ships bfloat16 safetensors
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()

    if tokenizer:
        for name, data in make_tokenizer_files(config.vocab_size, config.max_position_embeddings).items():
            (directory / name).write_bytes(data)
    return directory


def make_nanoqwen(directory, name: str = "model.nanoqwen", *, seed: int = 0, tokenizer: bool = True,
                  **config_overrides) -> Path:
    """`make_hf_checkpoint` into `directory/hf`, then convert it to `directory/name`."""
    from .convert import convert

    directory = Path(directory)
    checkpoint = make_hf_checkpoint(directory / "hf", seed=seed, tokenizer=tokenizer, **config_overrides)
    out = directory / name
    convert(str(checkpoint), out, progress=False)
    return out


def reference_model(model: Model):
    """transformers' Qwen2ForCausalLM in fp32 holding `model`'s weights, INT4 ones dequantized.

    Both sides then share the exact same weights, so any difference between this and a
    nanoqwen backend comes from the engine (its fp16 activations), not from quantization.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    def tensor(array: np.ndarray):
        return torch.from_numpy(np.asarray(array, dtype=np.float32).copy())

    c = model.config
    state = {
        "model.embed_tokens.weight": tensor(model.embed),
        "model.norm.weight": tensor(model.final_norm),
        "lm_head.weight": tensor(model.lm_head),
    }
    for i in range(c.num_layers):
        layer = model.layer(i)
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = tensor(layer.input_norm)
        state[f"{p}.post_attention_layernorm.weight"] = tensor(layer.post_norm)
        for module, names in (("self_attn", ("q", "k", "v", "o")), ("mlp", ("gate", "up", "down"))):
            for proj in names:
                linear = getattr(layer, proj)
                state[f"{p}.{module}.{proj}_proj.weight"] = tensor(dequantize_int4(linear.qweight, linear.scales))
                if linear.bias is not None:
                    state[f"{p}.{module}.{proj}_proj.bias"] = tensor(linear.bias)
    reference = Qwen2ForCausalLM(_hf_config(c)).to(torch.float32)
    reference.load_state_dict(state, strict=True)
    return reference.eval()



# ---------------------------------------------------------------------- the fp16 rounding bound
#
# How far may a correct engine's logits be from the fp32 reference? The engine rounds to fp16 at
# fixed points of the forward pass (ARCHITECTURE.md, "Numerics"): each norm's output, K and V as
# stored, the attention output into o_proj and silu(gate) * up into down_proj; the CUDA backend's
# prefill also multiplies with fp16 copies of the weights. Each rounding is a relative perturbation
# of size ~u = 2^-11, but what it does to the logits depends on the gains of everything after it:
# the softmax amplifies a perturbation of q or k by the scale of the attention scores, SwiGLU by
# its activations' spread, and the residual stream carries an early layer's error into every later
# one. Models whose layers have unit gain keep the sum of those effects near u * sqrt(#roundings);
# weights of fixed size (trained ones, or nanoqwen.random_model's) do not. So the bound is measured
# on the model itself: the reference runs a second time with first-order noise of each rounding's
# own size injected where the engine rounds (`rounding_noise`), and a step's logits may be off by at
# most ROUNDING_TOLERANCE_FACTOR times the rms of that perturbation's effect. The factor covers the
# largest of ~150k errors against their rms (measured 4.9-7.2 over the 0.5B to 14B shapes, 1 to 48
# layers), not a shape: a real bug (a wrong page, position or split) moves logits by O(rms(logits)).
ROUNDING_TOLERANCE_FACTOR = 12


def fp16_relative_rms(tensor) -> float:
    """rms(fp16(t) - t) / rms(t): the relative size of rounding `tensor` to fp16."""
    t = tensor.detach().float()
    scale = float(t.pow(2).mean().sqrt())
    return float((t.half().float() - t).pow(2).mean().sqrt()) / scale if scale > 0 else 0.0


class rounding_noise:
    """A context in which `reference` (a Qwen2ForCausalLM in fp32) computes with first-order fp16
    rounding noise where the engine rounds: v -> v (1 + fp16_relative_rms(v) xi), xi ~ N(0, 1)
    drawn from `seed`, on the outputs of the norms and of k_proj and v_proj (cached, so the noise
    stays with the positions as the engine's fp16 K/V does) and on the inputs of o_proj and
    down_proj. With `prefill_weights_fp16` (the CUDA backend), every projection of a call over
    several tokens also adds the effect of fp16 weights: fp16_relative_rms(W) sqrt(x^2 (W^2)^T) xi."""

    def __init__(self, reference, seed: int = 0, prefill_weights_fp16: bool = False):
        import torch

        self.reference, self.prefill_weights_fp16 = reference, prefill_weights_fp16
        device = next(reference.parameters()).device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.handles = []

    def _noise_like(self, tensor):
        import torch

        return torch.randn(tensor.shape, generator=self.generator, device=tensor.device, dtype=tensor.dtype)

    def _rounded(self, tensor):
        return tensor * (1 + fp16_relative_rms(tensor) * self._noise_like(tensor))

    def __enter__(self):
        model = self.reference.model
        on_output = lambda module, args, output: self._rounded(output)  # noqa: E731
        on_input = lambda module, args: (self._rounded(args[0]), *args[1:])  # noqa: E731
        for layer in model.layers:
            for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.k_proj,
                           layer.self_attn.v_proj):
                self.handles.append(module.register_forward_hook(on_output))
            for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
                self.handles.append(module.register_forward_pre_hook(on_input))
            if self.prefill_weights_fp16:
                for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                               layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                    self.handles.append(module.register_forward_hook(self._fp16_weights))
        self.handles.append(model.norm.register_forward_hook(on_output))
        return self

    def _fp16_weights(self, module, args, output):
        x = args[0]
        if x.shape[-2] == 1:  # a decode step: the engine's GEMVs read the INT4 weights themselves
            return output
        spread = (x.pow(2) @ module.weight.pow(2).T).sqrt()
        return output + fp16_relative_rms(module.weight) * spread * self._noise_like(output)

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def rounding_tolerance(reference_logits: np.ndarray, perturbed_logits: np.ndarray,
                       factor: float = ROUNDING_TOLERANCE_FACTOR) -> float:
    """The largest logit error a correct engine may show at a step: `factor` times the rms of what
    first-order fp16 rounding noise did to the reference's logits there (`rounding_noise`)."""
    difference = np.asarray(perturbed_logits, np.float64) - np.asarray(reference_logits, np.float64)
    return factor * float(np.sqrt(np.mean(difference * difference)))
