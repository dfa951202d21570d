"""What a new user types first: the version, the shipped model's name and path, inspect without
a path, a one-token generation's stats line, and chat's /reset."""

from __future__ import annotations

import pytest

import nanoqwen
from nanoqwen import cli


def run(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanoqwen {nanoqwen.__version__}"


def test_models_lists_the_shipped_model_with_its_path(capsys):
    status, stdout, _ = run(capsys, "models")
    assert status == 0
    assert "nano-coder" in stdout and str(cli.DEFAULT_MODEL) in stdout and "the default MODEL" in stdout


def test_inspect_without_a_path_inspects_the_shipped_model(capsys):
    status, stdout, _ = run(capsys, "inspect")
    assert status == 0 and stdout.startswith(f"{cli.DEFAULT_MODEL}: .nanoqwen version")


def test_one_new_token_has_no_decode_rate(capsys):
    status, _, stderr = run(capsys, "generate", "def f(x):", "--max-new-tokens", 1, "--backend", "numpy")
    assert status == 0
    assert "nan" not in stderr and "no decode steps" in stderr


def test_chat_reset_says_so(capsys, monkeypatch):
    lines = iter(["/reset", "/exit"])
    monkeypatch.setattr("nanoqwen.cli._read_turn", lambda limit: next(lines))
    status, stdout, _ = run(capsys, "chat", "--backend", "numpy", "--max-new-tokens", 2)
    assert status == 0 and "[conversation reset]" in stdout
