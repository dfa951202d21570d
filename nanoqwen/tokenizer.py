"""The tokenizer that travels inside a .nanoqwen file, its chat template, and FIM prompts.

The converter copies Hugging Face's `tokenizer.json` (the whole BPE pipeline: normalizer,
pre-tokenizer, merges, decoder, special tokens) and `tokenizer_config.json` (the chat
template and the names of the special tokens) into the file as byte blobs. Here the first
goes to `tokenizers.Tokenizer.from_str` and the second's Jinja chat template is rendered with
jinja2 the way transformers renders it, so a model file needs nothing else beside it.

Both blobs come from whoever made the checkpoint, so neither is trusted:

- tokenizer.json may be at most MAX_JSON_BYTES (its parser, serde_json, stops at 128 levels of
  nesting by itself); tokenizer_config.json is read by `jsonlimits.parse_json` (size and
  nesting limits) and its token names must be strings. The chat template compiles and runs
  under `nanoqwen.chat_template`'s limits on source size, time and output.
- Padding and truncation in tokenizer.json are switched off: the engine measures prompts
  against the context itself, and a `Fixed` padding of 10**9 would allocate gigabytes.
- The Rust library reports some bad files only by panicking, during construction or at the
  first encode. Every call into it goes through `nanoqwen.rust_calls.call_rust`, which turns a panic into a
  nanoqwen error, and a fixed PROBE_TEXT is encoded and decoded at construction, so a broken
  pipeline is found when the file is opened, not at the first request.

Text from users is encoded as text: `<|im_end|>` typed in a message or in a FIM suffix becomes
the ordinary tokens that spell it, and special tokens come only from the template's own text
(`chat_token_ids`, `fim_token_ids`). `encode` still matches special-token text, for callers
that wrote the text themselves. A plain or FIM prompt also gets the special tokens that
tokenizer.json's post-processor puts around a text (`around_prompt`: a BOS token where a
tokenizer has one, as transformers' `tokenizer(text)` adds it; Qwen's add none).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property, partial
from pathlib import Path

import numpy as np
import tokenizers

from .chat_template import compile_template, render
from .errors import CheckpointError, GenerationError, NanoqwenFormatError, shown
from .jsonlimits import JSONLimitError, check_json_size, parse_json
from .loader import (CHAT_TEMPLATE_JINJA, GENERATION_CONFIG_JSON, TOKENIZER_CONFIG_JSON, TOKENIZER_FILES, TOKENIZER_JSON,
                     TOKENIZER_PREFIX)
from .rust_calls import call_rust

__all__ = ["CHATML_TEMPLATE", "StreamDecoder", "Tokenizer", "check_unicode"]


# ChatML as Qwen2.5-Instruct writes it, without the default system prompt Qwen's own template
# adds. Used only when the checkpoint carries no template.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # end of a chat turn, end of a document
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
# The special tokens tokenizer_config.json names: bos and eos reach the template, eos ends generation.
TOKEN_NAME_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
MESSAGE_KEYS = frozenset({"role", "content"})
# Normalization can shorten text before the model sees it (NFC composes a Hangul syllable from
# three jamo, a third of their bytes): text is refused as too long for the context only past this
# many times what the context's tokens could spell.
NORMALIZATION_SLACK = 4
# What one token is taken to spell at most when text is measured against the context: a vocabulary
# may hold a longer token, but a token of megabytes, which only a crafted tokenizer.json holds,
# must not lift the bound on what gets encoded by as much.
MAX_TOKEN_BYTES = 1024
# Encoded and decoded once at construction: letters, digits, spaces, tabs, newlines,
# punctuation, accents, CJK and an emoji reach every stage of a tokenizer's pipeline.
PROBE_TEXT = "Hello, world! 123\n\tdef f(x):  return x ** 2  # caf\u00e9 \u65e5\u672c\u8a9e \U0001f642"


def check_unicode(text: str, what: str) -> None:
    """GenerationError naming `what` when `text` holds a lone surrogate, which UTF-8 cannot encode.

    Python decodes bytes that are not UTF-8 into such surrogates (argv, and files read with
    errors="surrogateescape"); the tokenizer takes only real Unicode text.
    """
    if not isinstance(text, str):
        raise GenerationError(f"{what} must be text (a str), got {type(text).__name__} {text!r:.60}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(
            f"{what} is not valid Unicode text: {text[e.start]!r} at character {e.start} is a lone surrogate "
            "(bytes that are not UTF-8, read as text?)"
        ) from None


# ---- reading and checking the files ----


class _FileProblem(Exception):
    """One of the tokenizer files cannot be used: `file_name` and `problem` (a phrase). Raised
    while `Tokenizer._from_files` builds a tokenizer; its callers turn it into the error that
    names the location (a model file's blob, a checkpoint's file)."""

    def __init__(self, file_name: str, problem: str):
        super().__init__(file_name, problem)
        self.file_name, self.problem = file_name, problem


def _tokenizer_json(files: Mapping[str, bytes]) -> str:
    """tokenizer.json as text, for the library's own parser (which limits nesting itself)."""
    try:
        check_json_size(len(files[TOKENIZER_JSON]))
        return files[TOKENIZER_JSON].decode("utf-8")
    except JSONLimitError as e:
        raise _FileProblem(TOKENIZER_JSON, str(e)) from None
    except UnicodeDecodeError as e:
        raise _FileProblem(TOKENIZER_JSON, f"not UTF-8 ({e})") from None


