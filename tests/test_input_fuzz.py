"""Fuzz the files a checkpoint's author writes besides the tensors: tokenizer.json,
tokenizer_config.json (both travel inside a .nanoqwen file) and config.json.

test_loader_fuzz.py corrupts the .nanoqwen structure; this corrupts what it carries. Each
generated file must be either used or refused with nanoqwen's own error naming it: never
another exception, a Rust panic, a hang or an abort. A tokenizer that builds must then encode,
decode and render chats with nothing worse than a GenerationError.
"""

from __future__ import annotations

import base64
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoqwen.config import ModelConfig
from nanoqwen.convert import read_config
from nanoqwen.errors import CheckpointError, ConfigError, GenerationError, NanoqwenFormatError
from nanoqwen.testing import make_tokenizer_files
from nanoqwen.tokenizer import Tokenizer

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SECONDS_PER_FILE = 10  # building, encoding samples, rendering two chats: milliseconds when all is well

BASE = {name: json.loads(data) for name, data in make_tokenizer_files().items()}
SAMPLES = ["", "def f(x):\n    return x ** 2\n", "caf\u00e9 \u65e5\u672c \U0001f642 \t\r\n  ", "<|im_end|><|fim_middle|>x",
           "a" * 3000 + "b", "[UNK] ## \u2581 \u0120"]
MESSAGES = [{"role": "system", "content": "be <|im_end|> brief"}, {"role": "user", "content": "hi\n\n"}]

