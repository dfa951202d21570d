"""Build nano-coder's training corpus from the Python source already on this machine.

Why local files: the machine that trains nano-coder has no network, but it has a Python
installation full of real, well-written code (the standard library, plus torch, transformers,
scipy, ... in site-packages). That is plenty of Python for a 7M-parameter model.

Every choice here is deterministic, so two runs on the same machine see the same corpus:
files are enumerated in sorted order, sampled and split by hashes of their (root-relative)
paths, and deduplicated by content hash.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# Directory names we never descend into. site-packages/dist-packages are skipped while walking
# the standard library because some layouts (pyenv, /usr/lib/python3.x) nest them inside it;
# they are walked as a root of their own instead, so no file is counted under two roots.
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git"}


@dataclass
class Document:
    """One source file: `key` is "<root label>/<path relative to root>" (machine-independent)."""

    key: str
    text: str


@dataclass
class Corpus:
    train: list[Document]
    heldout: list[Document]
    stats: dict = field(default_factory=dict)


def default_roots() -> list[tuple[str, str]]:
    """(label, path) of the default roots: the stdlib and the running interpreter's site-packages."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", paths["stdlib"])]
    # purelib and platlib are usually the same directory; keep each distinct one once.
    seen = {os.path.realpath(paths["stdlib"])}
    for name in ("purelib", "platlib"):
        p = paths.get(name)
        if p and os.path.isdir(p) and os.path.realpath(p) not in seen:
            seen.add(os.path.realpath(p))
            roots.append(("site-packages" if name == "purelib" else "platlib", p))
    return roots


def stable_hash(s: str) -> int:
    """A hash that, unlike Python's hash(), is the same in every process and on every machine."""
    return int.from_bytes(hashlib.sha1(s.encode("utf-8")).digest()[:8], "little")


def is_heldout(key: str, percent: float) -> bool:
    # Split by path, not by position in the list: adding or removing other files does not
    # move a file between train and held-out.
    return (stable_hash("heldout:" + key) % 10_000) < percent * 100


def _list_files(roots: list[tuple[str, str]], max_file_bytes: int):
    """Sorted walk of every root; returns [(key, abs_path, size)] and a per-root count."""
    found, per_root = [], {}
    for label, root in roots:
        n = 0
        for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinks
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    size = os.stat(path).st_size
                except OSError:
                    continue
                # Tiny files are mostly empty __init__.py; huge ones are generated tables.
                if size == 0 or size > max_file_bytes:
                    continue
                found.append((label + "/" + os.path.relpath(path, root), path, size))
                n += 1
        per_root[label] = {"path": root, "candidate_files": n}
    return found, per_root


def _read_utf8(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def build_corpus(
    roots: list[tuple[str, str]],
    max_corpus_bytes: int,
    max_file_bytes: int = 200_000,
    heldout_percent: float = 1.0,
    log=print,
) -> Corpus:
    files, per_root = _list_files(roots, max_file_bytes)
    candidate_bytes = sum(s for _, _, s in files)
    # If there is more code than the cap, taking files in sorted order would keep whole
    # packages alphabetically (all of "a*" and none of "torch"). Visiting files in the order
    # of a hash of their key is a deterministic but package-blind sample instead.
    files.sort(key=lambda f: stable_hash("order:" + f[0]))

    docs, seen_hashes = [], set()
    total = n_bad_utf8 = n_dupes = 0
    # Reading is I/O bound (many small files, maybe a cold page cache), so threads help even
    # under the GIL. Files are read in blocks and consumed in the hash order above, so the
    # result does not depend on which thread finishes first.
    block = 512
    with ThreadPoolExecutor(max_workers=16) as pool:
        for start in range(0, len(files), block):
            if total >= max_corpus_bytes:
                break
            chunk = files[start : start + block]
            for (key, _, _), text in zip(chunk, pool.map(_read_utf8, [p for _, p, _ in chunk])):
                if total >= max_corpus_bytes:
                    break
                if text is None:
                    n_bad_utf8 += 1
                    continue
                if not text.strip():
                    continue
                digest = hashlib.sha1(text.encode("utf-8")).digest()
                if digest in seen_hashes:  # vendored copies, identical boilerplate files
                    n_dupes += 1
                    continue
                seen_hashes.add(digest)
                docs.append(Document(key, text))
                total += len(text.encode("utf-8"))

    # Present documents in sorted key order (stable and easy to inspect).
    docs.sort(key=lambda d: d.key)
    train = [d for d in docs if not is_heldout(d.key, heldout_percent)]
    heldout = [d for d in docs if is_heldout(d.key, heldout_percent)]
    for d in docs:
        per_root[d.key.split("/", 1)[0]].setdefault("used_files", 0)
        per_root[d.key.split("/", 1)[0]]["used_files"] += 1
    stats = {
        "roots": per_root,
        "candidate_files": len(files),
        "candidate_bytes": candidate_bytes,
        "skipped_not_utf8": n_bad_utf8,
        "skipped_duplicates": n_dupes,
        "max_corpus_bytes": max_corpus_bytes,
        "max_file_bytes": max_file_bytes,
        "heldout_percent": heldout_percent,
        "train_files": len(train),
        "train_bytes": sum(len(d.text.encode("utf-8")) for d in train),
        "heldout_files": len(heldout),
        "heldout_bytes": sum(len(d.text.encode("utf-8")) for d in heldout),
    }
    return Corpus(train, heldout, stats)


# ---------------------------------------------------------------------------------------------
# Fill-in-the-middle (FIM)
# ---------------------------------------------------------------------------------------------
# Qwen2.5-Coder is trained on "PSM" (prefix, suffix, middle) examples:
#     <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>
# so that at inference a prompt ending in <|fim_middle|> makes the model write the middle.
#
# nano-coder only trains on 512-token windows. If a whole 100 KB file were turned into one FIM
# example, the prefix and the <|fim_middle|> marker would sit thousands of tokens apart and a
# window would almost never contain the full pattern. So we cut each document into segments of
# at most `segment_chars` characters (at line boundaries) and turn each segment into a FIM
# example with probability `fim_rate`; the other segments stay plain, contiguous text.
# A segment of ~1500 characters is roughly 450 tokens, so most FIM examples fit in a window.


def _segments(text: str, segment_chars: int) -> list[str]:
    """Cut text into consecutive pieces of <= segment_chars, preferring line boundaries."""
    out, start, n = [], 0, len(text)
    while start < n:
        end = min(start + segment_chars, n)
        if end < n:
            nl = text.rfind("\n", start, end)
            if nl > start:  # cut after a newline when the piece contains one
                end = nl + 1
        out.append(text[start:end])
        start = end
    return out


def fim_plan(text: str, rng: random.Random, fim_rate: float, segment_chars: int) -> list:
    """Describe a training document as a list of parts, in order:

    - a str: plain text, to be tokenized as is;
    - a tuple (prefix, middle, suffix): one FIM example, to be emitted in PSM order and closed
      with <|endoftext|>.

    The caller appends the final <|endoftext|> that ends the document.
    """
    parts: list = []
    for seg in _segments(text, segment_chars):
        if rng.random() < fim_rate and len(seg) >= 2:
            # Two cut points, uniform over character positions (as in the FIM paper and in
            # Qwen2.5-Coder): the middle may be empty, a few characters or most of the segment.
            i, j = sorted((rng.randint(0, len(seg)), rng.randint(0, len(seg))))
            parts.append((seg[:i], seg[i:j], seg[j:]))
        elif parts and isinstance(parts[-1], str):
            parts[-1] += seg  # merge consecutive plain segments: they are one stretch of text
        else:
            parts.append(seg)
    return parts
