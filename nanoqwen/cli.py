"""The `nanoqwen` command (also `python -m nanoqwen`).

    nanoqwen convert Qwen/Qwen2.5-Coder-7B-Instruct qwen7b.nanoqwen
    nanoqwen inspect qwen7b.nanoqwen
    nanoqwen generate qwen7b.nanoqwen "def quicksort(xs):" --max-new-tokens 128
    nanoqwen chat qwen7b.nanoqwen

Each subcommand is one `run_*` function registered with `@subcommand`, next to a function
that declares its arguments. A module listed in OPTIONAL_SUBCOMMAND_MODULES registers its
own subcommands the same way when it is present (the benchmark lives in `nanoqwen.bench`).
Exit status: 0 success, 1 a problem with the input (one line on stderr, no traceback),
2 a usage error (argparse's convention), 130 interrupted.
"""

from __future__ import annotations

import argparse
import codecs
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import __version__
from .errors import ConfigError, NanoqwenFormatError, CheckpointError, GenerationError, ContextLengthError, BackendUnavailableError
from .sampling import DEFAULT_MAX_NEW_TOKENS

SHIPPED_MODELS = Path(__file__).parent / "models"
DEFAULT_MODEL = SHIPPED_MODELS / "nano-coder" / "nano-coder.nanoqwen"
OPTIONAL_SUBCOMMAND_MODULES = ("nanoqwen.bench",)
# Problems with what the user gave us: reported in one line, exit status 1.
USER_ERRORS = (NanoqwenFormatError, GenerationError, CheckpointError, ConfigError, OSError)

SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def subcommand(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None]):
    """Register the decorated `run(args) -> exit status` as `nanoqwen NAME`."""

    def register(run: Callable[[argparse.Namespace], int]):
        SUBCOMMANDS[name] = (help, arguments, run)
        return run

    return register


def _user_errors() -> tuple[type[BaseException], ...]:

    return USER_ERRORS + (BackendUnavailableError,)


# Numbers on the command line in ASCII: int() and float() alone also read '١٢', '１２' and '1_0'.
ASCII_INTEGER = re.compile(r"[+-]?[0-9]+")
ASCII_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


def ascii_int(text: str) -> int:
    """argparse's type for an integer option."""
    if not ASCII_INTEGER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not an integer in ASCII digits")
    return int(text)


def ascii_float(text: str) -> float:
    """argparse's type for a number option (inf and nan pass, for the option's own check to name)."""
    if not ASCII_FLOAT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not a number in ASCII digits")
    return float(text)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


