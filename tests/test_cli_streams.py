"""What the `nanoqwen` command reads from stdin and writes to stdout: bounded reads of endless input,
byte-order marks, over-long chat lines, encodings that cannot spell the output, terminal controls."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nanoqwen import cli
from nanoqwen.engine import Engine
from nanoqwen.testing import make_nanoqwen

NUMPY = ("--backend", "numpy")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_nanoqwen(tmp_path_factory.mktemp("streams"), seed=11)


def nanoqwen_command(*argv, stdin: bytes | None = None, stdin_file=None, env=None):
    """The command in a fresh process, stdin from `stdin`'s bytes or an open file."""
    return subprocess.run([sys.executable, "-m", "nanoqwen", *map(str, argv)], input=stdin,
                          stdin=stdin_file if stdin is None else None, capture_output=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("options", [[], ["--token-ids"]])
def test_an_endless_stdin_is_refused_at_what_the_context_can_hold(model_path, options):
    with open("/dev/zero", "rb") as endless:
        done = nanoqwen_command("generate", model_path, "-", *options, "--max-context", 64, *NUMPY, stdin_file=endless)
    stderr = done.stderr.decode()
    assert done.returncode == 1 and stderr.count("\n") == 1, stderr
    assert "PROMPT from stdin is longer than" in stderr and "the context of 64 tokens" in stderr


def test_a_byte_order_mark_is_not_part_of_the_prompt(model_path):
    expected = Engine(model_path, backend="numpy").generate("def f():", max_new_tokens=4).text + "\n"
    for text in (b"def f():", b"\xef\xbb\xbfdef f():"):
        done = nanoqwen_command("generate", model_path, "-", "--max-new-tokens", 4, *NUMPY, stdin=text)
        assert done.returncode == 0 and done.stdout.decode() == expected, done.stderr


def test_a_chat_line_longer_than_the_context_can_hold_is_refused_and_the_chat_goes_on(model_path):
    limit = Engine(model_path, backend="numpy", max_context=64).tokenizer.max_text_bytes
    turns = b"x" * (3 * limit) + b"\nhello\n/exit\n"
    done = nanoqwen_command("chat", model_path, "--max-context", 64, "--max-new-tokens", 2, *NUMPY, stdin=turns)
    stderr = done.stderr.decode()
    assert done.returncode == 0 and stderr.count("\n") == 1, stderr
    assert f"that line is longer than {limit:,} characters" in stderr
    assert done.stdout.decode().count(">>> ") == 3  # the long line, hello (answered), /exit


def test_a_chat_from_a_pipe_reads_lines_as_a_terminal_would(model_path):
    """CRLF endings and a byte-order mark are not part of the turn; the reply is the engine's."""
    engine = Engine(model_path, backend="numpy")
    reply = engine.generate([{"role": "user", "content": "hello"}], max_new_tokens=3).text
    done = nanoqwen_command("chat", model_path, "--max-new-tokens", 3, *NUMPY, stdin=b"\xef\xbb\xbfhello\r\n/exit\r\n")
    assert done.returncode == 0 and f">>> {reply}\n>>> " in done.stdout.decode(), done.stdout
    utf16 = nanoqwen_command("chat", model_path, "--max-new-tokens", 3, *NUMPY, stdin="hello\n/exit\n".encode("utf-16-le"),
                             env={"PYTHONIOENCODING": "utf-16-le"})
    assert utf16.returncode == 0 and f">>> {reply}\n>>> ".encode("utf-16-le") in utf16.stdout, utf16.stderr


def test_a_chat_line_at_the_limit_is_taken_whatever_its_ending(model_path):
    limit = Engine(model_path, backend="numpy", max_context=64).tokenizer.max_text_bytes
    for line in (b"\xef\xbb\xbf" + b"x" * limit + b"\r\n", b"x" * limit + b"\n"):
        done = nanoqwen_command("chat", model_path, "--max-context", 64, "--max-new-tokens", 2, *NUMPY,
                                stdin=line + b"/exit\n")
        assert "longer than" not in done.stderr.decode(), done.stderr


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_output_an_encoding_cannot_spell_is_escaped_not_a_traceback(model_path, encoding):
    done = nanoqwen_command("generate", model_path, "x", "--max-new-tokens", 40, "--temperature", 5, "--seed", 1, *NUMPY,
                            env={"PYTHONIOENCODING": encoding})
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    done.stdout.decode(encoding)  # whatever the model wrote, in characters the stream can hold


def test_control_characters_are_escaped_only_on_a_terminal(monkeypatch, capsys):
    text = "a\tb\r\n\x1b]0;title\x07\x9b\x7f"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    cli._text_writer()(text)
    assert capsys.readouterr().out == text
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cli._text_writer()(text)
    assert capsys.readouterr().out == "a\tb\r\n\\x1b]0;title\\x07\\x9b\\x7f"


def test_a_chat_at_a_terminal_reads_its_lines_with_input(model_path, monkeypatch, capsys):
    lines = iter(["hello", "/exit"])
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    assert cli.main(["chat", str(model_path), "--max-new-tokens", "2", *NUMPY]) == 0
    assert next(lines, None) is None


def test_a_chat_line_not_in_stdins_encoding_is_reported_and_the_chat_goes_on(model_path):
    done = nanoqwen_command("chat", model_path, "--max-new-tokens", 2, *NUMPY, stdin=b"caf\xe9\nhello\n/exit\n",
                            env={"PYTHONIOENCODING": "utf-8"})
    stderr = done.stderr.decode()
    assert done.returncode == 0 and stderr.count("\n") == 1 and "that line is not UTF-8 text" in stderr, stderr


@pytest.mark.parametrize("option, value", [("--max-new-tokens", "٢"), ("--seed", "１２"), ("--temperature", "٠.٥"),
                                           ("--max-new-tokens", "1_0"), ("--top-p", "½")])
def test_numbers_are_ascii(model_path, capsys, option, value):
    with pytest.raises(SystemExit) as exit:
        cli.main(["generate", str(model_path), "hi", option, value, *NUMPY])
    assert exit.value.code == 2 and "in ASCII digits" in capsys.readouterr().err


def test_a_long_system_message_is_named(model_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_read_turn", lambda limit: pytest.fail("asked for a turn it could never answer"))
    for system, message in (("b c " * 200, "shorten --system"), ("b" * 10**6, "--system: the text has")):
        status = cli.main(["chat", str(model_path), "--max-context", "64", "--max-new-tokens", "3", "--system", system, *NUMPY])
        assert status == 1 and message in capsys.readouterr().err
