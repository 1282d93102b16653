"""JSON from outside the server, held to what the code after it can handle.

Valid JSON allows two things that break the code downstream, so they are refused where JSON
enters (request bodies, tool-call ``arguments``, tool calls the model writes):

- **deep nesting.** Python's JSON decoder and encoder, the chat template and the store each
  recurse once per level, so ``[[[[...`` a few thousand levels deep raises ``RecursionError``
  (at a depth that depends on how deep the caller's stack already is). ``MAX_DEPTH`` is far above
  any real request (OpenClaw's tool schemas nest under 10 levels) and far below the recursion
  limit, so nothing after the check can hit it.
- **huge integers.** Python refuses to convert an integer of more than 4300 digits with a plain
  ``ValueError`` from inside the decoder; ``MAX_INT_DIGITS`` refuses it first, by name.
- **lone UTF-16 surrogates.** ``"\\ud800"`` is valid JSON but not unicode text: the tokenizer
  cannot encode it and it cannot be stored as UTF-8. It is refused, as OpenAI refuses invalid
  unicode, rather than replaced: a stored turn holds exactly what the client sent, as valid UTF-8.

``NaN`` and ``Infinity``, which Python's decoder accepts but JSON does not have, are refused too.

A surrogate *pair* (``"\\ud83d\\ude00"``) is one character once decoded, so any surrogate left in
a decoded string is a lone one.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 100
MAX_INT_DIGITS = 1000  # 2**1000 has 302 digits; Python's own limit is 4300
_SURROGATE = re.compile("[\ud800-\udfff]")


class UnsafeJson(ValueError):
    """Valid JSON that the server refuses; ``path`` names where (``messages[0].content``), ``code``
    says why (``json_too_deep`` | ``invalid_unicode`` | ``number_too_long`` | ``invalid_json``)."""

    def __init__(self, message: str, path: str, code: str):
        super().__init__(message)
        self.path, self.code = path, code


def loads(text: str | bytes, path: str = "") -> Any:
    """``json.loads`` that raises ``UnsafeJson`` for what ``check`` refuses.

    Malformed JSON still raises ``json.JSONDecodeError`` (or ``UnicodeDecodeError``), as before.
    """
    try:
        value = json.loads(text, parse_int=lambda digits: _integer(digits, path),
                           parse_constant=lambda name: _not_json(name, path))
    except RecursionError:  # the decoder recursed once per level of the input: it is too deep
        raise UnsafeJson(f"{_name(path)} nests deeper than {MAX_DEPTH} levels", path, "json_too_deep") from None
    check(value, path)
    return value


def check(value: Any, path: str = "") -> None:
    """Raise ``UnsafeJson`` naming a place that nests deeper than ``MAX_DEPTH`` or holds a lone
    surrogate (in a string or a key).

    Iterative, so that checking depth cannot itself run out of stack. It runs on every request,
    so it visits containers only (strings are searched where they sit, keys in one search per
    object) and builds a node's path only when it reports it.
    """
    search = _SURROGATE.search
    if type(value) is str and search(value):
        raise _surrogate(path, None)
    stack: list[tuple[Any, int, tuple | None]] = []  # (container, depth, (key, parent trail))
    if type(value) in (dict, list):
        stack.append((value, 0, None))
    while stack:
        v, depth, trail = stack.pop()
        if depth >= MAX_DEPTH:
            where = _path(path, trail)
            raise UnsafeJson(f"{_name(where)} nests deeper than {MAX_DEPTH} levels", where, "json_too_deep")
        if type(v) is dict:
            if search("".join(v)):
                where = _path(path, trail)
                raise UnsafeJson(f"a key of {_name(where)} holds a lone UTF-16 surrogate, which is not "
                                 "valid unicode text", where, "invalid_unicode")
            items = v.items()
        else:
            items = enumerate(v)
        nested = []
        for k, item in items:
            kind = type(item)
            if kind is str:
                if search(item):
                    raise _surrogate(path, (k, trail))
            elif kind is dict or kind is list:
                nested.append((item, depth + 1, (k, trail)))
        stack.extend(reversed(nested))  # the first container is checked first


def _surrogate(root: str, trail: tuple | None) -> UnsafeJson:
    where = _path(root, trail)
    return UnsafeJson(f"{_name(where)} holds a lone UTF-16 surrogate, which is not valid unicode text; "
                      "send UTF-8 text (a surrogate pair is fine)", where, "invalid_unicode")


def _integer(digits: str, path: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise UnsafeJson(f"{_name(path)} holds an integer of more than {MAX_INT_DIGITS} digits", path,
                         "number_too_long")
    return int(digits)


def _not_json(name: str, path: str):
    raise UnsafeJson(f"{_name(path)} holds {name}, which is not a JSON value", path, "invalid_json")


def _path(root: str, trail: tuple | None) -> str:
    keys = []
    while trail is not None:
        key, trail = trail
        keys.append(key)
    out = root
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def _name(path: str) -> str:
    return f"'{path}'" if path else "the JSON body"