text = st.text(max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
counts = st.integers(0, 8) | st.integers(0, 2**64)
regexes = st.sampled_from(["\\s+", "(a+)+$", "(?:a|a)*$", "", "(", "[^\\p{L}]", "\\p{N}{1,3}", "'s|'t| ?\\p{L}+"]) | text
patterns = st.builds(lambda kind, value: {kind: value}, st.sampled_from(["String", "Regex"]), regexes)
normalizers = st.recursive(
    st.sampled_from([{"type": t} for t in ("NFC", "NFD", "NFKC", "Lowercase", "Nmt", "StripAccents")])
    | st.builds(lambda s, l, r: {"type": "Strip", "strip_left": l, "strip_right": r}, text, st.booleans(), st.booleans())
    | st.builds(lambda p, c: {"type": "Replace", "pattern": p, "content": c}, patterns, text)
    | st.builds(lambda p: {"type": "Prepend", "prepend": p}, text)
    | st.builds(lambda raw: {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(raw).decode()}, st.binary(max_size=40)),
    lambda inner: st.builds(lambda items: {"type": "Sequence", "normalizers": items}, st.lists(inner, max_size=3)),
    max_leaves=4,
)
behaviors = st.sampled_from(["Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous", "Nope"])
pre_tokenizers = st.recursive(
    st.sampled_from([{"type": t} for t in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer", "UnicodeScripts")])
    | st.builds(lambda p, b, i: {"type": "Split", "pattern": p, "behavior": b, "invert": i}, patterns, behaviors, st.booleans())
    | st.builds(lambda r, s, split: {"type": "Metaspace", "replacement": r, "prepend_scheme": s, "split": split},
                st.characters(), st.sampled_from(["always", "never", "first", "sometimes"]), st.booleans())
    | st.builds(lambda d: {"type": "Digits", "individual_digits": d}, st.booleans())
    | st.builds(lambda b: {"type": "Punctuation", "behavior": b}, behaviors)
    | st.builds(lambda a, r: {"type": "ByteLevel", "add_prefix_space": a, "trim_offsets": True, "use_regex": r},
                st.booleans(), st.booleans()),
    lambda inner: st.builds(lambda items: {"type": "Sequence", "pretokenizers": items}, st.lists(inner, max_size=3)),
    max_leaves=4,
)
decoders = st.sampled_from([{"type": t} for t in ("ByteFallback", "Fuse", "BPEDecoder")]) | st.builds(
    lambda c, start, stop: {"type": "Strip", "content": c, "start": start, "stop": stop}, st.characters(), counts, counts
) | st.builds(lambda p, c: {"type": "Replace", "pattern": p, "content": c}, patterns, text) | st.builds(
    lambda p, c: {"type": "WordPiece", "prefix": p, "cleanup": c}, text, st.booleans())
small_vocab = st.dictionaries(text, st.integers(0, 600) | st.integers(0, 2**40), max_size=6)
models = (
    st.builds(lambda v, u, m: {"type": "WordPiece", "vocab": v, "unk_token": u, "continuing_subword_prefix": "##",
                               "max_input_chars_per_word": m}, small_vocab, text, counts)
    | st.builds(lambda v, u: {"type": "WordLevel", "vocab": v, "unk_token": u}, small_vocab, text)
    | st.builds(lambda v, u, b: {"type": "Unigram", "unk_id": u, "vocab": v, "byte_fallback": b},
                st.lists(st.tuples(text, st.floats(-50, 0)).map(list), max_size=6), st.none() | counts, st.booleans())
    | st.builds(lambda d, b, i: {**BASE["tokenizer.json"]["model"], "dropout": d, "byte_fallback": b, "ignore_merges": i},
                st.none() | st.floats(0, 1), st.booleans(), st.booleans())
)
added_tokens = st.lists(st.fixed_dictionaries({
    "id": st.integers(0, 600) | counts, "content": text, "single_word": st.booleans(), "lstrip": st.booleans(),
    "rstrip": st.booleans(), "normalized": st.booleans(), "special": st.booleans()}), max_size=4)
truncations = st.fixed_dictionaries({"direction": st.sampled_from(["Left", "Right"]), "max_length": counts,
                                     "strategy": st.sampled_from(["LongestFirst", "OnlyFirst"]), "stride": counts})
paddings = st.fixed_dictionaries({"strategy": st.sampled_from(["BatchLongest"]) | st.builds(lambda n: {"Fixed": n}, counts),
                                  "direction": st.sampled_from(["Left", "Right"]), "pad_to_multiple_of": st.none() | counts,
                                  "pad_id": counts, "pad_type_id": counts, "pad_token": text})
post_processors = st.builds(lambda a, t: {"type": "ByteLevel", "add_prefix_space": a, "trim_offsets": t, "use_regex": True},
                            st.booleans(), st.booleans()) | st.builds(
    lambda single, tokens: {"type": "TemplateProcessing", "single": single, "pair": single, "special_tokens": tokens},
    st.lists(st.fixed_dictionaries({"SpecialToken": st.fixed_dictionaries({"id": text, "type_id": counts})})
             | st.fixed_dictionaries({"Sequence": st.fixed_dictionaries({"id": st.sampled_from(["A", "B"]), "type_id": counts})}),
             max_size=3),
    st.dictionaries(text, st.fixed_dictionaries({"id": text, "ids": st.lists(counts, max_size=2), "tokens": st.lists(text, max_size=2)}),
                    max_size=2))
TOKENIZER_PARTS = {"normalizer": normalizers, "pre_tokenizer": pre_tokenizers, "decoder": decoders, "model": models,
                   "added_tokens": added_tokens, "truncation": truncations, "padding": paddings,
                   "post_processor": post_processors}
# Mostly well-formed parts with odd values (they reach the library's deeper code), sometimes junk.
tokenizer_changes = st.lists(st.sampled_from(sorted(TOKENIZER_PARTS)), min_size=1, max_size=3, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({key: st.one_of(*[TOKENIZER_PARTS[key]] * 3, json_values) for key in keys}))

template_pieces = st.sampled_from([
    "{% for m in messages %}", "{% endfor %}", "{{ m['content'] }}", "{{ m.role|upper }}", "{{ m['content']|trim }}",
    "{% if add_generation_prompt %}", "{% endif %}", "<|im_start|>", "<|im_end|>", "\n", "{{ eos_token }}",
    "{{ bos_token }}", "{{ messages|tojson }}", "{{ raise_exception('refused') }}", "{{ 1 / 0 }}", "{{ nothing.here }}",
    "{{ ''.__class__.__mro__ }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ m['content'][::-1] }}",
    "{% set x = 'ab' * 3 %}{{ x }}", "{{ range(5)|list }}", "{% for i in range(100000) %}{% endfor %}", "{%- ", " -%}",
    "{{ (messages|length) ** 5 }}", "{% break %}", "{{ m['content'].split('<') }}", "{{ messages[0]['content'][:2] }}",
])
templates = st.lists(template_pieces, max_size=10).map("".join)
token_names = st.none() | text | st.fixed_dictionaries({"content": json_values}) | json_values
config_changes = st.fixed_dictionaries({}, optional={
    "chat_template": templates | json_values
    | st.lists(st.fixed_dictionaries({"name": st.sampled_from(["default", "tool_use"]) | text, "template": templates | json_values}),
               max_size=2),
    "eos_token": token_names, "bos_token": token_names, "model_max_length": json_values, "extra": json_values,
})


def exercise(data: dict[str, bytes]) -> None:
    """Build a tokenizer from `data` and use it; only nanoqwen's errors may come out."""
    start = time.perf_counter()
    try:
        tokenizer = Tokenizer.from_files(data, source="fuzz.nanoqwen")
    except NanoqwenFormatError as e:
        assert str(e).startswith("fuzz.nanoqwen: tokenizer blob 'tokenizer/tokenizer")
        return
    for sample in SAMPLES:
        for encode in (tokenizer.encode, tokenizer.encode_literal):
            try:
                tokenizer.decode(encode(sample))
            except GenerationError:
                pass
    for use in (lambda: tokenizer.chat_token_ids(MESSAGES), lambda: tokenizer.chat_token_ids(MESSAGES[1:], False, True),
                lambda: tokenizer.fim_token_ids("def f(", "<|fim_middle|>"), lambda: tokenizer.stop_token_ids):
        try:
            use()
        except GenerationError:
            pass
    assert time.perf_counter() - start < SECONDS_PER_FILE


def blobs(tokenizer_json=None, config_json=None) -> dict[str, bytes]:
    def encoded(value, base):
        return value if isinstance(value, bytes) else json.dumps(value if value is not None else base).encode()

    return {"tokenizer.json": encoded(tokenizer_json, BASE["tokenizer.json"]),
            "tokenizer_config.json": encoded(config_json, BASE["tokenizer_config.json"])}


@FUZZ
@given(tokenizer_changes)
def test_fuzzed_tokenizer_json(changes):
    exercise(blobs({**BASE["tokenizer.json"], **changes}))


@FUZZ
@given(config_changes)
def test_fuzzed_tokenizer_config_json(changes):
    exercise(blobs(config_json={**BASE["tokenizer_config.json"], **changes}))


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()), st.booleans())
def test_arbitrary_bytes_as_either_blob(data, as_config):
    exercise(blobs(config_json=data) if as_config else blobs(tokenizer_json=data))


# ---- config.json ----

HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu", "use_sliding_window": False, "rope_scaling": None,
}
numbers = st.integers(-(2**70), 2**70) | st.integers(0, 4096) | st.floats() | st.integers(2**31, 2**33)
config_json_changes = st.dictionaries(st.sampled_from(sorted(HF_CONFIG) + ["rope_parameters", "other"]),
                                      numbers | json_values, min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(config_json_changes, st.sets(st.sampled_from(sorted(HF_CONFIG)), max_size=2))
def test_fuzzed_config_json_is_a_config_or_a_config_error(changes, removed):
    hf = {key: value for key, value in {**HF_CONFIG, **changes}.items() if key not in removed}
    try:
        config = ModelConfig.from_hf(hf)
    except ConfigError:
        return
    assert isinstance(config, ModelConfig) and config.num_layers < 2**32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("config")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300) | config_json_changes.map(lambda c: json.dumps({**HF_CONFIG, **c}).encode())
       | st.integers(30, 3000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth))
def test_fuzzed_config_json_file_is_read_or_refused_naming_it(checkpoint, data):
    (checkpoint / "config.json").write_bytes(data)
    try:
        read_config(checkpoint)
    except CheckpointError as e:
        assert str(e).startswith(f"{checkpoint / 'config.json'}: ")
