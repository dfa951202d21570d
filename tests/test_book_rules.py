"""The book's house rules, checked on the sources (and on the built HTML when there is one).

* a chapter is a sitting's read: at most 25 KB of source;
* a chapter ends with `## What we learned` (at most five bullets) and then `## Exercises`;
* the product speaks of itself: no words of how the project was made (numbered work sessions and
  calls, experiment branches, issue numbers) in the tracked files of chapters/, book/,
  kernels/, nanoqwen/, tools/, results/, README.md and ARCHITECTURE.md;
* a record the product or its tests cite by file name under results/ exists: results/ holds what the book,
  README and ARCHITECTURE cite, and a record that goes takes its citations with it;
* a listing a page includes from the code (`literalinclude`) names a file that exists and markers
  (`start-at`, `start-after`, `end-before`, `end-at`) that file holds, so that a renamed line
  fails here, in seconds, instead of in the book's build;
* rendered output is part of the page: no warning, traceback or local path in the output of a
  code cell of `_build/html/chapters/*.html` (skipped when the book has not been built).

Fast and CPU-only: it reads files, it runs nothing. To check a single-page build as well:

    python tests/test_book_rules.py _build/_page/chapters-01_format/html
"""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "chapters").glob("*.md"))
BUILT_CHAPTERS = REPO / "_build" / "html" / "chapters"

MAX_CHAPTER_BYTES = 25_000
MAX_LEARNED_BULLETS = 5

PRODUCT_PATHS = ("chapters", "book", "kernels", "nanoqwen", "tools", "results", "README.md", "ARCHITECTURE.md")
IGNORED_PARTS = {".git", "_build"}
# Assembled from parts, so that this file does not itself hold the words it forbids.
HISTORY = re.compile("|".join([
    r"\bsessions? ?[0-9]+", r"\bcall [0-9]+\b", r"lab[- ]session", "lab" + " branch", r"\bissue ?#?[0-9]+",
    "this" + r" tree\b",
]), re.IGNORECASE)
ALLOWED = re.compile(r"start_new_session")  # subprocess.Popen's argument, not a work session
CITED_RECORD = re.compile(r"\bresults/[\w.-]+?\.(?:md|json|txt)\b")
BAD_OUTPUT = re.compile(r"Warning|Traceback|/work/|/tmp/|/home/")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


# --------------------------------------------------------------------------- helpers


