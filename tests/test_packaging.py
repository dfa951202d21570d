"""The package as a new user installs it: what the wheel holds, and what it must never hide.

The CUDA sources live in the repository's top-level `kernels/` (the book shows them from there)
and ship inside the wheel as `nanoqwen/kernels/`. That folder is data, not a Python package:
transformers imports Hugging Face's own `kernels` package, and a top-level `kernels/__init__.py`
would shadow it whenever the repository root is on sys.path (`python -m pytest`, a notebook
started in the clone).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tomllib():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib


def test_kernels_folder_is_not_a_python_package():
    assert not (REPO / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py makes the CUDA folder a top-level package `kernels`, which hides "
        "Hugging Face's `kernels` that transformers imports"
    )


def test_transformers_imports_with_the_repository_first_on_sys_path():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    # With Hugging Face's `kernels` installed (transformers requires it) that package wins; without
    # it `import kernels` may find the CUDA folder as an empty namespace, which holds no code.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from transformers import Qwen2ForCausalLM\n"
        "try:\n"
        "    import kernels\n"
        "except ImportError:\n"
        "    kernels = None\n"
        "origin = getattr(kernels, '__file__', None) or ''\n"
        "assert not origin.startswith(sys.argv[1] + '/kernels'), f'kernels imported from the repository: {origin}'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_every_subpackage_is_packaged():
    config = _tomllib().loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "nanoqwen").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
    assert config["package-dir"]["nanoqwen.kernels"] == "kernels"


def test_wheel_ships_the_kernels_inside_the_package(tmp_path):
    pytest.importorskip("setuptools")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("nanoqwen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = {p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".cu", ".cuh", ".h")}
    shipped = {Path(n).name for n in names if n.startswith("nanoqwen/kernels/")}
    assert sources <= shipped, f"kernel sources missing from the wheel: {sorted(sources - shipped)}"
    assert not [n for n in names if n.startswith("kernels/")], "the wheel must not install a top-level `kernels`"
