"""The scripts under tools/ as a user meets them on a machine that cannot run them: one line on
stderr naming the problem and an exit status, never a traceback, and no files of the user's touched.

CPU-only and quick: each run stops before any model is built or any GPU work starts. A check that
needs a machine without a GPU (or without some program) is skipped where the machine has one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_tool
from nanoqwen.backends import cuda_available

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
NEEDS_GPU = "needs CuPy and a Hopper GPU"

record = load_tool("record")

# Each GPU tool with the arguments it needs to get past its parser.
GPU_TOOLS = {
    "bench_kernels": [],
    "bench_speculative": ["--out", "{tmp}/speculative"],
    "decode_by_size": ["--out", "{tmp}/decode-by-size"],
    "gpu_check_attention": ["--quick"],
    "step_timeline": ["{tmp}/model.nanoqwen"],
    "block_trace": ["{tmp}/model.nanoqwen"],
    "check_by_size": ["--out", "{tmp}/check-by-size"],
}


def run_tool(name: str, *args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def one_line(stderr: str) -> str:
    """The only line of stderr (no traceback, no usage block)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def without_gpu():
    if cuda_available():
        pytest.skip("this machine has a GPU the CUDA backend can use")


@pytest.mark.parametrize("name", GPU_TOOLS)
def test_a_gpu_tool_without_a_gpu_says_so_in_one_line(name, tmp_path):
    without_gpu()
    done = run_tool(name, *(a.format(tmp=tmp_path) for a in GPU_TOOLS[name]))
    assert done.returncode == 2, done.stderr
    assert one_line(done.stderr).startswith(f"{name}: {NEEDS_GPU} (")
    assert list(tmp_path.iterdir()) == []  # no record, no model written before the refusal


@pytest.mark.parametrize("name", [*GPU_TOOLS, "sanitize_engine", "measure_convert_7b", "compile_kernels",
                                  "check_vs_transformers"])
def test_help_works_anywhere_and_describes_the_tool(name):
    done = run_tool(name, "--help")
    assert done.returncode == 0, done.stderr
    description = " ".join(done.stdout.split("\n\n")[1].split())
    assert description.endswith("."), description  # a whole sentence, not one cut at a line end


def test_sanitize_engine_needs_compute_sanitizer_and_a_gpu():
    has_sanitizer = record.compute_sanitizer() is not None
    if has_sanitizer and cuda_available():
        pytest.skip("this machine can run the sanitizers")
    done = run_tool("sanitize_engine")
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert line.startswith("sanitize_engine: needs compute-sanitizer" if not has_sanitizer
                           else f"sanitize_engine: {NEEDS_GPU}"), line


def test_require_gpu_exits_2_with_the_reason(monkeypatch, capsys):
    import nanoqwen.backends

    monkeypatch.setattr(nanoqwen.backends, "cuda_unavailable_reason", lambda: "no GPU in this test")
    with pytest.raises(SystemExit) as exit:
        record.require_gpu("some_tool")
    assert exit.value.code == 2
    assert capsys.readouterr().err == f"some_tool: {NEEDS_GPU} (no GPU in this test)\n"
    monkeypatch.setattr(nanoqwen.backends, "cuda_unavailable_reason", lambda: None)
    record.require_gpu("some_tool")  # returns where the GPU path can run


def test_the_scratch_folder_goes_on_an_error(tmp_path):
    with pytest.raises(RuntimeError):
        with record.scratch_folder() as folder:
            (folder / "model.nanoqwen").write_bytes(b"x" * 1000)
            raise RuntimeError("the tool failed")
    assert not folder.exists()


