"""General English text found offline: the Python standard library's docstrings, comments and
language reference (``pydoc_data.topics``).

The tokenizer needs ordinary English (and some code) beside the synthetic chats, or real agent
prompts split into many short tokens; the long-prompt examples of the corpus need varied English
to put in front of a question. Nothing can be downloaded, so we read the stdlib that ships with
the interpreter. Only the stdlib (not site-packages, which differ between machines) and a sorted
file list, so the text, and with it the tokenizer and the model, are the same on every machine
with the same Python.
"""
from __future__ import annotations

import functools
import re
import sysconfig
from pathlib import Path

from pydoc_data.topics import topics

_DOCSTRING = re.compile(r'"""(.*?)"""', re.S)
_COMMENT_BLOCK = re.compile(r"(?:^[ \t]*# [^\n]*\n)+", re.M)
# Test suites and the IDE are mostly code and odd strings, not prose.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _clean(doc: str) -> str:
    lines = [ln.strip() for ln in doc.strip().splitlines()]
    return "\n".join(lines).strip()


def _source_paragraphs(src: str):
    for doc in _DOCSTRING.findall(src):
        yield from re.split(r"\n\s*\n", _clean(doc))
    for block in _COMMENT_BLOCK.findall(src):
        yield " ".join(ln.strip()[2:] for ln in block.splitlines())


def _all_paragraphs():
    for key in sorted(topics):
        yield from re.split(r"\n\s*\n", topics[key])
    for path in _stdlib_files():
        yield from _source_paragraphs(path.read_text(encoding="utf-8", errors="replace"))


def _is_prose(para: str) -> bool:
    letters = sum(c.isalpha() or c == " " for c in para)
    return len(para) >= 80 and letters >= 0.75 * len(para)


@functools.lru_cache(maxsize=4)
def english_paragraphs(max_chars: int = 3_000_000) -> tuple[str, ...]:
    """English paragraphs (at least 80 characters, mostly letters) in a fixed order, up to
    ``max_chars`` in total: the language reference first, then stdlib docstrings and comments."""
    out: list[str] = []
    total = 0
    for para in filter(_is_prose, _all_paragraphs()):
        out.append(para)
        total += len(para) + 2
        if total >= max_chars:
            break
    if not out:
        raise RuntimeError(f"no English text found under {sysconfig.get_paths()['stdlib']}")
    return tuple(out)