# ---- convert ----


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SRC", help="Hugging Face checkpoint directory or hub id")
    p.add_argument("out", metavar="OUT", help="the .nanoqwen file to write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


@subcommand("convert", "convert a Hugging Face Qwen2 checkpoint into a .nanoqwen file", _convert_arguments)
def run_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    summary = convert(args.source, args.out, progress=not args.quiet)
    print(f"wrote       {summary['out']}")
    print(f"size        {_mib(summary['bytes'])} ({summary['bytes']:,} bytes)")
    print(f"parameters  {summary['parameters']:,}")
    print(f"tokenizer   {', '.join(summary['tokenizer']) or 'none (generate from token ids only)'}")
    print(f"peak RSS    {_mib(summary['peak_rss_bytes'])}")
    return 0


# ---- inspect ----


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", nargs="?", help="a .nanoqwen file (default: the shipped nano-coder)")
    p.add_argument("--verify", action="store_true", help="also check every tensor's CRC-32 (reads the whole file)")


@subcommand("inspect", "print a .nanoqwen file's header, tensor table and bytes per token", _inspect_arguments)
def run_inspect(args: argparse.Namespace) -> int:
    from .format import DTYPE_NAMES, VERSION
    from .kvcache import kv_bytes_per_token
    from .loader import TOKENIZER_PREFIX, load

    model = load(_model_path(args.model), verify_checksums=args.verify)
    c = model.config
    print(f"{model.path}: .nanoqwen version {VERSION}, {model.file_size:,} bytes")
    for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "group_size"):
        print(f"  {name:<24} {getattr(c, name)}")
    records = model.tensor_table  # the table the loader checked, not a second read of a path a rename may change
    width = max(len(bytes(r["name"]).rstrip(b"\0")) for r in records)
    print(f"\n{'tensor':<{width}}  dtype  {'shape':<16} {'offset':>14} {'bytes':>14}")
    totals: dict[str, int] = {}
    for r in records:
        name = bytes(r["name"]).rstrip(b"\0").decode()
        shape = "x".join(str(int(d)) for d in r["shape"][: int(r["ndim"])])
        nbytes = int(r["nbytes"])
        print(f"{name:<{width}}  {DTYPE_NAMES[int(r['dtype'])]:<5}  {shape:<16} {int(r['offset']):>14,} {nbytes:>14,}")
        kind = ("INT4 weights" if name.endswith(".qweight") else "INT4 scales" if name.endswith(".scales")
                else "tokenizer" if name.startswith(TOKENIZER_PREFIX) else "fp16 tensors")
        totals[kind] = totals.get(kind, 0) + nbytes
    print()
    for kind, nbytes in totals.items():
        print(f"{kind:<14} {_mib(nbytes):>14}")
    # A decoded token reads every weight once, but only one row of the embedding table (which
    # is read whole as the lm_head when tied), plus the K/V of every position before it.
    weights = sum(int(r["nbytes"]) for r in records if not bytes(r["name"]).startswith(TOKENIZER_PREFIX.encode()))
    if not c.tie_word_embeddings:
        weights -= model.embed.nbytes - model.embed[0].nbytes
    print(f"\nbytes per decoded token: {_mib(weights)} of weights ({weights:,} bytes)"
          f" + {kv_bytes_per_token(c):,} bytes of KV cache per position of context")
    if args.verify:
        print("checksums: all tensors match their CRC-32")
    return 0


# ---- models ----


def _models_arguments(p: argparse.ArgumentParser) -> None:
    pass


@subcommand("models", "list the models shipped in the package, with their paths", _models_arguments)
def run_models(args: argparse.Namespace) -> int:
    from .loader import load

    for path in sorted(SHIPPED_MODELS.glob("*/*.nanoqwen")):
        model = load(path)
        try:
            c = model.config
            parameters = sum(int(np.prod(t.shape)) * (8 if name.endswith(".qweight") else 1)
                             for name, t in model.tensors.items() if not name.endswith(".scales") and t.dtype != np.uint8)
        finally:
            model.close()
        default = "  (the default MODEL)" if path == DEFAULT_MODEL else ""
        print(f"{path.stem:<12} {c.num_layers} layers, hidden {c.hidden_size}, {parameters / 1e6:.1f}M parameters{default}")
        print(f"{'':<12} {path}")
    return 0


# ---- generate ----


def _sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=ascii_int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help=f"at most N new tokens ({DEFAULT_MAX_NEW_TOKENS} by default)")
    p.add_argument("--temperature", type=ascii_float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=ascii_int, default=0, metavar="K", help="0 (default) keeps every token")
    p.add_argument("--top-p", type=ascii_float, default=1.0, metavar="P", help="nucleus mass, 1 (default) keeps every token")
    p.add_argument("--seed", type=ascii_int, default=None, help="makes sampling reproducible")
    p.add_argument("--speculate", type=ascii_int, default=0, metavar="N",
                   help="draft up to N tokens per pass from the prompt and the text so far and verify them in one "
                        "pass over the weights: the same tokens, fewer passes when the output copies the prompt "
                        "(0, the default, is off)")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default="auto",
                   help="auto (default) takes CUDA when CuPy sees a GPU")
    p.add_argument("--activations", choices=("fp16", "int8"), default="fp16",
                   help="decode projections' input precision on the CUDA backend (chapter 8)")
    p.add_argument("--prefill-weights", choices=("auto", "cache", "expand"), default="auto",
                   help="CUDA backend: keep fp16 copies of the projections for prefill (cache, 2 bytes per weight), "
                        "dequantize them per prompt (expand), or cache when the GPU has room (auto, the default)")
    p.add_argument("--max-context", type=ascii_int, default=None, metavar="N",
                   help="KV cache capacity in tokens (default: the model's, at most 4096)")


