"""The tokenizer that travels inside a .nanoqwen file, its chat template, and FIM prompts.

The converter copies Hugging Face's `tokenizer.json` (the whole BPE pipeline: normalizer,
pre-tokenizer, merges, decoder, special tokens) and `tokenizer_config.json` (the chat
template and the names of the special tokens) into the file as byte blobs. Here the first
goes to `tokenizers.Tokenizer.from_str` and the second's Jinja chat template is rendered with
jinja2 the way transformers renders it, so a model file needs nothing else beside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import tokenizers

from .loader import TOKENIZER_PREFIX
from .errors import NanoqwenFormatError, GenerationError

__all__ = ["CHATML_TEMPLATE", "StreamDecoder", "Tokenizer"]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"

# ChatML as Qwen2.5-Instruct writes it, without the default system prompt Qwen's own template
# adds. Used only when tokenizer_config.json carries no template.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # end of a chat turn, end of a document
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"


def _token_name(entry) -> str | None:
    """tokenizer_config.json names a token either as a string or as {"content": ...}."""
    if isinstance(entry, Mapping):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


class Tokenizer:
    def __init__(self, tokenizer_json: str, config: Mapping | None = None):
        self.backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.config = dict(config or {})
        self.chat_template = self.config.get("chat_template") or CHATML_TEMPLATE
        if not isinstance(self.chat_template, str):
            # Some configs list several named templates; the one called "default" is the chat one.
            try:
                templates = {t["name"]: t["template"] for t in self.chat_template}
            except (TypeError, KeyError):
                raise GenerationError("chat_template must be a string or a list of {name, template} objects") from None
            self.chat_template = templates.get("default", CHATML_TEMPLATE)
        self._template = None

    @classmethod
    def from_files(cls, files: Mapping[str, bytes], source: str = "model file") -> Tokenizer | None:
        """From the blobs of a .nanoqwen (`Model.tokenizer_files`); None if it has no tokenizer.

        A blob that is not UTF-8 JSON of the expected kind raises NanoqwenFormatError naming
        `source` (the file's path) and the blob.
        """
        if TOKENIZER_JSON not in files:
            return None

        def fail(name: str, problem) -> NanoqwenFormatError:
            return NanoqwenFormatError(f"{source}: tokenizer blob '{TOKENIZER_PREFIX}{name}' is corrupt: {problem}")

        def text(name: str) -> str:
            try:
                return files[name].decode("utf-8")
            except UnicodeDecodeError as e:
                raise fail(name, f"not UTF-8 ({e})") from None

        config = {}
        if TOKENIZER_CONFIG_JSON in files:
            try:
                config = json.loads(text(TOKENIZER_CONFIG_JSON))
            except json.JSONDecodeError as e:
                raise fail(TOKENIZER_CONFIG_JSON, f"invalid JSON ({e})") from None
            if not isinstance(config, Mapping):
                raise fail(TOKENIZER_CONFIG_JSON, f"a JSON {type(config).__name__}, not an object")
        tokenizer_json = text(TOKENIZER_JSON)
        try:
            return cls(tokenizer_json, config)
        except GenerationError as e:
            raise fail(TOKENIZER_CONFIG_JSON, e) from None
        except Exception as e:  # tokenizers raises a bare Exception for any JSON it cannot build
            raise fail(TOKENIZER_JSON, e) from None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        # Qwen adds no BOS; special tokens written in the text (from templates) are matched.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Iterable[int]) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=False)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """<|im_end|>, <|endoftext|> and the config's eos_token: those this vocabulary has."""
        names = list(STOP_TOKENS) + [_token_name(self.config.get("eos_token"))]
        ids = [self.token_id(name) for name in names if name]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def chat_prompt(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the chat template; messages are {"role": ..., "content": ...} dicts of strings."""
        if len(messages) == 0:
            raise GenerationError("empty conversation: chat needs at least one message")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
                raise GenerationError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
            for key in ("role", "content"):
                if not isinstance(message[key], str):
                    raise GenerationError(
                        f"chat message {i}: {key!r} must be a string, got {type(message[key]).__name__} "
                        f"({message!r:.80})"
                    )
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=_token_name(self.config.get("bos_token")) or "",
                eos_token=_token_name(self.config.get("eos_token")) or "",
            )
        except GenerationError:
            raise
        except Exception as e:  # jinja2's syntax, undefined-variable and sandbox errors
            raise GenerationError(f"the tokenizer's chat template failed: {type(e).__name__}: {e}") from e

    def fim_prompt(self, prefix: str, suffix: str) -> str:
        """Fill-in-the-middle: the model writes what goes between `prefix` and `suffix`."""
        missing = [t for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE) if self.token_id(t) is None]
        if missing:
            raise GenerationError(f"this tokenizer has no fill-in-the-middle tokens {missing}")
        return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


def _compile_template(source: str):
    """A sandboxed jinja2 template with the options and helpers transformers provides."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise GenerationError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


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
        emitted = self.tokenizer.decode(self.ids[self.prefix : self.read])
        window = self.tokenizer.decode(self.ids[self.prefix :])
        if len(window) > len(emitted) and not window.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return window[len(emitted) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        emitted = self.tokenizer.decode(self.ids[self.prefix : self.read])
        rest = self.tokenizer.decode(self.ids[self.prefix :])[len(emitted) :]
        self.prefix = self.read = len(self.ids)
        return rest
