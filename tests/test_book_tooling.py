"""Checks of the book tooling: the chapter collector in tests/conftest.py, the gpu
marker, and the promises that tie README, CI, packaging and the table of contents
together."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

pytest_plugins = "pytester"

REPO = Path(__file__).resolve().parents[1]
CONFTEST = Path(__file__).with_name("conftest.py")

# A synthetic chapter: one passing cell (which also checks the working directory),
# one failing assert, one cell that must raise. The first fence is an example shown
# in prose, nested in a four-backtick block: it is not a cell.
CHAPTER = '''\
---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# A synthetic chapter

````markdown
```{code-cell} ipython3
this is an example in prose, not a cell
```
````

```{code-cell} ipython3
import os
x = 21 * 2
assert x == 42
assert os.path.basename(os.getcwd()) == "chapters", os.getcwd()
```

Some prose between the cells.

```{code-cell} ipython3
assert x == 41, "the chapter's own check failed"
```

```{code-cell} ipython3
:tags: [raises-exception]
raise ValueError("shown on purpose")
```
'''
# The failing cell is the third ```{code-cell} line of the text (the first is the
# example nested in prose), i.e. the second real code cell.
FAILING_CELL_LINE = [n for n, line in enumerate(CHAPTER.splitlines(), 1) if line.startswith("```{code-cell}")][2]

# Code cells in a page that is not a chapter are not collected.
OTHER_PAGE = "---\nkernelspec:\n  name: python3\n---\n\n```{code-cell} ipython3\nassert False\n```\n"

UNIT_TESTS = '''\
import pytest


def test_plain():
    assert 1 + 1 == 2


@pytest.mark.gpu
def test_needs_gpu():
    import cupy
    assert cupy.cuda.runtime.getDeviceCount() > 0
'''


@pytest.fixture
def book(pytester):
    """A miniature repository laid out like nanoqwen, using the real conftest."""
    pytester.makeini(
        """
        [pytest]
        testpaths = tests chapters
        markers =
            gpu: needs a CUDA GPU and CuPy; skipped otherwise
        """
    )
    (pytester.path / "tests").mkdir()
    shutil.copy(CONFTEST, pytester.path / "tests" / "conftest.py")
    (pytester.path / "tests" / "test_unit.py").write_text(UNIT_TESTS)
    (pytester.path / "chapters").mkdir()
    (pytester.path / "chapters" / "01_demo.md").write_text(CHAPTER)
    (pytester.path / "chapters" / "notes.md").write_text("# Notes\n\nPlain Markdown, no kernel.\n")
    (pytester.path / "book").mkdir()
    (pytester.path / "book" / "intro.md").write_text(OTHER_PAGE)
    return pytester


def test_chapter_cells_run_and_a_failure_names_chapter_and_cell(book):
    result = book.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    # unit test + cells 0 and 2 pass; the gpu test passes or is skipped; cell 1 fails.
    assert outcomes.get("failed") == 1, result.stdout.str()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4, result.stdout.str()
    assert "error" not in outcomes and "errors" not in outcomes, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*tests/test_unit.py::test_plain PASSED*",
            "*chapters/01_demo.md::Cell 0 PASSED*",
            "*chapters/01_demo.md::Cell 1 FAILED*",
            "*chapters/01_demo.md::Cell 2 PASSED*",
        ]
    )
    # The failure report points at the chapter source, the cell and its line,
    # and shows the assert message from inside the kernel.
    result.stdout.fnmatch_lines(
        [
            f"*chapters/01_demo.md::Cell 1 (line {FAILING_CELL_LINE})*",
            f"Chapter chapters/01_demo.md: code cell 1, line {FAILING_CELL_LINE} failed",
            "*AssertionError*the chapter's own check failed*",
            "FAILED chapters/01_demo.md::Cell 1*",
        ]
    )
    # Neither plain Markdown in chapters/ nor pages outside chapters/ are collected.
    assert "notes.md" not in result.stdout.str()
    assert "book/intro.md" not in result.stdout.str()
    # The converted notebook sits where the docs say, named after the chapter.
    converted = book.path / "_build" / "nbval" / "01_demo.ipynb"
    assert converted.is_file()
    import nbformat

    nb = nbformat.read(str(converted), as_version=4)
    assert [c.cell_type for c in nb.cells].count("code") == 3


def test_one_chapter_by_keyword(book):
    result = book.runpytest_subprocess("-k", "01_demo", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1, deselected=2)


def test_gpu_marker_skips_without_a_gpu_and_can_be_required(book, monkeypatch):
    cupy_sees_gpu = False
    try:
        import cupy

        cupy_sees_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        pass
    result = book.runpytest_subprocess("tests", "-rs", "-p", "no:cacheprovider")
    if cupy_sees_gpu:
        result.assert_outcomes(passed=2)
        return
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*needs a CUDA GPU and CuPy*"])
    monkeypatch.setenv("NANOQWEN_REQUIRE_GPU", "1")
    result = book.runpytest_subprocess("tests", "-p", "no:cacheprovider")
    assert result.ret != 0
    assert "NANOQWEN_REQUIRE_GPU is set but no usable GPU" in result.stderr.str() + result.stdout.str()


# --------------------------------------------------------------------------- repository promises


def _toc_files(node) -> list[str]:
    files: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("root", "file") and isinstance(value, str):
                files.append(value)
            else:
                files.extend(_toc_files(value))
    elif isinstance(node, list):
        for item in node:
            files.extend(_toc_files(item))
    return files


def _toc() -> dict:
    import yaml

    return yaml.safe_load((REPO / "_toc.yml").read_text())


def test_toc_entries_exist():
    toc = _toc()
    assert toc["format"] == "jb-book"
    missing = [f for f in _toc_files(toc) if not any((REPO / (f + ext)).is_file() for ext in ("", ".md", ".ipynb"))]
    assert not missing, f"_toc.yml lists pages that do not exist: {missing}"


def test_every_chapter_is_in_the_toc():
    from conftest import is_text_notebook

    listed = {Path(f).with_suffix("").as_posix() for f in _toc_files(_toc())}
    chapters = sorted(p for p in (REPO / "chapters").glob("*.md") if is_text_notebook(p))
    absent = [p.relative_to(REPO).with_suffix("").as_posix() for p in chapters]
    absent = [c for c in absent if c not in listed]
    assert not absent, (
        "chapters missing from _toc.yml (add '- file: <name>' under the part "
        f"'Building the runtime', in reading order): {absent}"
    )


def _quickstart_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", section, re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_readme_quickstart_is_what_ci_runs():
    commands = _quickstart_commands()
    assert len(commands) == 2, f"the README quickstart must be exactly two commands: {commands}"
    book_cmd = next(c for c in commands if "jupyter-book build" in c)
    test_cmd = next(c for c in commands if "pytest" in c)
    ci = (REPO / ".ci" / "run").read_text()
    ci_lines = [line.strip() for line in ci.splitlines()]
    assert any(line.startswith(test_cmd) for line in ci_lines), (
        f".ci/run must run the README's test command verbatim: {test_cmd!r}"
    )
    assert book_cmd.split("&&")[-1].strip() == "jupyter-book build . -W --keep-going"
    assert book_cmd in ci_lines, f".ci/run must run the README's book command verbatim: {book_cmd!r}"
    assert "python3 -m venv" in ci, ".ci/run must install into a fresh virtual environment"


def test_markdown_tables_escape_pipes_inside_cells():
    """A cell naming the q|k|v projection stays one cell in the rendered table."""
    from nanoqwen.book.notebook import markdown_table

    lines = markdown_table(["kernel", "µs"], [["without q|k|v GEMV", 28]]).splitlines()
    assert lines == ["| kernel | µs |", "|---|---|", "| without q\\|k\\|v GEMV | 28 |"]