def _special_tokens_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="let special-token text in the input (<|im_end|>, <|fim_middle|>...) act as special tokens; "
                        "by default it is encoded as the plain text it is")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", nargs="?", help="a .nanoqwen file (default: the shipped nano-coder)")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt; '-' reads it from stdin")
    _sampling_arguments(p)
    _special_tokens_argument(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--fim-suffix", metavar="TEXT", default=None,
                   help="fill in the middle: PROMPT is the code before the gap, TEXT the code after it")
    p.add_argument("--token-ids", action="store_true",
                   help="PROMPT is token ids separated by spaces or commas; print ids, not text")


def _model_path(model: str | None) -> str | Path:
    if model is not None:
        return model  # as given: Path("") would name the current folder
    if not DEFAULT_MODEL.exists():
        raise GenerationError(
            f"no MODEL given and the shipped nano-coder is missing ({DEFAULT_MODEL} does not exist); "
            "pass a .nanoqwen file, e.g. one made with `nanoqwen convert`"
        )
    return DEFAULT_MODEL


def _engine(args: argparse.Namespace):
    from .engine import Engine

    return Engine(_model_path(args.model), backend=args.backend, max_context=args.max_context,
                  activations=args.activations, prefill_weights=args.prefill_weights)


def _sampling(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, speculate=args.speculate,
                allow_special_tokens=args.allow_special_tokens)


# The most characters of stdin an id of --token-ids may take, its separators included.
TOKEN_ID_CHARACTERS = 32
# C0 controls but tab, newline and carriage return, DEL, and C1: a terminal acts on them (ESC opens
# sequences that set its title or its clipboard), so text a model writes shows them escaped there.
TERMINAL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A, 0x0D)}


def _stdin_limit(engine, token_ids: bool) -> int:
    """The most characters of stdin a prompt may take (stdin can be endless: `< /dev/zero`): as many
    as the bytes the context's tokens can spell, or TOKEN_ID_CHARACTERS an id."""
    if token_ids or engine.tokenizer is None:
        return engine.max_context * TOKEN_ID_CHARACTERS
    return engine.tokenizer.max_text_bytes


def _stdin_text(read, what: str) -> str:
    """`read()` of stdin, in stdin's encoding (PYTHONIOENCODING's, else the locale's), without a
    leading byte-order mark (a file saved by some Windows editors starts with one)."""
    try:
        return read().removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        encoding = sys.stdin.encoding or "utf-8"
        name = "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding
        raise GenerationError(f"{what} is not {name} text ({e})") from None


def _read_stdin(limit: int, max_context: int) -> str:
    text = _stdin_text(lambda: sys.stdin.read(limit + 2), "PROMPT from stdin")  # room for a byte-order mark, and to see past the limit
    if len(text) > limit:
        raise GenerationError(f"PROMPT from stdin is longer than {limit:,} characters, more than the context of "
                              f"{max_context:,} tokens can hold")
    return text


def _read_turn(limit: int) -> str:
    """A chat's next line: input() at a terminal (line editing and history), else a line of a pipe or
    file of at most `limit` characters (GenerationError for a longer one, whose rest is skipped).
    EOFError at the end of the input."""
    if sys.stdin.isatty():
        return input(">>> ")
    sys.stdout.write(">>> ")
    sys.stdout.flush()
    line = _stdin_text(lambda: sys.stdin.readline(limit + 4), "that line")  # a mark, CR and LF, and one past the limit
    if not line:
        raise EOFError
    text = line.removesuffix("\n").removesuffix("\r")
    if len(text) > limit:
        ended = line.endswith("\n")
        while not ended and (rest := sys.stdin.readline(1 << 16)):
            ended = rest.endswith("\n")
        raise GenerationError(f"that line is longer than {limit:,} characters, more than the context can hold")
    return text


def _text_writer() -> Callable[[str], None]:
    """A writer of text a model wrote to stdout: where stdout is a terminal, control characters escaped."""
    escapes = TERMINAL_ESCAPES if getattr(sys.stdout, "isatty", lambda: False)() else None

    def write(text: str) -> None:
        sys.stdout.write(text if escapes is None else text.translate(escapes))
        sys.stdout.flush()

    return write


