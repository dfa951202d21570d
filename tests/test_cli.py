"""The `nanoqwen` command on a tiny converted model: convert, inspect, generate, chat."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import nanoqwen
from nanoqwen import cli
from nanoqwen.backends import cuda_available
from nanoqwen.engine import Engine
from nanoqwen.testing import make_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("cli") / "hf", seed=11)


@pytest.fixture(scope="module")
def model_path(checkpoint):
    out = checkpoint.parent / "tiny.nanoqwen"
    assert cli.main(["convert", str(checkpoint), str(out), "--quiet"]) == 0
    return out


def run(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_convert_prints_a_summary(capsys, checkpoint, tmp_path):
    out = tmp_path / "again.nanoqwen"
    status, stdout, _ = run(capsys, "convert", checkpoint, out, "--quiet")
    assert status == 0
    assert "peak RSS" in stdout and "parameters" in stdout and "tokenizer.json" in stdout
    assert nanoqwen.load(out).config.vocab_size == 512


def test_inspect_shows_header_table_and_budget(capsys, model_path):
    status, stdout, _ = run(capsys, "inspect", model_path, "--verify")
    assert status == 0
    assert "num_kv_heads" in stdout and "model.layers.1.mlp.down_proj.qweight" in stdout
    assert "u32    128x32" in stdout  # down_proj: 128 outputs x (256 inputs / 8 per word)
    assert "bytes per decoded token" in stdout and "checksums: all tensors match" in stdout


def test_generate_streams_the_engine_text(capsys, model_path):
    status, stdout, stderr = run(capsys, "generate", model_path, "def add(a, b):", "--max-new-tokens", 12,
                                 "--backend", "numpy")
    assert status == 0
    expected = Engine(model_path, backend="numpy").generate("def add(a, b):", max_new_tokens=12)
    assert stdout == expected.text + "\n"
    assert "tokens/s on numpy" in stderr


def test_options_may_stand_between_model_and_prompt(capsys, model_path):
    expected = run(capsys, "generate", model_path, "def add(a, b):", "--max-new-tokens", 5, "--backend", "numpy")
    mixed = run(capsys, "generate", "--backend", "numpy", model_path, "--max-new-tokens", 5, "def add(a, b):")
    assert mixed[0] == 0 and mixed[1] == expected[1]
    with pytest.raises(SystemExit) as exit_info:
        run(capsys, "generate", model_path, "--max-new-tokens", 5, "x", "--bogus", 3)
    assert exit_info.value.code == 2 and "unrecognized arguments: --bogus 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # an unknown option before the command is no option of it
        run(capsys, "--bogus", "generate", model_path, "x")
    assert exit_info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_prompt_that_mentions_a_model_file_is_a_prompt(capsys, monkeypatch, model_path):
    monkeypatch.setattr(cli, "DEFAULT_MODEL", model_path)
    status, stdout, _ = run(capsys, "generate", "Fix the loader of model.nanoqwen", "--max-new-tokens", 3,
                            "--backend", "numpy")
    assert status == 0 and stdout
    with pytest.raises(SystemExit):  # a lone file name is still taken for a MODEL missing its PROMPT
        run(capsys, "generate", "model.nanoqwen")
    assert "missing PROMPT" in capsys.readouterr().err


def test_generate_sampling_chat_and_fim_flags(capsys, model_path):
    common = ["--max-new-tokens", 6, "--backend", "numpy"]
    a = run(capsys, "generate", model_path, "hi", "--temperature", 0.8, "--top-k", 40, "--top-p", 0.9, "--seed", 3, *common)
    b = run(capsys, "generate", model_path, "hi", "--temperature", 0.8, "--top-k", 40, "--top-p", 0.9, "--seed", 3, *common)
    assert a[0] == 0 and a[1] == b[1] and "--seed 3 replays it" in a[2]
    unseeded = run(capsys, "generate", model_path, "hi", "--temperature", 0.8, *common)
    seed = re.search(r"--seed (\d+) replays it", unseeded[2]).group(1)  # a run without a seed says which it drew
    assert run(capsys, "generate", model_path, "hi", "--temperature", 0.8, "--seed", seed, *common)[1] == unseeded[1]
    assert run(capsys, "generate", model_path, "hi", "--chat", *common)[0] == 0
    assert run(capsys, "generate", model_path, "def f(", "--fim-suffix", "):\n    pass", *common)[0] == 0


def test_generate_speculate(capsys, monkeypatch, model_path):
    argv = ["generate", model_path, "def add(a, b):\n    return a + b\n\n\ndef add(a, b):", "--max-new-tokens", 24,
            "--backend", "numpy"]
    plain = run(capsys, *argv)
    status, stdout, stderr = run(capsys, *argv, "--speculate", 4)
    assert status == 0 and stdout == plain[1]
    assert re.search(r"decode [\d.]+ tokens/s on numpy, [\d.]+ tokens per pass over the weights\]", stderr)
    assert "per pass" not in plain[2]
    lines = iter(["def f(x):\n    return x\n\n\ndef f(x):", "/exit"])
    monkeypatch.setattr("nanoqwen.cli._read_turn", lambda limit: next(lines))
    assert run(capsys, "chat", model_path, "--speculate", 4, "--max-new-tokens", 8, "--backend", "numpy")[0] == 0


def test_generate_token_ids(capsys, model_path):
    status, stdout, _ = run(capsys, "generate", model_path, "1, 2 3", "--token-ids", "--max-new-tokens", 4,
                            "--backend", "numpy")
    expected = Engine(model_path, backend="numpy").generate([1, 2, 3], max_new_tokens=4).token_ids
    assert status == 0 and [int(t) for t in stdout.split()] == expected


@pytest.mark.parametrize("argv, message", [
    (["generate", "{model}", "x", "--top-p", "0"], "top_p"),
    (["generate", "{model}", "x", "--max-new-tokens", "100000"], "exceeds"),
    (["generate", "{model}", "x", "--speculate", "17"], "speculate must be an integer in 0..16"),
    (["generate", "{model}", "x y", "--token-ids"], "must be integers"),
    (["generate", "{model}", "\u0661\u0662 1", "--token-ids"], "must be integers in ASCII digits"),  # int() reads 12
    (["generate", "{model}", "1_0", "--token-ids"], "must be integers in ASCII digits"),  # int() reads 10
    (["generate", "{model}", "999999", "--token-ids"], "outside the vocabulary"),
    (["generate", "{missing}", "x"], "cannot open"),
    (["inspect", "{missing}"], "cannot open"),
    (["generate", "", "x"], "a model path is empty"),
    (["inspect", ""], "a model path is empty"),
    (["generate", "{model}", "x", "--max-context", "1"], "max_context must be an integer in 2.."),
    (["convert", "{missing}", "{missing}.out"], "not a checkpoint directory"),
])
def test_errors_are_one_line_with_status_1(capsys, model_path, tmp_path, argv, message):
    argv = [a.format(model=model_path, missing=tmp_path / "missing") for a in argv]
    status, _, stderr = run(capsys, *argv, *(["--backend", "numpy"] if argv[0] == "generate" else []))
    assert status == 1
    assert message in stderr and "Traceback" not in stderr and stderr.count("\n") == 1


def test_running_out_of_memory_is_a_one_line_error(capsys, monkeypatch, model_path):
    """A valid file whose shapes (or a context) need more memory than the machine has: NumPy's
    MemoryError (CuPy's OutOfMemoryError derives from it) is named, not a traceback."""
    import numpy as np

    def allocate(self, *args, **kwargs):
        np.zeros(2**62, dtype=np.uint8)

    monkeypatch.setattr(Engine, "__init__", allocate)
    status, _, stderr = run(capsys, "generate", model_path, "x", "--backend", "numpy")
    assert status == 1 and "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert stderr.startswith("nanoqwen generate: error: out of memory (Unable to allocate 4.00 EiB"), stderr


def test_corrupt_file_is_a_one_line_error(capsys, model_path, tmp_path):
    corrupt = tmp_path / "corrupt.nanoqwen"
    data = bytearray(model_path.read_bytes())
    data[300] ^= 0xFF  # inside the tensor table
    corrupt.write_bytes(bytes(data))
    status, _, stderr = run(capsys, "inspect", corrupt)
    assert status == 1 and "checksum" in stderr


def test_default_model_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "DEFAULT_MODEL", tmp_path / "nano-coder.nanoqwen")
    status, _, stderr = run(capsys, "generate", "def f():")
    assert status == 1 and "nano-coder is missing" in stderr


def test_usage_errors_exit_2(capsys):
    for argv in (["generate"], ["bogus"], ["generate", "m", "p", "--temperature", "hot"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
    assert cli.main([]) == 2


def test_chat_keeps_history_and_survives_errors(capsys, monkeypatch, model_path):
    lines = iter(["hello", "/reset", "write code", "/exit"])
    monkeypatch.setattr("nanoqwen.cli._read_turn", lambda limit: next(lines))
    seen = []
    original = Engine.stream

    def recording_stream(self, prompt, **kwargs):
        seen.append([dict(m) for m in prompt])
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(Engine, "stream", recording_stream)
    status, stdout, _ = run(capsys, "chat", model_path, "--max-new-tokens", 5, "--backend", "numpy", "--system", "Be brief.")
    assert status == 0 and "/exit to leave" in stdout
    assert [m["role"] for m in seen[0]] == ["system", "user"]
    assert [m["content"] for m in seen[1]] == ["Be brief.", "write code"]  # /reset forgot "hello"

    lines = iter(["a question far too long for the context", "still here?", "/exit"])
    monkeypatch.setattr("nanoqwen.cli._read_turn", lambda limit: next(lines))
    seen.clear()
    engine = Engine(model_path, backend="numpy")
    room = engine.max_context - len(engine.encode_prompt([{"role": "user", "content": "still here?"}], chat=True))
    engine.close()
    status, _, stderr = run(capsys, "chat", model_path, "--max-new-tokens", room, "--backend", "numpy")
    assert status == 0 and "exceeds" in stderr
    assert [m["content"] for m in seen[-1]] == ["still here?"]  # the failed turn left no trace


@pytest.mark.parametrize("option, value, message", [("--temperature", -1, "temperature must be"),
                                                    ("--max-new-tokens", 0, "max_new_tokens must be"),
                                                    ("--max-new-tokens", 4096, "leave it no room in the context"),
                                                    ("--system", "caf\udce9", "--system is not valid Unicode")])
def test_chat_refuses_bad_settings_before_the_first_turn(capsys, monkeypatch, model_path, option, value, message):
    monkeypatch.setattr("nanoqwen.cli._read_turn", lambda limit: pytest.fail("asked for a turn it could never answer"))
    status, stdout, stderr = run(capsys, "chat", model_path, option, value, "--backend", "numpy")
    assert status == 1 and message in stderr and stderr.count("\n") == 1 and not stdout


def test_chat_ends_on_eof(capsys, monkeypatch, model_path):
    def eof(limit):
        raise EOFError

    monkeypatch.setattr("nanoqwen.cli._read_turn", eof)
    assert run(capsys, "chat", model_path, "--backend", "numpy")[0] == 0


def test_a_closed_stdout_is_no_traceback(model_path):
    """`nanoqwen generate ... >&-`: Python gives a closed stream as None; the output goes nowhere."""
    closed = subprocess.run(["bash", "-c", f'"{sys.executable}" -m nanoqwen generate "{model_path}" "1 2" --token-ids '
                             "--max-new-tokens 2 --backend numpy >&-"], capture_output=False, stderr=subprocess.PIPE, text=True)
    assert closed.returncode == 0 and "Traceback" not in closed.stderr and "2 tokens" in closed.stderr


@pytest.mark.parametrize("command, message", [
    ("generate {model} -", "PROMPT is '-' but stdin is closed"),
    ("chat {model}", "chat reads its turns from stdin, which is closed"),
])
def test_a_closed_stdin_is_one_error_line(model_path, command, message):
    """`nanoqwen generate MODEL - <&-`: Python gives a closed stdin as None."""
    command = command.format(model=f'"{model_path}"')
    closed = subprocess.run(["bash", "-c", f'"{sys.executable}" -m nanoqwen {command} --backend numpy <&-'],
                            capture_output=True, text=True, timeout=120)
    assert closed.returncode == 1 and closed.stderr.count("\n") == 1 and message in closed.stderr, closed.stderr


def test_a_prompt_too_long_for_the_context_is_refused_before_encoding(capsys, monkeypatch, model_path):
    from nanoqwen import tokenizer

    def literal_ids(backend, text):  # the tokenizer's probe still runs
        assert len(text) < 1000, "encoded a prompt that cannot fit"
        return original(backend, text)

    original = tokenizer._literal_ids
    monkeypatch.setattr(tokenizer, "_literal_ids", literal_ids)
    status, _, stderr = run(capsys, "generate", model_path, "x" * 10**6, "--max-context", 64, "--backend", "numpy")
    assert status == 1 and stderr.count("\n") == 1, stderr
    assert "the text has 1,000,000 bytes of UTF-8, more than 64 tokens can hold" in stderr


def test_python_dash_m(model_path):
    ok = subprocess.run([sys.executable, "-m", "nanoqwen", "generate", str(model_path), "1 2", "--token-ids",
                         "--max-new-tokens", "3", "--backend", "numpy"], capture_output=True, text=True)
    assert ok.returncode == 0 and len(ok.stdout.split()) == 3
    bad = subprocess.run([sys.executable, "-m", "nanoqwen", "inspect", str(model_path) + ".nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "nanoqwen", "generate"], capture_output=True, text=True)
    assert usage.returncode == 2


def test_a_reader_that_leaves_early_ends_generate_quietly(model_path):
    """`nanoqwen generate ... | head -c 1`: a closed pipe is no error to report."""
    child = subprocess.Popen([sys.executable, "-m", "nanoqwen", "generate", str(model_path), "1 2", "--token-ids",
                              "--max-new-tokens", "60", "--backend", "numpy"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.read(1)
    child.stdout.close()
    stderr = child.stderr.read()
    assert child.wait(timeout=120) == 141 and stderr == "", stderr


@pytest.mark.skipif(cuda_available(), reason="checks the message on a machine without a CUDA GPU")
def test_bench_without_a_gpu_is_a_one_line_error(capsys, model_path):
    status, _, stderr = run(capsys, "bench", model_path)
    assert status == 1 and "needs CuPy and a Hopper GPU" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("arguments, message", [
    (["--seed", "-1"], "--seed >= 0"),
    (["--json", "{tmp}/no/such/folder/report.json"], "--json: {tmp}/no/such/folder/report.json: the folder"),
    (["--json", "{tmp}"], "--json: {tmp}: is a folder"),
    (["--json", "{tmp}/"], "names a folder"),
    (["--json", ""], "--json: the output path is empty"),
    (["--json", "/dev/null"], "/dev/null: exists and is not a regular file"),
    (["--json", "{tmp}/null.json"], "null.json: exists and is not a regular file"),  # a link to /dev/null
])
def test_bench_refuses_bad_arguments_before_measuring(capsys, model_path, tmp_path, arguments, message):
    (tmp_path / "null.json").symlink_to("/dev/null")
    status, _, stderr = run(capsys, "bench", model_path, *[a.format(tmp=tmp_path) for a in arguments])
    assert status == 2 and message.format(tmp=tmp_path) in stderr and "Traceback" not in stderr


def test_bench_writes_its_json_whole(capsys, model_path, tmp_path, monkeypatch):
    import nanoqwen.bench as bench

    monkeypatch.setattr(bench, "run_bench", lambda *args, **kwargs: {"gpu": "none", "rows": [1.5]})
    monkeypatch.setattr(bench, "format_report", lambda report: "report")
    out = tmp_path / "bench.json"
    out.write_text("an older report")
    status, stdout, _ = run(capsys, "bench", model_path, "--json", out)
    assert status == 0 and stdout.strip() == "report"
    assert json.loads(out.read_text()) == {"gpu": "none", "rows": [1.5]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no partial file left beside it


def test_inspect_prints_the_table_it_validated_when_the_path_changes(capsys, model_path, tmp_path, monkeypatch):
    """A new file renamed over the path after the load (which the loader calls safe) is not read."""
    import os
    import shutil

    import nanoqwen.loader as loader

    path = tmp_path / "m.nanoqwen"
    shutil.copy(model_path, path)
    load = loader.load

    def load_then_rename_over(*args, **kwargs):
        model = load(*args, **kwargs)
        (tmp_path / "other").write_bytes(b"\xff" * 4096)
        os.replace(tmp_path / "other", path)
        return model

    monkeypatch.setattr(loader, "load", load_then_rename_over)
    status, stdout, stderr = run(capsys, "inspect", path)
    assert status == 0 and "model.embed_tokens.weight" in stdout and stderr == ""
    assert f"{os.path.getsize(model_path):,} bytes" in stdout.splitlines()[0]
