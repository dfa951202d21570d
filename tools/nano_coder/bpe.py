"""nano-coder's tokenizer: a byte-level BPE built like Qwen2's, only with 8192 entries.

Qwen2's tokenizer.json uses: NFC normalization; a regex split into "pre-tokens" (words,
single digits, runs of punctuation, whitespace); a byte-level mapping (every byte becomes a
printable character, so any input is representable and there is no <unk>); BPE merges; and
special tokens matched verbatim. We build the same pipeline with Hugging Face `tokenizers`
so that one tokenizer implementation (in nanoqwen or in transformers) handles both the real
Qwen2.5-Coder-7B and nano-coder.
"""

from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

VOCAB_SIZE = 8192  # including the special tokens

# Same names and order as Qwen2.5-Coder. They are added after the BPE vocabulary, so they get
# the last ids (8186..8191), as in Qwen where <|endoftext|> is 151643, after all BPE tokens.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
]

# The pre-tokenization regex of Qwen2 (the GPT-4 "cl100k" pattern with single digits):
#   contractions | optional non-letter + letters | one digit | optional space + punctuation run
#   (+ trailing newlines) | newline runs with their leading whitespace | whitespace not
#   followed by non-space (so "    x" keeps one space with "x") | other whitespace.
# Indentation therefore becomes its own tokens, which suits Python.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# ChatML, as Qwen uses it; nano-coder is not trained on chats, but the runtime's chat path
# (and transformers' apply_chat_template) must find a template.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            # use_regex=False: the split above already did GPT-2's job; this step only maps
            # bytes to printable characters.
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts, total_chars: int | None = None) -> Tokenizer:
    """Train the BPE on an iterable of strings (uses all CPU cores inside `tokenizers`)."""
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[],  # added afterwards, so that they take the last ids
        # Start from all 256 byte symbols, so that every byte is encodable even if the sample
        # never contained it.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=total_chars)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def save_tokenizer(tok: Tokenizer, out_dir: str, model_max_length: int) -> None:
    """Write tokenizer.json and a tokenizer_config.json that transformers can load."""
    tok.save(f"{out_dir}/tokenizer.json")
    ids = special_ids(tok)
    config = {
        # The generic fast tokenizer loads tokenizer.json exactly as written. (Naming
        # "Qwen2Tokenizer" would let transformers rebuild the pipeline its own way.)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "bos_token": None,  # like Qwen: no BOS is prepended
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "errors": "replace",
    }
    with open(f"{out_dir}/tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
