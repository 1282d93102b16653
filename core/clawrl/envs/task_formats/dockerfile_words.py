"""Dockerfile words: how ENV, ARG, WORKDIR, COPY and FROM split their arguments and expand
variables (RUN lines are left to the shell).

Quotes group and are removed, a backslash escapes the next character, and ``$VAR``, ``${VAR}``,
``${VAR:-word}`` and ``${VAR:+word}`` expand from the ARG and ENV values in scope (not inside
single quotes). Other substitutions refuse the task, naming the line.
"""
from __future__ import annotations

import re
from typing import Mapping

from clawrl.envs.task_formats.spec import TaskRefused


def env_pairs(text: str, scope: Mapping[str, str], at: str) -> dict[str, str]:
    """The NAME=value pairs of an ENV line (``ENV A=1 B="two words"``), or its old one-pair form
    (``ENV NAME the rest of the line``); ``at`` names the line in refusals."""
    first = text.split(None, 1)[0] if text.strip() else ""
    if not first:
        raise TaskRefused(f"{at}: ENV needs a name and a value")
    if "=" not in first:  # the old form: ENV NAME the rest of the line
        name, _, rest = text.partition(" ")
        return {name: " ".join(split_words(rest.strip(), scope, at))}
    pairs = {}  # as in Docker, the pairs of one ENV line expand against what was set before it
    for word in split_words(text, scope, at):
        name, eq, value = word.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
            raise TaskRefused(f"{at}: expected NAME=value, not {word!r}")
        pairs[name] = value
    return pairs


def split_words(text: str, scope: Mapping[str, str], at: str) -> list[str]:
    """Split ``text`` into words as Docker does for ENV, ARG, WORKDIR, COPY and FROM: quotes group
    and are removed, backslash escapes, and $VAR / ${VAR} / ${VAR:-word} / ${VAR:+word} expand
    (not inside single quotes)."""
    words: list[str] = []
    cur: list[str] = []
    in_word = False
    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        if quote == "'":
            if c == "'":
                quote = ""
            else:
                cur.append(c)
            i += 1
        elif c == "\\" and i + 1 < len(text):
            cur.append(text[i + 1])
            in_word = True
            i += 2
        elif c == "$":
            value, i = _expand(text, i, scope, at)
            cur.append(value)
            in_word = True
        elif quote == '"':
            if c == '"':
                quote = ""
            else:
                cur.append(c)
            i += 1
        elif c in "'\"":
            quote = c
            in_word = True
            i += 1
        elif c.isspace():
            if in_word:
                words.append("".join(cur))
                cur, in_word = [], False
            i += 1
        else:
            cur.append(c)
            in_word = True
            i += 1
    if quote:
        raise TaskRefused(f"{at}: unclosed {quote} quote")
    if in_word:
        words.append("".join(cur))
    return words


def _expand(text: str, i: int, scope: Mapping[str, str], at: str) -> tuple[str, int]:
    """The value of the variable reference starting at text[i] == "$", and the index after it."""
    if text.startswith("${", i):
        end = text.find("}", i)
        if end < 0:
            raise TaskRefused(f"{at}: unclosed ${{")
        body = text[i + 2:end]
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])(.*))?", body, re.DOTALL)
        if m is None:
            raise TaskRefused(f"{at}: ${{{body}}} is a substitution this host does not interpret")
        name, op, word = m.group(1), m.group(2), m.group(3) or ""
        value = scope.get(name, "")
        if op == ":-":
            value = value or word
        elif op == ":+":
            value = word if value else ""
        return value, end + 1
    m = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").match(text, i + 1)
    if m is None:
        return "$", i + 1
    return scope.get(m.group(0), ""), m.end()
