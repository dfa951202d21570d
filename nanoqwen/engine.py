"""The engine: prompt in, tokens out, on whichever backend runs the model.

    engine = Engine("model.nanoqwen")                 # backend="auto": CUDA if present
    result = engine.generate("def fib(n):", max_new_tokens=64)
    for piece in engine.stream("Write a haiku", chat=True, temperature=0.7, seed=1):
        print(piece.text, end="", flush=True)

A request is: encode the prompt, reserve KV pages for prompt + max_new_tokens, *prefill* the
whole prompt in one call (its K/V go into the pages, its last logits pick the first new
token), then *decode* one token per call, each reading the cache the earlier calls wrote.
Pages are reserved up front so that the decode loop never allocates: every step is the same
work on the same buffers, which is what lets the CUDA backend replay one captured graph.

With `speculate=N` a decode pass may make several tokens: it drafts up to N from the prompt and
the tokens so far (`nanoqwen.speculative`) and the backend's `verify` checks them all in one pass
over the weights. The tokens are those plain decoding makes, in fewer passes.

Threads: one Engine may serve several. Every backend call (a prefill, a decode step) and every
page taken or returned holds the engine's lock, so calls never overlap; `generate` holds it for
its whole request, so concurrent `generate` calls run one after the other, while streams (of one
thread or of several) take turns step by step. A backend may keep work queued between the steps
of one request (the CUDA backend runs one step ahead); when another request runs in between,
that queue is dropped and the request resumes from its last token, computing the same tokens.
`close()` takes the lock too: a request running elsewhere stops at its next step with
GenerationError("engine is closed").

Prompts are text to the model, never instructions to the tokenizer: `<|im_end|>` in a prompt,
a chat message or a FIM suffix is encoded as the ordinary tokens that spell it, and special
tokens come only from the chat template and the FIM markers. `allow_special_tokens=True`
passes special-token text through as special tokens, for callers who wrote it themselves.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backends import make_backend
from .errors import (
    ContextLengthError,
    GenerationError,
    KVCacheFullError,
    shown,
)
from .kvcache import PageAllocator, pages_needed
from .loader import Model, load
from .sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams, sample
from .speculative import MAX_DRAFTS, DraftSchedule, PromptLookup
from .tokenizer import StreamDecoder, Tokenizer, check_unicode

__all__ = [
    "Engine",
    "GenerationResult",
    "Stream",
    "TokenPiece",
]

DEFAULT_MAX_CONTEXT = 4096  # tokens; the 7B allows 32768, but its KV cache would be 1.8 GB


@dataclass(frozen=True)
class TokenPiece:
    """One step of a stream: the token and the text it completes.

    `text` is "" while a multi-byte character is still unfinished (and always "" for a model
    without a tokenizer). A final piece with token_id None flushes text held back at the end.
    """

    token_id: int | None
    text: str


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated, without the stop token
    text: str | None  # None for a model without a tokenizer
    finish_reason: str  # "stop": a stop token came; "length": max_new_tokens were made
    prefill_seconds: float  # prompt in, first token chosen (time to first token)
    decode_seconds: float  # every later token
    backend: str
    seed: int | None = None  # the seed that replays a sampled run (drawn at random when none was given)
    decode_passes: int = 0  # passes over the weights after prefill: decode steps and verify passes
    drafted_tokens: int = 0  # drafts proposed to verify passes (speculate > 0)
    accepted_drafts: int = 0  # of those, the ones the model chose too

    @property
    def decode_tokens(self) -> int:
        """Tokens chosen after prefill's: every generated token but the first, and the stop token."""
        return len(self.token_ids) - 1 + (self.finish_reason == "stop")

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Decode tokens per pass over the weights: 1 without speculation, up to speculate + 1."""
        return self.decode_tokens / self.decode_passes if self.decode_passes else float("nan")


@dataclass
class _Request:
    prompt_ids: np.ndarray  # int32 [T]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    speculate: int  # drafts per verify pass; 0: one token per decode step
    result: GenerationResult | None = None
    generated: list[int] = field(default_factory=list)
    decode_passes: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    chosen: list[int] = field(default_factory=list)  # every token chosen so far, yielded or not
    upcoming: Iterator[list[int]] | None = None  # the passes generator (Engine._passes), while it owns the backend


class Stream:
    """An iterator of TokenPieces; `result` is the GenerationResult once it is exhausted."""

    def __init__(self, pieces: Iterator[TokenPiece], request: _Request):
        self._pieces = pieces
        self._request = request
        self._lock = threading.Lock()  # threads that share one stream take its pieces in turn

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> TokenPiece:
        with self._lock:
            return next(self._pieces)

    @property
    def result(self) -> GenerationResult | None:
        return self._request.result

    def close(self) -> None:
        """Stop early and give the pages back."""
        with self._lock:
            self._pieces.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Engine:
    """Runs requests on one model: `generate` (to the end) and `stream` (TokenPiece by piece).

    Thread-safe: requests from several threads serialize on the engine's lock, `generate` per
    request and streams per step (see the module docstring); `close()` waits for the step in
    progress and makes every running request end with GenerationError("engine is closed").

    The model file is memory-mapped: do not overwrite it in place (cp, truncate) while an engine
    uses it, which changes its weights mid-run or kills the process with SIGBUS; renaming a new
    file over it, as `nanoqwen convert` does, is safe.
    """

    def __init__(self, model_or_path: Model | str | os.PathLike, backend: str = "auto", max_context: int | None = None,
                 activations: str = "fp16", prefill_weights: str = "auto"):
        self._owns_model = not isinstance(model_or_path, Model)
        self._closed = False
        self._lock = threading.RLock()  # re-entered by generate's steps and by close() inside a stream
        self._owner: _Request | None = None  # the request whose queued backend work is live
        self.backend = None
        if not self._owns_model and model_or_path.closed:
            raise GenerationError(f"{model_or_path.path}: the model is closed; load it again")
        self.model = load(model_or_path) if self._owns_model else model_or_path
        try:
            self._setup(backend, max_context, activations, prefill_weights)
        except BaseException:
            self.close()
            raise

    def _setup(self, backend: str, max_context: int | None, activations: str, prefill_weights: str) -> None:
        self.config = self.model.config
        limit = self.config.max_position_embeddings
        if max_context is None:
            max_context = min(limit, DEFAULT_MAX_CONTEXT)
        if limit < 2:
            raise GenerationError(f"the model's context of {limit} position holds no token past the prompt's first "
                                  "(max_position_embeddings in its config)")
        if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or not 1 < max_context <= limit:
            raise GenerationError(f"max_context must be an integer in 2..{limit} (a prompt token and a generated one, "
                                  f"up to the model's context), got {max_context!r}")
        self.max_context = int(max_context)
        self.allocator = PageAllocator(pages_needed(self.max_context))
        # The tokenizer first: a corrupt blob should fail in milliseconds, not after a GPU upload.
        self.tokenizer = Tokenizer.from_files(self.model.tokenizer_files, source=str(self.model.path))
        if self.tokenizer is not None:  # text too long for the context is refused before it is encoded
            self.tokenizer.max_tokens = self.max_context
        self.backend = make_backend(backend, self.model, self.allocator.num_pages, activations, prefill_weights)

    def __repr__(self) -> str:
        if self._closed:
            return f"Engine({str(self.model.path)!r}, closed)"
        return f"Engine({self.model!r}, backend={self.backend.name!r}, max_context={self.max_context})"

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationError("engine is closed")

    # ---- building a request: every check happens here, before any page is taken ----

    def encode_prompt(self, prompt, chat: bool = False, fim_suffix: str | None = None,
                      allow_special_tokens: bool = False) -> list[int]:
        """Token ids for a text prompt, a list of chat messages, or token ids (checked).

        Text is encoded as text: special-token text in it stays ordinary tokens, and special
        tokens come only from the chat template and the FIM markers, unless allow_special_tokens.
        """
        self._check_open()
        for name, flag in (("chat", chat), ("allow_special_tokens", allow_special_tokens)):
            if not isinstance(flag, (bool, np.bool_)):  # "false" is truthy: no string may stand for a flag
                raise GenerationError(f"{name} must be True or False, got {flag!r:.40}")
        if chat and isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) == 0:
            raise GenerationError("empty conversation: chat needs at least one message")
        if isinstance(prompt, str) or _is_messages(prompt):
            if self.tokenizer is None:
                plain_text = isinstance(prompt, str) and not chat and fim_suffix is None
                raise GenerationError(f"{self.model.path} carries no tokenizer: " + (
                    "pass the prompt as token ids (--token-ids on the command line)" if plain_text else
                    "it has no chat template or fill-in-the-middle tokens, and takes only token ids"))
            if fim_suffix is not None and (chat or not isinstance(prompt, str)):
                raise GenerationError("fim_suffix (fill-in-the-middle) cannot be combined with a chat prompt")
            if isinstance(prompt, str):
                check_unicode(prompt, "the prompt")
            if fim_suffix is not None:
                if not isinstance(fim_suffix, str):
                    raise GenerationError(f"fim_suffix must be a string, got {type(fim_suffix).__name__}")
                check_unicode(fim_suffix, "fim_suffix")
                ids = self.tokenizer.fim_token_ids(prompt, fim_suffix, allow_special_tokens)
            elif chat or not isinstance(prompt, str):
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                ids = self.tokenizer.chat_token_ids(messages, allow_special_tokens=allow_special_tokens)
            elif allow_special_tokens:
                ids = self.tokenizer.encode(prompt)
            else:
                ids = self.tokenizer.encode_literal(prompt)
            if isinstance(prompt, str) and not chat:  # a chat template writes its own special tokens
                ids = self.tokenizer.around_prompt(ids)
            ids = self._check_token_ids(ids, "the encoded prompt", "a flat sequence of integer token ids")
        else:
            if chat:
                raise GenerationError("chat needs a text prompt or a list of chat messages (mappings with 'role' "
                                      f"and 'content'), got {prompt!r:.80}")
            if fim_suffix is not None:
                raise GenerationError(f"fim_suffix needs a text prompt, got {prompt!r:.80}")
            ids = self._check_token_ids(prompt, "prompt", "text, chat messages or a flat sequence of integer token ids")
        if not ids:
            raise GenerationError("the prompt is empty (0 tokens)")
        return ids

    def _check_token_ids(self, ids, what: str, accepted: str) -> list[int]:
        if _is_bytes(ids):  # whose elements would pass for token ids
            raise GenerationError(f"{what} must be {accepted}, not bytes (decode text first), got {bytes(ids[:80])!r:.80}")
        if isinstance(ids, (list, tuple)) and any(isinstance(i, (bool, np.bool_)) for i in ids):
            raise GenerationError(f"{what} must be {accepted}, not booleans (NumPy would read them as 0 and 1), "
                                  f"got {ids!r:.80}")
        try:
            array = np.asarray(ids)
        except (ValueError, TypeError):  # ragged nesting, objects NumPy cannot hold
            array = None
        # NumPy holds integers past int64 as objects; they compare as integers do.
        integers = array is not None and array.ndim == 1 and (
            array.size == 0 or np.issubdtype(array.dtype, np.integer)
            or (array.dtype == object and all(isinstance(i, int) and not isinstance(i, bool) for i in array)))
        if not integers:
            raise GenerationError(f"{what} must be {accepted}, got {ids!r:.80}")
        bad = array[(array < 0) | (array >= self.config.vocab_size)]
        if bad.size:
            raise GenerationError(f"{what} holds token id {shown(int(bad[0]))} outside the vocabulary "
                                  f"0..{self.config.vocab_size - 1}")
        return [int(i) for i in array]

    def check_settings(self, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int | None = None, speculate: int = 0) -> SamplingParams:
        """Raise GenerationError for settings no request could run with, as `generate` would; a
        chat checks them once, before its first turn. Returns the sampling parameters."""
        self._check_open()
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if isinstance(speculate, bool) or not isinstance(speculate, (int, np.integer)) or not 0 <= speculate <= MAX_DRAFTS:
            raise GenerationError(f"speculate must be an integer in 0..{MAX_DRAFTS} (drafts per pass, 0 = off), "
                                  f"got {speculate!r}")
        if speculate and not callable(getattr(self.backend, "verify", None)):
            raise GenerationError(f"speculate={speculate} needs a backend with a verify pass, and the "
                                  f"{self.backend.name} backend has none: use backend 'numpy' or speculate=0")
        if speculate and getattr(self.backend, "verify_refusal", None):
            raise GenerationError(f"speculate={speculate}: {self.backend.verify_refusal}; use speculate=0")
        return sampling

    def _request(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, chat, fim_suffix,
                 speculate, allow_special_tokens) -> _Request:
        self._check_open()
        sampling = self.check_settings(max_new_tokens, temperature, top_k, top_p, seed, speculate)
        if stop_token_ids is None:
            stop_ids = self.tokenizer.stop_token_ids if self.tokenizer else ()
        else:
            accepted = "a token id or a flat sequence of integer token ids"
            if isinstance(stop_token_ids, str):
                raise GenerationError(f"stop_token_ids takes token ids, not text, got {stop_token_ids!r:.80}")
            if isinstance(stop_token_ids, (int, np.integer)) or (isinstance(stop_token_ids, np.ndarray)
                                                                  and stop_token_ids.ndim == 0):
                stop_token_ids = [stop_token_ids]
            elif isinstance(stop_token_ids, Mapping):
                raise GenerationError(f"stop_token_ids must be {accepted}, not a mapping (pass its keys or values "
                                      f"as a list), got {stop_token_ids!r:.80}")
            elif not _is_bytes(stop_token_ids):
                try:
                    stop_token_ids = list(stop_token_ids)  # a set or a generator, once
                except TypeError:
                    raise GenerationError(f"stop_token_ids must be {accepted}, got {stop_token_ids!r:.80}") from None
            stop_ids = self._check_token_ids(stop_token_ids, "stop_token_ids", accepted)
        ids = self.encode_prompt(prompt, chat, fim_suffix, allow_special_tokens)
        total = len(ids) + int(max_new_tokens)
        if total > self.max_context:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} tokens exceeds the "
                f"engine's context of {self.max_context} (max_context; the model allows "
                f"{self.config.max_position_embeddings})"
            )
        return _Request(np.array(ids, dtype=np.int32), int(max_new_tokens), sampling, frozenset(stop_ids), int(speculate))

    # ---- running it: every touch of the backend or the pages holds self._lock ----

    def _take_backend(self, request: _Request) -> None:
        """Make `request` the one whose queued backend work is live, dropping another's: that one
        starts its backend generator again from its last token at its next step."""
        owner = self._owner
        if owner is not None and owner is not request and owner.upcoming is not None:
            owner.upcoming.close()
            owner.upcoming = None
        self._owner = request

    def _release_backend(self, request: _Request) -> None:
        if request.upcoming is not None:
            request.upcoming.close()  # before the pages go back: a step may still be queued on them
            request.upcoming = None
        if self._owner is request:
            self._owner = None

    def _next_pass(self, request: _Request, page_table: np.ndarray) -> list[int]:
        """The tokens of the request's next pass over the weights, from its passes generator (started
        anew from its last chosen token when another request used the backend since its last pass)."""
        if self._owner is not request or request.upcoming is None:
            self._take_backend(request)
            request.upcoming = self._passes(request, page_table)
        tokens = next(request.upcoming)
        request.chosen += tokens
        return list(tokens)  # the caller pops them; the generator keeps its own

    def _run(self, request: _Request) -> Iterator[TokenPiece]:
        prompt_len = len(request.prompt_ids)
        decoder = StreamDecoder(self.tokenizer) if self.tokenizer else None
        finish_reason, timings, page_table = "length", [0.0, 0.0], None
        try:  # the pages are taken inside it, so that an interrupt anywhere after gives them back
            with self._lock:
                self._check_open()
                try:
                    page_table = self.allocator.allocate(pages_needed(prompt_len + request.max_new_tokens))
                except KVCacheFullError as e:
                    raise GenerationError(f"{e} (other generations still hold pages)") from e
                backend_name = self.backend.name
                self._take_backend(request)
                start = time.perf_counter()
                token = sample(self.backend.prefill(request.prompt_ids, 0, page_table), request.sampling, prompt_len - 1)
                timings[0] = time.perf_counter() - start
            request.chosen.append(token)
            pending = [token]  # chosen, not yet yielded: the tokens of one pass
            while len(request.generated) < request.max_new_tokens:
                if not pending:
                    with self._lock:
                        self._check_open()  # a stream may outlive close(); its backend is gone then
                        start = time.perf_counter()
                        pending = self._next_pass(request, page_table)
                        timings[1] += time.perf_counter() - start
                token = pending.pop(0)
                if token in request.stop_ids:
                    finish_reason = "stop"
                    break
                request.generated.append(token)
                yield TokenPiece(token, decoder.push(token) if decoder else "")
            if decoder and (rest := decoder.flush()):
                yield TokenPiece(None, rest)
        except FloatingPointError as e:
            raise GenerationError(
                f"the model computed non-finite logits ({e}); {self.model.path} may be corrupt: "
                f"check it with `nanoqwen inspect --verify {self.model.path}`"
            ) from e
        finally:
            with self._lock:
                self._release_backend(request)
                if page_table is not None:
                    self.allocator.free(page_table)
        request.result = GenerationResult(
            prompt_token_ids=request.prompt_ids.tolist(),
            token_ids=list(request.generated),
            text=self.tokenizer.decode(request.generated) if self.tokenizer else None,
            finish_reason=finish_reason,
            prefill_seconds=timings[0],
            decode_seconds=timings[1],
            backend=backend_name,
            seed=request.sampling.seed,
            decode_passes=request.decode_passes,
            drafted_tokens=request.drafted_tokens,
            accepted_drafts=request.accepted_drafts,
        )

    def _passes(self, request: _Request, page_table: np.ndarray) -> Iterator[list[int]]:
        """The tokens after the request's last chosen one, one list per pass over the weights.

        Without speculation each pass is one of `next_tokens`' steps. With it, each pass first
        drafts from prompt + tokens so far: a draft is verified in one pass, and without one
        plain steps run as without speculation, queued behind each other, until the text drafts
        again. Drafting pauses after passes that keep failing (DraftSchedule). The drafts are
        capped so that a pass never chooses a token past max_new_tokens, so no pass writes K/V past
        the last position plain decoding writes (prompt + max_new_tokens - 2) and the request's
        pages cover every row. The consumer closes this generator at a stop token, so drafts come
        from tokens of the output only.
        """
        token, chosen = request.chosen[-1], len(request.chosen)
        backend, sampling = self.backend, request.sampling
        # `token` goes in at the position after the prompt and the tokens chosen before it
        position, remaining = len(request.prompt_ids) + chosen - 1, request.max_new_tokens - chosen
        if not request.speculate:
            upcoming = backend.next_tokens(token, position, page_table, remaining, sampling)
            try:
                for token in upcoming:
                    request.decode_passes += 1
                    yield [token]
            finally:
                upcoming.close()
            return
        lookup = PromptLookup([*request.prompt_ids.tolist(), *request.chosen])
        schedule = DraftSchedule(request.speculate)
        while remaining > 0:
            drafts = lookup.draft(min(schedule.allowed(), remaining - 1))
            if drafts:
                tokens = backend.verify(token, drafts, position, page_table, sampling)
                schedule.verified(len(tokens) - 1)
                request.decode_passes += 1
                request.drafted_tokens += len(drafts)
                request.accepted_drafts += len(tokens) - 1
                yield tokens
                lookup.extend(tokens)
                token, position, remaining = tokens[-1], position + len(tokens), remaining - len(tokens)
                continue
            # Nothing to draft: plain steps, each queued behind the one being read (next_tokens),
            # until the text so far drafts again. The step already queued then is still read (its
            # token is the next one either way), and the pass after it verifies.
            upcoming = backend.next_tokens(token, position, page_table, remaining, sampling)
            try:
                drafts_ahead = False
                while True:
                    try:
                        token = upcoming.send(True) if drafts_ahead else next(upcoming)
                    except StopIteration:
                        break
                    request.decode_passes += 1
                    schedule.stepped()
                    yield [token]
                    lookup.extend([token])
                    position, remaining = position + 1, remaining - 1
                    if drafts_ahead:
                        break
                    drafts_ahead = bool(lookup.draft(min(schedule.allowed(), remaining - 1)))
            finally:
                upcoming.close()

    def stream(self, prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_token_ids=None,
               chat: bool = False, fim_suffix: str | None = None, speculate: int = 0,
               allow_special_tokens: bool = False) -> Stream:
        """Like `generate`, but yields TokenPieces as tokens are made.

        Arguments are checked now, not at the first `next()`. The request's pages are freed
        when the stream ends, fails, is closed, or is dropped; `.result` is set at its end.
        Streams take the engine's lock step by step, so several may run at once, from one
        thread or many.
        """
        request = self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, chat,
                                fim_suffix, speculate, allow_special_tokens)
        return Stream(self._run(request), request)

    def generate(self, prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_token_ids=None,
                 chat: bool = False, fim_suffix: str | None = None, speculate: int = 0,
                 allow_special_tokens: bool = False) -> GenerationResult:
        """Run a request to the end, holding the engine's lock: other threads' requests wait for it.

        prompt: text, token ids, or chat messages ([{"role": ..., "content": ...}]). chat=True
        wraps a text prompt as one user message of the chat template; fim_suffix makes a
        fill-in-the-middle prompt (the prompt is the code before the gap). temperature 0 is
        greedy; seed makes sampling reproducible. Generation stops at max_new_tokens or at a
        stop token (default: <|im_end|> and <|endoftext|>, as the tokenizer numbers them).
        speculate=N (at most MAX_DRAFTS) drafts up to N tokens per pass by prompt lookup
        (nanoqwen.speculative) and verifies them in one pass over the weights: the same tokens,
        fewer passes when the output copies the prompt (GenerationResult.tokens_per_pass).
        Text is encoded as text; allow_special_tokens=True lets special-token text in the prompt,
        the messages or fim_suffix act as special tokens (and lets messages carry other keys).
        """
        request = self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, chat,
                                fim_suffix, speculate, allow_special_tokens)
        with self._lock:
            for _ in self._run(request):
                pass
        return request.result

    def close(self) -> None:
        """Release the backend (its device memory) and, if the engine opened it, the model file.

        Idempotent. Waits for the backend call in progress in another thread, if any; afterwards
        every request, running or new, raises GenerationError("engine is closed").
        """
        self._closed = True  # requests running elsewhere stop at their next step, which waits for the lock
        with self._lock:
            if self._owner is not None:
                self._release_backend(self._owner)
            backend, self.backend = self.backend, None
            if backend is not None and callable(getattr(backend, "close", None)):
                backend.close()
            if self._owns_model:
                self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_messages(prompt) -> bool:
    """A conversation: a list holding a dict (the tokenizer then checks every message)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and any(isinstance(m, Mapping) for m in prompt)


def _is_bytes(ids) -> bool:
    """Raw bytes (bytes, bytearray, or a memoryview of single bytes), whose elements would pass for
    token ids; a memoryview of wider integers (array('i'), a NumPy buffer) holds token ids."""
    if isinstance(ids, memoryview):
        return ids.itemsize == 1
    return isinstance(ids, (bytes, bytearray))
