"""Small helpers the book's chapters share: show package code, print tables, find results/.

Chapters run with chapters/ as the working directory (Jupyter Book and nbval both start
their kernels there), so paths are found from the package, not from the current folder.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import nanoqwen


def show(obj) -> None:
    """Display the source of a package function, class or module (the book never copies code)."""
    from IPython.display import Code, display

    display(Code(inspect.getsource(obj), language="python"))


def markdown_table(header, rows) -> str:
    """A Markdown table from a header and rows of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def table(header, rows) -> None:
    """Display `markdown_table(header, rows)` as rendered Markdown."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(header, rows)))


def repo_root() -> Path:
    """The source tree holding the package (and results/), when nanoqwen runs from one."""
    return Path(nanoqwen.__file__).resolve().parents[1]


def results_dir() -> Path:
    """Where recorded GPU measurements live: $NANOQWEN_RESULTS_DIR, else the tree's results/."""
    return Path(os.environ.get("NANOQWEN_RESULTS_DIR", repo_root() / "results"))
