"""The model configuration: every dimension the runtime and its kernels are built for."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

GROUP_SIZE = 128  # INT4 weights share one fp16 scale per 128 input elements
PAGE_SIZE = 16  # tokens per KV-cache page
MAX_DIMENSION = 2**32 - 1  # the .nanoqwen header stores every dimension as a u32
HIDDEN_ACT = "silu"  # the MLP every backend runs: silu(gate) * up


def rope_theta_of(hf: dict) -> float:
    """RoPE's base from a config.json, which may give it in three places: top-level `rope_theta`
    (transformers 4), and `rope_parameters` or the older `rope_scaling` objects (transformers 5, which
    also nests them per attention type). Versions of transformers differ in which place wins, so
    places that disagree are refused rather than one of them picked; so is any scaling but the
    default (YaRN, linear, dynamic), which nanoqwen does not run."""
    found: dict[str, object] = {}
    if hf.get("rope_theta") is not None:
        found["rope_theta"] = hf["rope_theta"]
    for key in ("rope_parameters", "rope_scaling"):
        parameters = hf.get(key)
        if parameters is None:
            continue
        if not isinstance(parameters, dict):
            raise ConfigError(f"{key} must be an object, got {parameters!r:.80}")
        nested = [name for name, v in parameters.items() if isinstance(v, dict)]
        if nested and len(nested) < len(parameters):
            raise ConfigError(f"{key} mixes objects per attention type ({nested[0]!r:.40}) with other entries; "
                              "give one or the other")
        entries = [(f"{key}.{name}", v) for name, v in parameters.items()] if nested else [(key, parameters)]
        for where, entry in entries:
            for type_key in ("rope_type", "type"):  # transformers 5's name and the older one
                if entry.get(type_key) not in (None, "default"):
                    raise ConfigError(f"{where} asks for {entry[type_key]!r:.80} RoPE scaling; "
                                      "nanoqwen runs only the default RoPE")
            if entry.get("rope_theta") is not None:
                found[f"{where}.rope_theta"] = entry["rope_theta"]
    thetas = {}
    for where, theta in found.items():
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise ConfigError(f"{where} must be a number, got {theta!r:.80}")
        try:
            thetas[where] = float(theta)
        except OverflowError:  # a JSON integer has no size limit, a float does
            raise ConfigError(f"{where} is too large to be a float: an integer of {len(str(theta))} digits") from None
    if len(set(thetas.values())) > 1:
        places = ", ".join(f"{where}={theta:g}" for where, theta in thetas.items())
        raise ConfigError(f"config.json gives RoPE's base more than once, with different values ({places}); keep one")
    return next(iter(thetas.values()), 10000.0)


def sliding_window_layers(hf: dict) -> Sequence[int]:
    """The layers a config.json gives a sliding window, as transformers' Qwen2 reads it: none unless
    use_sliding_window and a sliding_window are set; then those `layer_types` calls
    'sliding_attention', by default the layers from max_window_layers (28) on (a range, so that a
    config.json claiming billions of layers costs nothing here)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return []
    window, positions = hf["sliding_window"], hf.get("max_position_embeddings")
    if not isinstance(window, int) or isinstance(window, bool):
        raise ConfigError(f"sliding_window must be an integer, got {window!r:.40}")
    if isinstance(positions, int) and not isinstance(positions, bool) and window >= positions:
        return []  # a window as long as the longest sequence leaves every layer full attention
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
            raise ConfigError(f"layer_types must be a list of strings, one per layer, got {layer_types!r:.80}")
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    first, layers = hf.get("max_window_layers", 28), hf.get("num_hidden_layers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (first, layers)):
        raise ConfigError(f"use_sliding_window is set with max_window_layers={first!r:.40} and "
                          f"num_hidden_layers={layers!r:.40}; both must be integers")
    return range(first, layers)


def positive_in_float32(value: float) -> bool:
    """`value` is positive and finite, and stays so rounded to float32."""
    if not 0 < value < math.inf:
        return False
    with np.errstate(over="ignore"):
        return bool(0 < np.float32(value) < np.inf)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    group_size: int = GROUP_SIZE

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{field.name} must be a positive integer, got {value!r}")
            if field.type == "int" and value > MAX_DIMENSION:
                raise ConfigError(
                    f"{field.name}={value} does not fit the .nanoqwen header's 32-bit field (at most {MAX_DIMENSION})"
                )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("hidden_size", "intermediate_size", "q_dim"):
            if getattr(self, name) % self.group_size:
                what = (f"num_heads x head_dim = {self.q_dim}" if name == "q_dim"  # o_proj's input
                        else f"{name}={getattr(self, name)}")
                raise ConfigError(
                    f"{what} is not a multiple of the INT4 group size "
                    f"{self.group_size}: every projection's input must split into whole groups"
                )
        if not positive_in_float32(self.rms_norm_eps):
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r} must be positive and finite in float32, "
                              "the precision the norms compute in")
        if not (positive_in_float32(self.rope_theta) and positive_in_float32(1 / self.rope_theta)):
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be positive, and it and its inverse finite "
                              "in float32: RoPE's frequencies, computed in float32, run from 1 to about 1 / rope_theta")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) features of each projection the engine runs per layer, q, k, v stacked
        and gate, up stacked."""
        h, i = self.hidden_size, self.intermediate_size
        return {"qkv": (self.q_dim + 2 * self.kv_dim, h), "o": (h, self.q_dim), "gate_up": (2 * i, h), "down": (h, i)}

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict, refusing anything but Qwen2.

        Every field is checked for presence and type here, so a hand-edited config.json (a
        null, a string where a number belongs) is a ConfigError naming the key.
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json must hold a JSON object, got a {type(hf).__name__}")
        architectures = hf.get("architectures", ["Qwen2ForCausalLM"])  # absent: the model type decides
        if hf.get("model_type") != "qwen2" or not isinstance(architectures, list) or "Qwen2ForCausalLM" not in architectures:
            raise ConfigError(
                "not a Qwen2 causal LM: model_type="
                f"{hf.get('model_type')!r:.80}, architectures={architectures!r:.80} "
                "(expected model_type 'qwen2' and architecture 'Qwen2ForCausalLM')"
            )
        sliding = sliding_window_layers(hf)
        if sliding:
            raise ConfigError(f"sliding-window attention is not supported (use_sliding_window, and layers "
                              f"{list(sliding[:8])} of type 'sliding_attention')")
        hidden_act = hf.get("hidden_act", HIDDEN_ACT)
        if hidden_act not in (HIDDEN_ACT, "swish"):  # transformers' two names of x * sigmoid(x)
            raise ConfigError(f"hidden_act is {hidden_act!r:.80}; nanoqwen runs only {HIDDEN_ACT!r} MLPs (silu(gate) * up)")

        def value(key: str, kinds: tuple[type, ...], what: str, default=None):
            if hf.get(key) is None:
                if default is None:
                    raise ConfigError(f"{key} is missing or null; it must be {what}")
                return default
            found = hf[key]
            if not isinstance(found, kinds) or (isinstance(found, bool) and bool not in kinds):
                raise ConfigError(f"{key} must be {what}, got {found!r:.80}")
            return found

        def integer(key: str, default=None) -> int:
            return value(key, (int,), "an integer", default)

        def as_float(key: str, found: int | float) -> float:
            try:
                return float(found)
            except OverflowError:  # a JSON integer has no size limit, a float does
                raise ConfigError(f"{key} is too large to be a float: an integer of {len(str(found))} digits") from None

        def number(key: str, default=None) -> float:
            return as_float(key, value(key, (int, float), "a number", default))

        rope_theta = rope_theta_of(hf)
        num_heads = integer("num_attention_heads")
        hidden = integer("hidden_size")
        if num_heads <= 0:
            raise ConfigError(f"num_attention_heads must be a positive integer, got {num_heads}")
        positions = integer("max_position_embeddings", 32768)  # transformers' default
        if positions < 2:  # what the engine refuses to run
            raise ConfigError(f"max_position_embeddings={positions} holds no token past a prompt's first; "
                              "a model needs at least 2 positions")
        return cls(
            num_layers=integer("num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_heads=num_heads,
            num_kv_heads=integer("num_key_value_heads", num_heads),
            head_dim=integer("head_dim", hidden // num_heads),
            vocab_size=integer("vocab_size"),
            max_position_embeddings=positions,
            rope_theta=rope_theta,
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            tie_word_embeddings=value("tie_word_embeddings", (bool,), "true or false", False),
        )

    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor a .nanoqwen file of this configuration holds: name -> (dtype, shape).

        INT4 projections appear as `<name>.qweight` (uint32 [out, in/8]) and `<name>.scales`
        (float16 [out, in/group]). Tokenizer blobs are not listed here: their size is free.
        """
        h, i, g = self.hidden_size, self.intermediate_size, self.group_size
        specs: dict[str, tuple[str, tuple[int, ...]]] = {
            "model.embed_tokens.weight": ("f16", (self.vocab_size, h)),
        }

        def int4(name: str, out_features: int, in_features: int) -> None:
            specs[f"{name}.qweight"] = ("u32", (out_features, in_features // 8))
            specs[f"{name}.scales"] = ("f16", (out_features, in_features // g))

        for layer in range(self.num_layers):
            p = f"model.layers.{layer}"
            specs[f"{p}.input_layernorm.weight"] = ("f16", (h,))
            specs[f"{p}.post_attention_layernorm.weight"] = ("f16", (h,))
            for proj, out_features in (("q", self.q_dim), ("k", self.kv_dim), ("v", self.kv_dim)):
                int4(f"{p}.self_attn.{proj}_proj", out_features, h)
                specs[f"{p}.self_attn.{proj}_proj.bias"] = ("f16", (out_features,))
            int4(f"{p}.self_attn.o_proj", h, self.q_dim)
            int4(f"{p}.mlp.gate_proj", i, h)
            int4(f"{p}.mlp.up_proj", i, h)
            int4(f"{p}.mlp.down_proj", h, i)
        specs["model.norm.weight"] = ("f16", (h,))
        if not self.tie_word_embeddings:
            specs["lm_head.weight"] = ("f16", (self.vocab_size, h))
        return specs