def test_the_scratch_folder_goes_when_timeout_ends_the_tool():
    script = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); from record import scratch_folder\n"
              "with scratch_folder() as folder:\n"
              "    (folder / 'model.nanoqwen').write_bytes(b'x')\n"
              "    print(folder, flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n")
    done = subprocess.run([sys.executable, "-c", script, str(TOOLS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert not Path(done.stdout.strip()).exists()


def test_check_by_size_records_the_command_it_ran():
    check_by_size = load_tool("check_by_size")
    args = argparse.Namespace(out=Path("/tmp/elsewhere/check-by-size-h100"), presets=["qwen2.5-coder-0.5b"],
                              no_long_prompt=True, timeout=600)
    assert check_by_size.command(args) == ("python3 tools/check_by_size.py --presets qwen2.5-coder-0.5b "
                                           "--no-long-prompt --timeout 600 --out results/check-by-size-h100")
    args = argparse.Namespace(out=Path("check-by-size-gpu"), presets=["qwen2.5-coder-7b", "qwen2.5-coder-3b"],
                              no_long_prompt=False, timeout=check_by_size.TIMEOUT_S)
    assert check_by_size.command(args) == ("python3 tools/check_by_size.py --presets qwen2.5-coder-7b "
                                           "qwen2.5-coder-3b --out results/check-by-size-gpu")


@pytest.mark.parametrize("existing", ["checkpoint", "qwen2.5-coder-7b-random.nanoqwen"])
def test_measure_convert_7b_leaves_the_users_files(existing, tmp_path):
    mine = tmp_path / existing
    if existing == "checkpoint":
        mine.mkdir()
        (mine / "config.json").write_text("{}")
    else:
        mine.write_text("not to be deleted")
    done = run_tool("measure_convert_7b", "--workdir", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "already exists" in one_line(done.stderr)
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted([existing] + ["config.json"] * mine.is_dir())


def test_measure_convert_7b_removes_its_checkpoint_when_timeout_ends_it(tmp_path):
    proc = subprocess.Popen([sys.executable, str(TOOLS / "measure_convert_7b.py"), "--workdir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        while not (tmp_path / "checkpoint").exists() and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # while the 15 GB checkpoint is being written
        stderr = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_measure_convert_7b_refuses_a_workdir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    for workdir in (tmp_path / "file", tmp_path / "file" / "below"):
        done = run_tool("measure_convert_7b", "--workdir", str(workdir))
        assert done.returncode == 2, done.stderr
        assert str(workdir) in one_line(done.stderr)
    assert (tmp_path / "file").read_text() == "x"


def test_the_attention_check_bundles_its_sanitizer_logs_and_removes_them(tmp_path):
    gpu_check_attention = load_tool("gpu_check_attention")
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir(), out.mkdir()
    jobs = []
    for tool in ("racecheck", "memcheck"):
        logfile = scratch / f"sanitizer-{tool}-fixed.txt"
        logfile.write_text(f"========= {tool.upper()} ERROR SUMMARY: 0 errors\n")
        jobs.append(("fixed", tool, logfile, subprocess.Popen([sys.executable, "-c", ""])))
    results = {}
    gpu_check_attention.collect_sanitizers(jobs, results, out, deadline=time.time() + 30)
    assert [row["status"] for row in results["sanitizer"]] == [0, 0]
    assert "MEMCHECK ERROR SUMMARY" in (out / "sanitizer-logs.txt").read_text()
    assert not scratch.exists()


def test_check_vs_transformers_rejects_too_few_steps_before_running(tmp_path):
    model = tmp_path / "model.nanoqwen"
    model.write_bytes(b"")  # never opened: the parser refuses first
    done = run_tool("check_vs_transformers", "--model", str(model), "--steps", "4")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("--steps 4: at least 32 decode steps are required")
    assert "[open .nanoqwen]" not in done.stdout
    assert "at least 32" in " ".join(run_tool("check_vs_transformers", "--help").stdout.split())


@pytest.mark.parametrize("arguments, message", [
    (["--seed", "-1"], "--seed (-1) must be >= 0"),
    (["--tolerance-factor", "nan"], "--tolerance-factor (nan) must be a positive, finite number"),
    (["--tolerance-factor", "inf"], "--tolerance-factor (inf) must be a positive, finite number"),
    (["--tolerance-factor", "0"], "--tolerance-factor (0.0) must be a positive, finite number"),
])
def test_check_vs_transformers_refuses_numbers_that_void_its_verdict(tmp_path, arguments, message):
    model = tmp_path / "model.nanoqwen"
    model.write_bytes(b"")  # never opened: the parser refuses first
    done = run_tool("check_vs_transformers", "--model", str(model), *arguments)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(message), done.stderr


# Each tool that writes a file when it ends, with the option that names it and what gets it past its parser.
OUTPUT_OPTIONS = [
    ("bench_kernels", "--out", []), ("bench_kernels", "--json", []), ("bench_int8_vs_fp16", "--json", []),
    ("bench_speculative", "--out", []), ("decode_by_size", "--out", []), ("check_by_size", "--out", []),
    ("sanitize_engine", "--json", []), ("step_timeline", "--json", ["{tmp}/model.nanoqwen"]),
    ("block_trace", "--json", ["{tmp}/model.nanoqwen"]), ("check_vs_transformers", "--json", ["--model", "{tmp}/m"]),
]


@pytest.mark.parametrize("name, option, arguments", OUTPUT_OPTIONS)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(name, option, arguments, tmp_path):
    rest = [a.format(tmp=tmp_path) for a in arguments]
    for target, message in ((tmp_path / "no" / "record", "does not exist"), (tmp_path, "is a folder")):
        done = run_tool(name, *rest, option, str(target))
        assert done.returncode == 2 and message in done.stderr.strip().splitlines()[-1], done.stderr
        assert "Traceback" not in done.stderr


def test_decode_by_size_refuses_a_context_without_room_for_its_tokens(tmp_path):
    done = run_tool("decode_by_size", "--out", str(tmp_path / "r"), "--long-contexts", "4096", "-5")
    assert done.returncode == 2 and "--long-contexts -5: a context must exceed the 128 tokens" in done.stderr


def needs_torch():
    import importlib.util

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("check_vs_transformers needs torch and transformers")


def test_check_vs_transformers_names_a_file_that_is_not_a_model(tmp_path):
    needs_torch()
    model = tmp_path / "notes.txt"
    model.write_text("hello\n")
    done = run_tool("check_vs_transformers", "--model", str(model), "--backend", "numpy", "--device", "cpu")
    assert done.returncode == 1
    assert one_line(done.stderr).startswith(f"check_vs_transformers: {model}: ")


def test_check_vs_transformers_names_the_option_to_change_without_a_gpu(tmp_path):
    needs_torch()
    without_gpu()
    model = tmp_path / "model.nanoqwen"
    model.write_bytes(b"")
    done = run_tool("check_vs_transformers", "--model", str(model))  # --backend cuda --device cuda
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert "use --device cpu" in line or "use --backend numpy" in line, line
    done = run_tool("check_vs_transformers", "--model", str(model), "--device", "cpu")
    assert done.returncode == 2
    assert one_line(done.stderr).startswith(f"check_vs_transformers: --backend cuda: {NEEDS_GPU} ")


def test_compile_kernels_without_nvcc(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty folder: no nvcc
    done = run_tool("compile_kernels", "--report", str(tmp_path / "report.txt"), env=env)
    assert done.returncode == 2
    assert one_line(done.stderr) == "compile_kernels: needs nvcc on PATH (the CUDA toolkit's bin folder)"
    assert not (tmp_path / "report.txt").exists()


def run_session(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(TOOLS / "gpu_session.sh"), *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)


@pytest.mark.parametrize("mode", ["bogus", "-h", "--help"])
def test_gpu_session_prints_its_modes(mode, tmp_path):
    """Asked for (-h, --help): the usage on stdout, status 0; an unknown mode: on stderr, status 2."""
    done = run_session(mode, out=tmp_path / "out")
    asked = mode in ("-h", "--help")
    assert done.returncode == (0 if asked else 2)
    usage = done.stdout if asked else done.stderr
    assert "usage: bash tools/gpu_session.sh" in usage
    for known in ("tests", "checks", "records", "sizes", "persistent", "speculative", "book"):
        assert f"gpu_session.sh {known} " in usage
    assert "=== summary" not in done.stdout and not (tmp_path / "out").exists()  # nothing ran


def test_gpu_session_fails_when_a_step_fails(tmp_path):
    without_gpu()
    if shutil.which("timeout") is None:
        pytest.skip("no `timeout` program")
    done = run_session("sizes", out=tmp_path)  # decode_by_size refuses: no GPU
    assert done.returncode == 1, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()
    assert summary[-2] == "=== summary" and summary[-1].startswith("decode by size") and "rc=2" in summary[-1]


NANO_CODER_TRAIN = TOOLS / "nano_coder" / "train.py"


@pytest.mark.parametrize("option, value, message", [
    ("--fim-segment-chars", "0", "must be at least 1"), ("--seq-len", "1", "must be at least 2"),
    ("--batch-size", "0", "must be at least 1"), ("--batch-size", "-2", "must be at least 1"),
    ("--eval-windows", "0", "must be at least 1"), ("--sample-tokens", "0", "must be at least 1"),
    ("--grad-clip", "nan", "must be a positive number"), ("--lr", "inf", "must be a positive number"),
    ("--fim-rate", "1.5", "must lie between 0 and 1"), ("--weight-decay", "-0.1", "must be a number >= 0"),
    ("--reserve-seconds", "-1.5", "must be a number >= 0"),
])
def test_nano_coder_training_refuses_options_it_cannot_run_with(tmp_path, option, value, message):
    done = subprocess.run([sys.executable, str(NANO_CODER_TRAIN), "--out", str(tmp_path / "out"), option, value],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"{option} {value}: {message}" in done.stderr.splitlines()[-1], done.stderr
    assert list(tmp_path.iterdir()) == []


def test_nano_coder_training_stopped_by_sigterm_leaves_nothing(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("nano-coder's training needs torch")
    work, roots = tmp_path / "work", tmp_path / "work" / "roots"
    roots.mkdir(parents=True)
    for i in range(4):  # a training file and a held-out one at least
        (roots / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 200)
    log = tmp_path / "log"  # a file: a pipe nobody reads could fill and block the run
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, str(NANO_CODER_TRAIN), "--out", str(work / "out"), "--roots",
                                    str(roots), "--device", "cpu", "--train-seconds", "60", "--heldout-percent", "30"],
                                   stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 100
    while not list(work.glob(".out.*.partial")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(work.glob(".out.*.partial")), "the run never made its staging folder"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
    assert sorted(p.name for p in work.iterdir()) == ["roots"]