def prose_lines(text: str) -> list[str]:
    """The lines of a MyST page outside fenced blocks (code cells, directives, examples)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not line.strip()[len(match.group(1)):].strip():
            fence = None
        elif fence is None:
            lines.append(line)
    return lines


def product_files() -> list[Path]:
    """Tracked files under PRODUCT_PATHS (git ls-files), or every file there outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *PRODUCT_PATHS], cwd=REPO, capture_output=True,
                                check=True, timeout=60).stdout.decode().split("\0")
        files = [REPO / name for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        files = [p for top in PRODUCT_PATHS for p in ((REPO / top).rglob("*") if (REPO / top).is_dir() else [REPO / top])]
    return sorted(p for p in files if p.is_file() and not IGNORED_PARTS & set(p.relative_to(REPO).parts))


def text_of(path: Path) -> str | None:
    """The file as UTF-8 text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def history_words(text: str) -> list[tuple[int, str]]:
    """(line number, matched words) for every mention of how the project was made."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in HISTORY.finditer(ALLOWED.sub("", line)):
            found.append((number, match.group(0)))
    return found


class _CellOutputs(HTMLParser):
    """Collects the text of each `cell_output` block of a MyST-NB page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.outputs: list[str] = []
        self._depth = 0  # nesting of <div>s inside the current cell_output, 0 outside
        self._hidden = 0  # inside <style> or <script>

    def handle_starttag(self, tag, attrs):
        if tag in ("style", "script"):  # a displayed Code object brings its CSS along: not output text
            self._hidden += 1
        if tag != "div":
            return
        if self._depth:
            self._depth += 1
        elif "cell_output" in (dict(attrs).get("class") or "").split():
            self._depth = 1
            self.outputs.append("")

    def handle_endtag(self, tag):
        if tag in ("style", "script") and self._hidden:
            self._hidden -= 1
        if tag == "div" and self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._depth and not self._hidden:
            self.outputs[-1] += data


def bad_outputs(html_file: Path) -> list[str]:
    """'<page>: output <n>: <excerpt>' for each cell output with a warning, traceback, local path or history."""
    parser = _CellOutputs()
    parser.feed(html_file.read_text(encoding="utf-8", errors="replace"))
    problems = []
    for n, output in enumerate(parser.outputs):
        for pattern in (BAD_OUTPUT, HISTORY):
            for match in pattern.finditer(output):
                start = max(0, match.start() - 60)
                excerpt = " ".join(output[start : match.end() + 60].split())
                problems.append(f"{html_file.name}: output {n}: {match.group(0)!r} in ...{excerpt}...")
    return problems


# --------------------------------------------------------------------------- chapters


def test_there_are_chapters():
    assert CHAPTERS, "no chapters/*.md found"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_is_a_sittings_read(chapter):
    size = chapter.stat().st_size
    assert size <= MAX_CHAPTER_BYTES, f"{chapter.name} is {size:,} bytes; a chapter is at most {MAX_CHAPTER_BYTES:,}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_ends_with_what_we_learned_and_exercises(chapter):
    lines = prose_lines(chapter.read_text(encoding="utf-8"))
    headings = [line.rstrip() for line in lines if line.startswith("## ")]
    missing = [h for h in ("## What we learned", "## Exercises") if h not in headings]
    assert not missing, f"{chapter.name} lacks {missing} (headings found: {headings})"
    learned, exercises = headings.index("## What we learned"), headings.index("## Exercises")
    assert learned < exercises, f"{chapter.name}: '## What we learned' must come before '## Exercises'"
    assert headings.count("## What we learned") == headings.count("## Exercises") == 1, chapter.name

    start = lines.index(next(line for line in lines if line.rstrip() == "## What we learned"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    bullets = [line for line in lines[start + 1 : end] if re.match(r"^[-*+] ", line)]
    assert 1 <= len(bullets) <= MAX_LEARNED_BULLETS, (
        f"{chapter.name}: '## What we learned' has {len(bullets)} bullets; it has 1 to {MAX_LEARNED_BULLETS}")


# --------------------------------------------------------------------------- the product


def test_the_product_speaks_of_itself():
    offenders = []
    for path in product_files():
        text = text_of(path)
        if text is None:
            continue
        for number, words in history_words(text):
            offenders.append(f"{path.relative_to(REPO)}:{number}: {words!r}")
    assert not offenders, (f"{len(offenders)} mentions of how the project was made (history lives in git):\n"
                           + "\n".join(offenders))


def test_every_cited_record_exists():
    tests = sorted((REPO / "tests").glob("*.py"))
    missing = []
    for path in [*product_files(), *tests]:
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            missing += [f"{path.relative_to(REPO)}:{number}: {name}" for name in CITED_RECORD.findall(line)
                        if not (REPO / name).is_file()]
    assert not missing, "citations of records that results/ does not hold:\n" + "\n".join(missing)


def test_rendered_output_is_clean():
    if not BUILT_CHAPTERS.parent.exists():
        pytest.skip("_build/html does not exist: build the book first (jupyter-book build . -W --keep-going)")
    pages = sorted(BUILT_CHAPTERS.glob("*.html"))
    assert pages, f"{BUILT_CHAPTERS.relative_to(REPO)} holds no chapter pages"
    problems = [problem for page in pages for problem in bad_outputs(page)]
    assert not problems, "cell outputs that do not belong on a page:\n" + "\n".join(problems)


LITERALINCLUDE = re.compile(r"^```\{literalinclude\} (\S+)\n((?::[\w-]+:.*\n)*)", re.MULTILINE)
INCLUDE_MARKER = re.compile(r"^:(start-at|start-after|end-before|end-at): (.*)$", re.MULTILINE)


def include_problems(page: Path) -> list[str]:
    """The literalincludes of `page` whose file is missing or does not hold one of their markers."""
    problems = []
    for include in LITERALINCLUDE.finditer(page.read_text(encoding="utf-8")):
        source = page.parent / include.group(1)
        if not source.is_file():
            problems.append(f"{page.name}: {include.group(1)} does not exist")
            continue
        code = source.read_text(encoding="utf-8")
        for option, marker in INCLUDE_MARKER.findall(include.group(2)):
            marker = marker.strip()
            if len(marker) > 1 and marker[0] == marker[-1] and marker[0] in "\"'":
                marker = marker[1:-1]  # MyST reads a quoted value without its quotes
            if marker not in code:
                problems.append(f"{page.name}: {option} {marker!r} is not in {include.group(1)}")
    return problems


def test_every_included_listing_is_found():
    pages = [*CHAPTERS, *sorted((REPO / "book").glob("*.md"))]
    problems = [problem for page in pages for problem in include_problems(page)]
    assert not problems, "listings the book's build would not find:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- the rules' own checks


def test_the_rules_catch_what_they_should():
    # the examples are assembled, so this file does not hold the words it forbids
    words = ["sess" + "ion 12", "iss" + "ue #7", "lab" + " branch", "this" + " tree"]
    text = f"as measured in {words[0]}\nsee {words[1]}\nthe {words[2]}\nin {words[3]}"
    assert [w for _, w in history_words(text)] == words
    assert history_words("subprocess.Popen(cmd, start_new_session=True)\nthe sessions of a server") == []
    assert prose_lines("a\n```python\n## What we learned\n```\nb") == ["a", "b"]
    assert CITED_RECORD.findall("see results/bench-7b-h100.md, results/x-h200.{md,json} or results/") == [
        "results/bench-7b-h100.md"]

    page = ('<div class="cell docutils container"><div class="cell_input"><pre>import warnings</pre></div>'
            '<div class="cell_output docutils container"><div class="output stderr"><pre>'
            "/tmp/venv/lib/tqdm/auto.py:21: TqdmWarning: IProgress not found</pre></div>"
            '<div class="output text_html"><style>.gt { color: #04D } /* Generic.Traceback */</style>'
            "<pre>def f(): pass</pre></div></div></div>"
            '<p>Prose may say Warning.</p>')
    parser = _CellOutputs()
    parser.feed(page)
    assert len(parser.outputs) == 1 and "TqdmWarning" in parser.outputs[0] and "def f()" in parser.outputs[0]
    assert "Prose" not in parser.outputs[0] and "Generic.Traceback" not in parser.outputs[0]
    assert not BAD_OUTPUT.search("import warnings")  # cell input is not output


def test_the_include_rule_catches_a_missing_marker(tmp_path):
    (tmp_path / "k.cu").write_text("// # the header\nint a;\nint b;\n")
    page = tmp_path / "p.md"
    page.write_text("```{literalinclude} k.cu\n:start-at: \"// # the header\"\n:end-before: int c;\n```\n"
                    "```{literalinclude} gone.cu\n```\n")
    assert include_problems(page) == ["p.md: end-before 'int c;' is not in k.cu", "p.md: gone.cu does not exist"]


if __name__ == "__main__":  # check the pages of a single-page or full build: python tests/test_book_rules.py DIR...
    found = [problem for folder in sys.argv[1:] for page in sorted(Path(folder).glob("*.html"))
             for problem in bad_outputs(page)]
    print("\n".join(found) or "no warnings, tracebacks, local paths or history in the cell outputs")
    sys.exit(1 if found else 0)
