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
    """A Markdown table from a header and rows of already formatted cells; a `|` inside a cell
    (a kernel named q|k|v, say) is escaped so that it does not split the cell."""
    def line(cells) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in rows)])


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