def _names_a_model(argument: str) -> bool:
    """True when a lone positional looks like a MODEL, not a PROMPT (`generate m.nanoqwen`)."""
    if argument.endswith(".nanoqwen") and not any(c.isspace() for c in argument):  # not "fix model.nanoqwen"
        return True
    try:
        return Path(argument).is_file()
    except (OSError, ValueError):  # a long or NUL-holding prompt is no file name
        return False


def _token_ids(prompt: str) -> list[int]:
    """--token-ids' PROMPT: integers in ASCII digits (int() alone also reads '١٢' and '1_0')."""
    words = prompt.replace(",", " ").split()
    if not all(ASCII_INTEGER.fullmatch(word) and len(word) <= 20 for word in words):  # 20: int64's digits and sign
        raise GenerationError(f"--token-ids: PROMPT must be integers in ASCII digits, at most 20 characters each, got {prompt!r:.60}")
    return [int(word) for word in words]


@subcommand("generate", "continue a prompt, streaming the text to stdout", _generate_arguments)
def run_generate(args: argparse.Namespace) -> int:
    if args.model is None and args.prompt != "-" and _names_a_model(args.prompt):
        # argparse gave the only positional to PROMPT; generating from the shipped model with
        # a file name as the prompt would be a silent surprise.
        if args.prompt.endswith(".nanoqwen"):
            args.parser.error(f"missing PROMPT: {args.prompt!r} names a model file; "
                              f"write `nanoqwen generate {args.prompt} PROMPT` (or '-' to read it from stdin)")
        args.parser.error(f"missing PROMPT: {args.prompt!r} is a file; write `nanoqwen generate {args.prompt} PROMPT` "
                          f"to use it as the model, or `nanoqwen generate - < {args.prompt}` to continue its text "
                          "with the shipped model")
    if args.prompt == "-" and sys.stdin is None:  # started with stdin closed (`<&-`): Python leaves it None
        raise GenerationError("PROMPT is '-' but stdin is closed: there is no prompt to read")
    engine = _engine(args)
    prompt = (_read_stdin(_stdin_limit(engine, args.token_ids), engine.max_context) if args.prompt == "-"
              else args.prompt)
    if args.token_ids:
        prompt = _token_ids(prompt)
    write = _text_writer()
    with engine.stream(prompt, chat=args.chat, fim_suffix=args.fim_suffix, **_sampling(args)) as stream:
        for piece in stream:
            if args.token_ids:
                if piece.token_id is not None:
                    print(piece.token_id, end=" ", flush=True)
            else:
                write(piece.text)
    print()
    print(_stats_line(stream.result, speculated=args.speculate > 0), file=sys.stderr)
    return 0


def _stats_line(result, speculated: bool = False) -> str:
    """One line about a finished generation; the decode rate only when there were decode steps, and
    after a speculative one the tokens each pass over the weights made."""
    rate = result.decode_tokens_per_second
    decode = f"decode {rate:.1f} tokens/s" if rate == rate else "no decode steps"  # NaN: prefill chose every token
    per_pass = (f", {result.tokens_per_pass:.1f} tokens per pass over the weights"
                if speculated and result.decode_passes else "")
    return (f"[{len(result.token_ids)} tokens, finished by {result.finish_reason}; prompt {len(result.prompt_token_ids)} "
            f"tokens in {result.prefill_seconds * 1e3:.1f} ms; {decode} on {result.backend}{per_pass}"
            + (f"; --seed {result.seed} replays it" if result.seed is not None else "") + "]")


# ---- chat ----


def _chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", nargs="?", help="a .nanoqwen file (default: the shipped nano-coder)")
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message opening the conversation")
    _sampling_arguments(p)
    _special_tokens_argument(p)


