"""pytest setup for nanoqwen: the unit tests in tests/ and every chapter of the book.

Running ``pytest`` from the repository root (``testpaths = tests chapters`` in
pyproject.toml) does two things:

* collects the unit tests in ``tests/`` as usual;
* collects every MyST Markdown notebook ``chapters/*.md``. nbval 0.11 only reads
  ``.ipynb`` files, so each chapter is converted with jupytext, at collection time,
  into ``_build/nbval/<chapter>.ipynb`` (same stem as the chapter), and its code cells
  run in order in one Jupyter kernel of the current environment, started in
  ``chapters/`` as Jupyter Book does. Each code cell is one test item named
  ``chapters/<chapter>.md::Cell <n>`` (n counts code cells from 0); a failure names
  the chapter, the cell and the line of its ``{code-cell}`` directive.

Chapters carry no stored outputs, so nothing is compared (nbval's "lax" mode): a
chapter checks itself with ``assert``. A cell tagged ``raises-exception`` (or holding
``# NBVAL_RAISES_EXCEPTION``) must raise; ``nbval-skip`` / ``# NBVAL_SKIP`` skips it.

Useful invocations::

    pytest                          # unit tests + every chapter
    pytest tests                    # unit tests only
    pytest -k 05_paged_attention    # one chapter (keyword match on its file name)
    pytest -m gpu                   # only the tests that need a GPU

Tests marked ``@pytest.mark.gpu`` are skipped when CuPy cannot see a CUDA device.
Set ``NANOQWEN_REQUIRE_GPU=1`` (on a GPU machine) to make that an error instead, so a
broken CuPy install cannot pass as "all skipped".
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, RunningKernel
from nbval.plugin import IPyNbCell, IPyNbFile, find_comment_markers, find_metadata_tags

TOOLS_DIR = Path(__file__).resolve().parents[1] / "tools"
CHAPTER_DIR = "chapters"
NBVAL_BUILD_DIR = Path("_build") / "nbval"
_PLUGIN_NAME = "nanoqwen-chapters"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def load_tool(name: str):
    """The script tools/<name>.py as a module, for tests of its arithmetic. The scripts are run,
    not installed, so they are loaded from their file rather than found on sys.path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(TOOLS_DIR))  # a tool imports its siblings (record.py) as it does when run
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS_DIR))
    return module


# --------------------------------------------------------------------------- chapters


def is_text_notebook(path: Path) -> bool:
    """True when ``path`` is a Markdown file whose YAML front matter declares a kernel
    or a jupytext format (a MyST notebook), False for plain Markdown."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    if not text.startswith("---"):
        return False
    end = text.find("\n---", 3)
    if end < 0:
        return False
    front = text[3:end]
    return re.search(r"^\s*(kernelspec|jupytext)\s*:", front, re.MULTILINE) is not None


def code_cell_lines(text: str) -> list[int]:
    """1-based line numbers of the top-level ``{code-cell}`` fences of a MyST notebook,
    in order. Fences nested inside another fence (an example shown in prose) are
    skipped, as jupytext skips them."""
    found: list[int] = []
    fence: tuple[str, int] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = (m.group(1)[0], len(m.group(1)))
                if m.group(2).strip().startswith("{code-cell}"):
                    found.append(number)
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1] and not m.group(2).strip():
            fence = None
    return found


def convert_chapter(md_path: Path, out_dir: Path):
    """Convert one MyST Markdown chapter to ``out_dir/<stem>.ipynb``; return
    ``(notebook, ipynb_path)``."""
    import jupytext
    import nbformat

    nb = jupytext.read(md_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    ipynb_path = out_dir / f"{md_path.stem}.ipynb"
    nbformat.write(nb, str(ipynb_path))
    return nb, ipynb_path


class ChapterCell(IPyNbCell):
    """One code cell of a chapter, reported against the chapter's Markdown source."""

    def __init__(self, name, parent, cell_num, cell, options, md_line=None):
        super().__init__(name, parent, cell_num, cell, options)
        self.md_line = md_line

    def _where(self) -> str:
        rel = self.path.relative_to(self.config.rootpath).as_posix()
        line = f", line {self.md_line}" if self.md_line else ""
        return f"{rel}: code cell {self.cell_num}{line}"

    def reportinfo(self):
        if self.md_line:
            return self.path, self.md_line - 1, f"{self.nodeid} (line {self.md_line})"
        return self.path, None, self.nodeid

    def repr_failure(self, excinfo):
        text = f"Chapter {self._where()} failed\n" + str(super().repr_failure(excinfo))
        if not self.config.get_terminal_writer().hasmarkup:  # CI logs, files, pipes
            text = _ANSI.sub("", text)
        return text


