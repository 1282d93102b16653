"""``.dockerignore``: which files of a build context COPY and ADD leave out.

Rules are read in order, one pattern a line (``#`` comments, blank lines skipped); ``!`` negates.
A pattern is matched against the context-relative path and each of its parent directories, so a
pattern naming a directory leaves out everything inside; ``*`` and ``?`` stay within a path
component and ``**`` spans any number of them. The last rule that matches decides, as in Docker.
"""
from __future__ import annotations

import re
from pathlib import Path, PurePosixPath


def is_ignored(rel: str, rules: list[tuple[bool, str]]) -> bool:
    """Whether ``.dockerignore`` rules (negated, pattern) exclude the context-relative path ``rel``:
    the last matching rule wins; a pattern that matches a directory excludes what is inside."""
    out = False
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for negated, pattern in rules:
        if any(_matches(p, pattern) for p in prefixes):
            out = not negated
    return out


def _matches(path: str, pattern: str) -> bool:
    """Docker's .dockerignore globs: ``*`` and ``?`` stay within a path component, ``**`` spans any."""
    regex = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex, i = regex + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            regex, i = regex + ".*", i + 2
        else:
            c = pattern[i]
            regex += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
            i += 1
    return re.fullmatch(regex, path) is not None


def read_dockerignore(context: Path) -> list[tuple[bool, str]]:
    file = context / ".dockerignore"
    if not file.is_file():
        return []
    rules = []
    for line in file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = str(PurePosixPath(line.lstrip("!").strip().lstrip("/")))
        rules.append((negated, pattern))
    return rules