@subcommand("chat", "talk to a model through its chat template (/exit to leave, /reset to forget)", _chat_arguments)
def run_chat(args: argparse.Namespace) -> int:
    if sys.stdin is None:  # started with stdin closed (`<&-`), unlike an empty one: no conversation can start
        raise GenerationError("chat reads its turns from stdin, which is closed")
    try:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    except ImportError:
        pass
    engine = _engine(args)
    if engine.tokenizer is None:
        raise GenerationError(f"{engine.model.path} carries no tokenizer, so it cannot chat")
    engine.check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                          args.speculate)  # once, not at every turn
    if args.system:
        from .tokenizer import check_unicode

        check_unicode(args.system, "--system")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    try:
        first_turn = len(engine.encode_prompt(opening + [{"role": "user", "content": ""}], chat=True))
    except GenerationError as e:
        raise GenerationError(f"--system: {e}" if args.system else str(e)) from None
    if first_turn + args.max_new_tokens > engine.max_context:
        around = "the chat template's and --system's" if args.system else "the chat template's"
        shorter = "shorten --system, " if args.system else ""
        raise GenerationError(f"--max-new-tokens {args.max_new_tokens} and {around} {first_turn} tokens around "
                              f"a first message leave it no room in the context of {engine.max_context} tokens: "
                              f"{shorter}lower --max-new-tokens or raise --max-context")
    history, write = list(opening), _text_writer()
    print(f"chatting with {engine.model.path.name} on {engine.backend.name}; /exit to leave, /reset to forget")
    while True:
        try:
            line = _read_turn(engine.tokenizer.max_text_bytes)
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except UnicodeDecodeError as e:  # input()'s
            print(f"error: that line is not UTF-8 text ({e})", file=sys.stderr)
            continue
        except GenerationError as e:  # a line too long, or not in stdin's encoding
            print(f"error: {e}", file=sys.stderr)
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(opening)
            print("[conversation reset]")
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        pieces = []
        try:
            with engine.stream(history, **_sampling(args)) as stream:
                for piece in stream:
                    pieces.append(piece.text)
                    write(piece.text)
            print()
        except KeyboardInterrupt:
            print(" [interrupted]")
        except ContextLengthError as e:
            print(f"error: {e}. The conversation is too long for the context: /reset starts a new one "
                  "(a smaller --max-new-tokens leaves more room)", file=sys.stderr)
            history.pop()  # the turn that failed is not part of the conversation
            continue
        except GenerationError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": "".join(pieces)})


# ---- entry point ----


def build_parser() -> argparse.ArgumentParser:
    for module in OPTIONAL_SUBCOMMAND_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    parser = argparse.ArgumentParser(prog="nanoqwen", description="Qwen2.5-Coder inference from a .nanoqwen file.")
    parser.add_argument("--version", action="version", version=f"nanoqwen {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help, arguments, run) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help, description=help)
        arguments(sub)
        sub.set_defaults(run=run, parser=sub)  # parser: for usage errors found after parsing
    return parser


def main(argv: list[str] | None = None) -> int:
    for name in ("stdout", "stderr"):  # Python leaves a closed stream None (`nanoqwen generate ... >&-`)
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))
    if callable(getattr(sys.stdout, "reconfigure", None)) and sys.stdout.errors == "strict":
        # A terminal or pipe whose encoding cannot spell every character (ASCII, Latin-1) shows the
        # rest as \u escapes, as Python's stderr does, instead of ending the run.
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, unparsed = parser.parse_known_args(argv)
    if unparsed and args.command is not None:
        # argparse takes positionals from their first run only, so `generate MODEL --top-k 5 PROMPT`
        # leaves PROMPT over; the subcommand's intermixed parse takes them wherever they stand
        # (and names any argument that is really unknown).
        position = argv.index(args.command)
        if position:  # before the command stand only --help and --version, which exit
            parser.error(f"unrecognized arguments: {' '.join(argv[:position])}")
        args = args.parser.parse_intermixed_args(argv[position + 1:], argparse.Namespace(command=args.command))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 128 + 13  # SIGPIPE's status
    except _user_errors() as e:
        print(f"nanoqwen {args.command}: error: {e}", file=sys.stderr)
        return 1
    except MemoryError as e:  # NumPy's and CuPy's out-of-memory errors both derive from it
        print(f"nanoqwen {args.command}: error: out of memory ({str(e) or 'an allocation failed'}): the model, or "
              "the context asked for, needs more memory than this machine has", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