def _json_object(files: Mapping[str, bytes], name: str) -> Mapping:
    """The JSON object file `name` holds ({} when absent)."""
    if name not in files:
        return {}
    try:
        value = parse_json(files[name])
    except JSONLimitError as e:
        raise _FileProblem(name, str(e)) from None
    except UnicodeDecodeError as e:
        raise _FileProblem(name, f"not UTF-8 ({e})") from None
    except ValueError as e:
        raise _FileProblem(name, f"invalid JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise _FileProblem(name, f"a JSON {type(value).__name__}, not an object")
    return value


def _check_config_text(text: str, what: str) -> None:
    """JSON can spell a lone surrogate ("\\ud800"), which no UTF-8 text holds and the library cannot take."""
    try:
        check_unicode(text, what)
    except GenerationError:
        raise _FileProblem(TOKENIZER_CONFIG_JSON, f"{what} must be valid Unicode text, got {text!r:.80} (a lone surrogate)") from None


def _read_config(files: Mapping[str, bytes]) -> dict:
    """tokenizer_config.json as a dict ({} when absent), its token names checked."""
    config = _json_object(files, TOKENIZER_CONFIG_JSON)
    for key in TOKEN_NAME_KEYS:
        entry = config.get(key)
        if entry is not None and not isinstance(_token_name(entry), str):
            raise _FileProblem(TOKENIZER_CONFIG_JSON, f'{key} must be a string or {{"content": a string}}, got {entry!r:.80}')
        if entry is not None:
            _check_config_text(_token_name(entry), key)
    return dict(config)


def _generation_stop_ids(files: Mapping[str, bytes]) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, a token id or a list of them (none when absent)."""
    eos = _json_object(files, GENERATION_CONFIG_JSON).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _FileProblem(GENERATION_CONFIG_JSON, f"eos_token_id must be a token id or a list of them, got {eos!r:.80}")
    return tuple(ids)


def _token_name(entry) -> str | None:
    """tokenizer_config.json names a token either as a string or as {"content": ...}."""
    if isinstance(entry, Mapping):
        return entry.get("content")
    return entry


def _chat_template(files: Mapping[str, bytes], config: Mapping) -> str:
    """The chat template's source: chat_template.jinja's, which transformers reads ahead of the
    config's; else the config's, or the one called "default" of several."""
    if CHAT_TEMPLATE_JINJA in files:
        try:
            return files[CHAT_TEMPLATE_JINJA].decode("utf-8")
        except UnicodeDecodeError as e:
            raise _FileProblem(CHAT_TEMPLATE_JINJA, f"not UTF-8 ({e})") from None
    template = config.get("chat_template") or CHATML_TEMPLATE
    if not isinstance(template, str):
        try:
            templates = {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError):
            raise _FileProblem(TOKENIZER_CONFIG_JSON, "chat_template must be a string or a list of {name, template} objects") from None
        template = templates.get("default", CHATML_TEMPLATE)
        if not isinstance(template, str):
            raise _FileProblem(TOKENIZER_CONFIG_JSON, f"the default chat_template must be a string, got {template!r:.80}")
    _check_config_text(template, "chat_template")
    return template


# ---- how far the pipeline can lengthen text ----

# A pipeline step can turn one character into many: four Replace steps of `z` -> 100 `z`s turn a
# one-character prompt into 10**8, and a decoder that does the same prints megabytes for a few
# tokens. So each step's growth per character is bounded from its structure, the bounds of a
# chain multiply, and a pipeline whose bound passes MAX_EXPANSION is refused. Real pipelines stay
# far below it: Qwen2.5's encodes at most 15x (NFC 3x, then ByteLevel 5x) and decodes at 1x,
# Llama's (Prepend and Replace to "▁") 2x and 1x, BERT's 36x, NFKC with ByteLevel 90x.
MAX_EXPANSION = 256
# Growth per character of the steps that take no text from the file. The Unicode normalization
# forms' are UAX #15's maximum expansion factors; Lowercase: one character lowercases to at most
# 3; BertNormalizer: spaces around a CJK character (3x), lowercase (3x) and NFD to strip accents
# (4x); ByteLevel: a character of 4 UTF-8 bytes becomes 4, plus 1 for a prefix space before a
# one-character piece; Metaspace: a replacement for a space, plus one prepended; BPEDecoder: a
# space for its suffix, between every two characters when the suffix is empty. Steps that only
# split, remove or map one character to one grow nothing.
STEP_GROWTH = {
    "normalizer": {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 3, "BertNormalizer": 36, "ByteLevel": 4,
                   "Nmt": 1, "Strip": 1, "StripAccents": 1},
    "pre_tokenizer": {"ByteLevel": 5, "Metaspace": 2, "BertPreTokenizer": 1, "CharDelimiterSplit": 1, "Digits": 1,
                      "FixedLength": 1, "Punctuation": 1, "Split": 1, "UnicodeScripts": 1, "Whitespace": 1,
                      "WhitespaceSplit": 1},
    "decoder": {"ByteLevel": 1, "ByteFallback": 1, "CTC": 1, "Fuse": 1, "Metaspace": 1, "Strip": 1, "WordPiece": 1,
                "BPEDecoder": 2},
}
SEQUENCE_KEYS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers", "decoder": "decoders"}


def _replace_growth(step: Mapping) -> float:
    """A Replace writes `content` for each match: a String pattern's matches are as long as it, a
    Regex's may be one character, or empty (then it writes `content` before every character)."""
    content, pattern = step["content"], step["pattern"]
    if "String" in pattern:
        return max(1.0, len(content) / max(len(pattern["String"]), 1))
    return 1.0 + len(content)


def _precompiled_growth(step: Mapping) -> float:
    """A Precompiled (SentencePiece) map replaces each character, or longer match, by one of the
    NUL-separated strings after its trie: at most the longest of them per character."""
    charsmap = base64.b64decode(step["precompiled_charsmap"])
    trie_bytes = int.from_bytes(charsmap[:4], "little")
    replacements = charsmap[4 + trie_bytes :].split(b"\0")
    return max([1.0] + [len(r.decode("utf-8", "replace")) for r in replacements])


def _growth(step: Mapping, stage: str) -> float:
    """How many characters one character can become in `step`, a pipeline stage's JSON."""
    kind = step.get("type")
    if kind == "Sequence":
        return math.prod(_growth(inner, stage) for inner in step[SEQUENCE_KEYS[stage]])
    if kind == "Replace":
        return _replace_growth(step)
    if kind == "Prepend":  # once per piece between special tokens, which may be one character
        return 1.0 + len(step["prepend"])
    if kind == "Precompiled":
        return _precompiled_growth(step)
    if kind in STEP_GROWTH[stage]:
        return STEP_GROWTH[stage][kind]
    # A type this table does not know (a tokenizers release newer than this code) could grow
    # text without end: refused, rather than trusted.
    raise _FileProblem(TOKENIZER_JSON, f"its {stage} has a step of type {kind!r}, which nanoqwen cannot bound")


def _stage_growth(component, stage: str) -> float:
    return 1.0 if component is None else _growth(json.loads(component.__getstate__()), stage)


def _check_expansion(backend: tokenizers.Tokenizer) -> None:
    """Refuse a pipeline that can lengthen text more than MAX_EXPANSION times, encoding or decoding."""
    encoding = _stage_growth(backend.normalizer, "normalizer") * _stage_growth(backend.pre_tokenizer, "pre_tokenizer")
    decoding = _stage_growth(backend.decoder, "decoder")
    for operation, growth in (("encoding", encoding), ("decoding", decoding)):
        if growth > MAX_EXPANSION:
            raise _FileProblem(TOKENIZER_JSON, f"its {operation} pipeline can make each character of text up to "
                                               f"{growth:,.0f} characters, more than the {MAX_EXPANSION} nanoqwen allows")


# ---- the pipeline's three operations, as the Tokenizer and its construction-time probe run them ----


def _encoding(backend: tokenizers.Tokenizer, text: str) -> tokenizers.Encoding:
    return backend.encode(text, add_special_tokens=False)  # a prompt's BOS, if any: Tokenizer.around_prompt


def _literal_ids(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    """`_encoding` minus its first step, which cuts special-token text out: normalize, split
    into pre-tokens, and let the model encode each piece."""
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
    pre_tokenizer = backend.pre_tokenizer
    pieces = pre_tokenizer.pre_tokenize_str(normalized) if pre_tokenizer is not None else [(normalized, None)]
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def _prompt_special_ids(backend: tokenizers.Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special tokens tokenizer.json's post-processor puts before and after a text's own ids,
    which transformers' `tokenizer(text)` adds to a prompt: a BOS token where a tokenizer has
    one (Qwen's add none). transformers 5 takes the post-processor from tokenizer.json whatever
    tokenizer_config.json's add_bos_token says, for Qwen2's tokenizer class."""
    if backend.post_processor is None:
        return (), ()

    def failure(message: str) -> _FileProblem:
        return _FileProblem(TOKENIZER_JSON, f"its post-processor fails on a sample text: {message}")

    own = call_rust(failure, _encoding, backend, PROBE_TEXT).ids
    processed = call_rust(failure, partial(backend.encode, add_special_tokens=True), PROBE_TEXT).ids
    for start in range(len(processed) - len(own) + 1):
        if processed[start:start + len(own)] == own:
            return tuple(processed[:start]), tuple(processed[start + len(own):])
    raise _FileProblem(TOKENIZER_JSON, "its post-processor changes a text's own tokens, not only the special tokens "
                                       "around them")


def _decode(backend: tokenizers.Tokenizer, token_ids: list[int]) -> str:
    return backend.decode(token_ids, skip_special_tokens=False)


def _probe(backend: tokenizers.Tokenizer) -> None:
    """Run PROBE_TEXT through every operation, so that a pipeline that fails on any text fails here."""

    def failure(message: str) -> _FileProblem:
        return _FileProblem(TOKENIZER_JSON, f"it fails on a sample text: {message}")

    ids = call_rust(failure, _encoding, backend, PROBE_TEXT).ids + call_rust(failure, _literal_ids, backend, PROBE_TEXT)
    call_rust(failure, _decode, backend, ids)


def _overlaps(start: int, end: int, spans: Sequence[tuple[int, int]]) -> bool:
    return any(s < end and start < e for s, e in spans)


class Tokenizer:
    """A model file's tokenizer. Build it with `from_files` (or `from_checkpoint_files`)."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict, chat_template: str, source: str,
                 generation_stop_ids: tuple[int, ...] = (),
                 prompt_special_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())):
        """From parts `_from_files` has checked: the built library tokenizer, tokenizer_config.json's
        dict, the chat template's source, where the files came from (for error messages),
        generation_config.json's eos_token_id, and the special tokens before and after a prompt
        (`_prompt_special_ids`)."""
        self.backend = backend
        self.prompt_special_ids = prompt_special_ids
        self.config = config
        self.chat_template = chat_template
        self.source = source
        self.generation_stop_ids = generation_stop_ids
        self._template = None  # compiled at the first chat: a broken template fails only chats
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        # The most tokens a text may need, set by whoever knows the context (None: no limit).
        # Text that cannot fit is refused before encoding: 20 MB take seconds and gigabytes.
        self.max_tokens: int | None = None

    @classmethod
    def from_files(cls, files: Mapping[str, bytes], source: str = "model file") -> Tokenizer | None:
        """From the blobs of a .nanoqwen (`Model.tokenizer_files`); None if it has no tokenizer.

        A blob nanoqwen cannot use raises NanoqwenFormatError naming `source` (the file's path)
        and the blob.
        """
        try:
            return cls._from_files(files, source)
        except _FileProblem as e:
            raise NanoqwenFormatError(f"{source}: tokenizer blob '{TOKENIZER_PREFIX}{e.file_name}' is corrupt: {e.problem}") from None

    @classmethod
    def from_checkpoint_files(cls, files: Mapping[str, bytes], directory: str | os.PathLike) -> Tokenizer | None:
        """As `from_files`, for the files of a checkpoint `directory`: CheckpointError names the file."""
        try:
            return cls._from_files(files, str(directory))
        except _FileProblem as e:
            raise CheckpointError(f"{Path(directory) / e.file_name}: {e.problem}") from None

    @classmethod
    def _from_files(cls, files: Mapping[str, bytes], source: str) -> Tokenizer | None:
        if TOKENIZER_JSON not in files:
            return None
        tokenizer_json = _tokenizer_json(files)
        config = _read_config(files)
        chat_template = _chat_template(files, config)
        generation_stop_ids = _generation_stop_ids(files)
        backend = call_rust(partial(_FileProblem, TOKENIZER_JSON), tokenizers.Tokenizer.from_str, tokenizer_json)
        backend.no_padding()
        backend.no_truncation()
        _check_expansion(backend)  # before the probe, which such a pipeline would keep busy for minutes
        _probe(backend)
        return cls(backend, config, chat_template, source, generation_stop_ids, _prompt_special_ids(backend))

    def _failure(self, operation: str) -> Callable[[str], GenerationError]:
        return lambda message: GenerationError(f"the tokenizer of {self.source} cannot {operation} this text: {message}")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def largest_token_id(self) -> int:
        """The largest id the tokenizer can produce (-1 for an empty vocabulary)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)

    @cached_property
    def longest_token_bytes(self) -> int:
        """The UTF-8 length of the vocabulary's longest token, at least what it spells of the text
        (a ByteLevel token's characters stand for a byte each, "▁" for a space, "<0x41>" for one
        byte), and at most MAX_TOKEN_BYTES."""
        vocabulary = self.backend.get_vocab(with_added_tokens=True)
        return min(max((len(token.encode("utf-8")) for token in vocabulary), default=1), MAX_TOKEN_BYTES)

    @property
    def max_text_bytes(self) -> int | None:
        """The most UTF-8 bytes of text an encode accepts (None: no context set): what max_tokens of
        the longest token spell, NORMALIZATION_SLACK times over."""
        return None if self.max_tokens is None else self.max_tokens * self.longest_token_bytes * NORMALIZATION_SLACK

    def _check_fits(self, text: str) -> None:
        if self.max_tokens is None:
            return
        spelled = self.max_tokens * self.longest_token_bytes
        if 4 * len(text) <= self.max_text_bytes:  # UTF-8 spends at most 4 bytes a character
            return  # fits without encoding the text a second time (check_unicode has just encoded it)
        size = len(text.encode("utf-8"))
        if size > self.max_text_bytes:
            raise GenerationError(
                f"the text has {size:,} bytes of UTF-8, more than {self.max_tokens:,} tokens can hold: a token of "
                f"this vocabulary spells at most {self.longest_token_bytes} bytes, so {self.max_tokens:,} tokens "
                f"spell at most {spelled:,} (text is refused past {NORMALIZATION_SLACK} times that, room for "
                "normalization to shorten it)"
            )

    def token_id(self, token: str) -> int | None:
        check_unicode(token, "the token name")
        return call_rust(self._failure("look up"), self.backend.token_to_id, token)

    # ---- text to ids ----

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special-token text in it matched as special tokens (text the caller wrote)."""
        return self._encoding(text).ids

    def _encoding(self, text: str) -> tokenizers.Encoding:
        check_unicode(text, "the text")
        self._check_fits(text)
        return call_rust(self._failure("encode"), _encoding, self.backend, text)

    def encode_literal(self, text: str) -> list[int]:
        """Ids of `text` as plain text: special-token text in it stays the ordinary tokens that spell it."""
        check_unicode(text, "the text")
        self._check_fits(text)
        return call_rust(self._failure("encode"), _literal_ids, self.backend, text)

    def around_prompt(self, token_ids: Sequence[int]) -> list[int]:
        """A plain or fill-in-the-middle prompt's ids with the special tokens that transformers'
        `tokenizer(text)` adds around them (`prompt_special_ids`); a chat template writes its own."""
        before, after = self.prompt_special_ids
        return [*before, *token_ids, *after]

    def decode(self, token_ids: Iterable[int]) -> str:
        """The text of `token_ids`. An id past the tokenizer's vocabulary spells nothing, as in
        transformers: a model's embedding has rows beyond it (Qwen2.5's 152,064 for 151,665 tokens)."""
        try:
            ids = list(token_ids)
        except TypeError:
            raise GenerationError(f"decode takes token ids, got {token_ids!r:.60}") from None
        for token_id in ids:
            if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)) or token_id < 0:
                raise GenerationError(f"decode takes non-negative integer token ids, got {shown(token_id)}")
        return self._decode_sampled([int(i) for i in ids if i < 2**32])  # the library's ids are 32-bit

    def _decode_sampled(self, token_ids: list[int]) -> str:
        """`decode` for ids the engine sampled, already ints of the model's vocabulary: StreamDecoder's
        two calls per token skip the per-id check."""
        return call_rust(self._failure("decode"), _decode, self.backend, token_ids)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """<|im_end|>, <|endoftext|> and the config's eos_token, those this vocabulary has, and the
        ids generation_config.json's eos_token_id names (transformers' generate stops at those)."""
        names = list(STOP_TOKENS) + [_token_name(self.config.get("eos_token"))]
        ids = [self.token_id(name) for name in names if name] + list(self.generation_stop_ids)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def _special_token_in(self, text: str) -> str | None:
        """The first special token that `text` spells, if any."""
        for token_id in self.encode(text):
            if token_id in self._added_ids:
                return self.backend.id_to_token(token_id)
        return None

    # ---- chat ----

    def chat_prompt(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the chat template; messages are {"role": ..., "content": ...} dicts of strings."""
        _check_messages(messages)
        return self._render(messages, add_generation_prompt)

    def compiled_template(self):
        """The chat template, compiled at the first call; GenerationError when it does not compile."""
        if self._template is None:
            self._template = _run_template(compile_template, self.chat_template)
        return self._template

    def _render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        return _run_template(
            render,
            self.compiled_template(),
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_name(self.config.get("bos_token")) or "",
            eos_token=_token_name(self.config.get("eos_token")) or "",
        )

    def chat_token_ids(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                       allow_special_tokens: bool = False) -> list[int]:
        """Ids of the rendered conversation: special tokens where the template wrote them, and each
        message's content as plain text (unless `allow_special_tokens`: then as `encode` sees it).

        The template is rendered twice, once as is and once with every content between two random
        markers, which say where the contents lie in the prompt. When no special token falls
        inside a content the ids are `encode`'s, exactly what transformers produces; otherwise the
        prompt is cut at the template's special tokens and the text between them encoded as text.
        """
        if allow_special_tokens:
            return self.encode(self.chat_prompt(messages, add_generation_prompt))
        _check_messages(messages)
        self._check_message_structure(messages)
        text = self._render(messages, add_generation_prompt)
        encoding = self._encoding(text)
        spans = self._content_spans(messages, add_generation_prompt, text)
        if spans is None:  # the template rewrites contents: their place in the prompt is unknown
            for i, message in enumerate(messages):
                if token := self._special_token_in(message["content"]):
                    raise GenerationError(
                        f"chat message {i} spells the special token {token!r}, and this chat template rewrites "
                        "message content, so it cannot be kept as plain text; remove it, or pass "
                        "allow_special_tokens=True to let it act as a special token"
                    )
            return encoding.ids
        structural = [(token_id, start, end) for token_id, (start, end) in zip(encoding.ids, encoding.offsets)
                      if token_id in self._added_ids and not _overlaps(start, end, spans)]
        if len(structural) == sum(token_id in self._added_ids for token_id in encoding.ids):
            return encoding.ids
        ids, position = [], 0
        for token_id, start, end in structural:
            ids += self.encode_literal(text[position:start])
            ids.append(token_id)
            position = end
        return ids + self.encode_literal(text[position:])

    def _check_message_structure(self, messages: Sequence[Mapping[str, str]]) -> None:
        """Refuse what would reach the template as structure: a role that spells a special token,
        keys beyond role and content."""
        for i, message in enumerate(messages):
            if extra := sorted(set(message) - MESSAGE_KEYS):
                raise GenerationError(
                    f"chat message {i} has keys {extra} besides 'role' and 'content'; they would reach the "
                    "template as trusted text: pass allow_special_tokens=True to send them"
                )
            if token := self._special_token_in(message["role"]):
                raise GenerationError(f"chat message {i}: role {message['role']!r:.80} spells the special token {token!r}")

    def _content_spans(self, messages, add_generation_prompt: bool, text: str) -> list[tuple[int, int]] | None:
        """[start, end) of each non-empty content in `text`, the rendered prompt; None when the
        template does not copy contents verbatim (the markers then do not frame them)."""
        nonce = secrets.token_hex(8)
        opening, closing = f"\ue000{nonce}<\ue000", f"\ue000{nonce}>\ue000"
        marked = [{**message, "content": opening + message["content"] + closing} if message["content"] else message
                  for message in messages]
        rendered = self._render(marked, add_generation_prompt)
        spans, pieces, start, length, last = [], [], None, 0, 0
        for marker in re.finditer(f"{re.escape(opening)}|{re.escape(closing)}", rendered):
            pieces.append(rendered[last : marker.start()])
            length += marker.start() - last
            last = marker.end()
            if (marker.group() == opening) != (start is None):
                return None  # markers out of order: the template cut or reordered a content
            if start is None:
                start = length
            else:
                spans.append((start, length))
                start = None
        pieces.append(rendered[last:])
        return spans if start is None and "".join(pieces) == text else None

    # ---- fill in the middle ----

    def fim_prompt(self, prefix: str, suffix: str) -> str:
        """Fill-in-the-middle: the model writes what goes between `prefix` and `suffix`."""
        missing = [t for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE) if self.token_id(t) is None]
        if missing:
            raise GenerationError(f"this tokenizer has no fill-in-the-middle tokens {missing}")
        return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"

    def fim_token_ids(self, prefix: str, suffix: str, allow_special_tokens: bool = False) -> list[int]:
        """Ids of `fim_prompt`: the three markers as special tokens, prefix and suffix as plain
        text (unless `allow_special_tokens`)."""
        text = self.fim_prompt(prefix, suffix)
        self._check_fits(text)  # prefix and suffix together
        if allow_special_tokens:
            return self.encode(text)
        marker = self.token_id
        return [marker(FIM_PREFIX), *self.encode_literal(prefix), marker(FIM_SUFFIX), *self.encode_literal(suffix),
                marker(FIM_MIDDLE)]


def _run_template(function, *args, **kwargs):
    """`function(*args, **kwargs)`, one of nanoqwen.chat_template's; jinja2's errors become GenerationError."""
    try:
        return function(*args, **kwargs)
    except GenerationError:
        raise
    except Exception as e:  # jinja2's syntax, undefined-variable and sandbox errors
        raise GenerationError(f"the tokenizer's chat template failed: {type(e).__name__}: {e}") from e


def _check_messages(messages: Sequence[Mapping[str, str]]) -> None:
    if len(messages) == 0:
        raise GenerationError("empty conversation: chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not MESSAGE_KEYS <= message.keys():
            raise GenerationError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise GenerationError(
                    f"chat message {i}: {key!r} must be a string, got {type(message[key]).__name__} "
                    f"({message!r:.80})"
                )
            check_unicode(message[key], f"chat message {i}: {key!r}")


class StreamDecoder:
    """Turn generated token ids into text pieces as they arrive, never splitting a character.

    A byte-level BPE token can end in the middle of a UTF-8 sequence (an emoji is often two or
    three tokens). Decoding token by token would print U+FFFD halves, so we decode a short
    window and emit only text that has become final: text that does not end in U+FFFD.
    `prefix` marks where the window starts (a few tokens back, so merges that change spacing
    are seen in context), `read` how far text has been emitted.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self.ids.append(token_id)
        emitted = self.tokenizer._decode_sampled(self.ids[self.prefix : self.read])
        window = self.tokenizer._decode_sampled(self.ids[self.prefix :])
        if len(window) > len(emitted) and not window.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return window[len(emitted) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        emitted = self.tokenizer._decode_sampled(self.ids[self.prefix : self.read])
        rest = self.tokenizer._decode_sampled(self.ids[self.prefix :])[len(emitted) :]
        self.prefix = self.read = len(self.ids)
        return rest