class ChapterNotebook(IPyNbFile):
    """A chapter ``chapters/<name>.md``: converted to ``_build/nbval/<name>.ipynb``
    when collected, then run cell by cell in one kernel of the current environment."""

    ipynb_path: Path | None = None

    def collect(self):
        self.nb, self.ipynb_path = convert_chapter(self.path, self.config.rootpath / NBVAL_BUILD_DIR)
        lines = code_cell_lines(self.path.read_text(encoding="utf-8"))
        code_cells = [c for c in self.nb.cells if c.cell_type == "code"]
        if len(lines) != len(code_cells):  # unusual fences: report without line numbers
            lines = [None] * len(code_cells)
        for number, (cell, line) in enumerate(zip(code_cells, lines)):
            options = defaultdict(bool, find_metadata_tags(cell.metadata))
            options.update(find_comment_markers(cell.source))
            options.setdefault("check", False)  # lax: text notebooks store no outputs
            yield ChapterCell.from_parent(
                self, name=f"Cell {number}", cell_num=number, cell=cell, options=options, md_line=line
            )

    def setup(self):
        option = self.config.option
        kernel_name = option.nbval_kernel_name or CURRENT_ENV_KERNEL_NAME
        # cwd = chapters/, as when Jupyter Book executes the page.
        self.kernel = RunningKernel(
            kernel_name,
            cwd=str(self.path.parent),
            startup_timeout=option.nbval_kernel_startup_timeout,
        )
        self.setup_sanitize_files()
        if getattr(option, "cov_source", None):
            from nbval.cover import setup_coverage

            setup_coverage(self.config, self.kernel, getattr(self, "fspath", None))


class ChapterCollector:
    """Registered as a global plugin so that it sees ``chapters/`` even though this
    conftest lives in ``tests/`` (a conftest's own collection hooks only apply below
    its folder)."""

    @staticmethod
    def pytest_collect_file(file_path: Path, parent):
        root = parent.config.rootpath
        if (
            file_path.suffix == ".md"
            and file_path.parent == root / CHAPTER_DIR
            and is_text_notebook(file_path)
        ):
            return ChapterNotebook.from_parent(parent, path=file_path)
        return None


def pytest_configure(config):
    if not config.pluginmanager.has_plugin(_PLUGIN_NAME):
        config.pluginmanager.register(ChapterCollector(), _PLUGIN_NAME)


# --------------------------------------------------------------------------- gpu marker

_gpu_probe: tuple[bool, str] | None = None


def gpu_available() -> tuple[bool, str]:
    """(True, description) when CuPy imports and sees at least one CUDA device."""
    global _gpu_probe
    if _gpu_probe is None:
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            _gpu_probe = (count > 0, f"{count} CUDA device(s)")
        except Exception as exc:  # ImportError, CUDARuntimeError, missing driver...
            _gpu_probe = (False, f"{type(exc).__name__}: {exc}".strip())
    return _gpu_probe


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    ok, why = gpu_available()
    if ok:
        return
    if os.environ.get("NANOQWEN_REQUIRE_GPU", "") not in ("", "0"):
        raise pytest.UsageError(f"NANOQWEN_REQUIRE_GPU is set but no usable GPU: {why}")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU and CuPy ({why})")
    for item in gpu_items:
        item.add_marker(skip)
