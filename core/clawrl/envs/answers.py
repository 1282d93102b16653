"""Is a final answer right? Math answers compared in canonical form, numbers with a tolerance.

Datasets spell answers many ways (GSM8K's ``...#### 72``, ``1,234``, ``\\frac{3}{4}``, ``$12.50``,
``12.5%``) and models add units and LaTeX around them, so both sides are reduced to a canonical
form before comparing:

- numbers compare as exact fractions: ``1234``, ``1,234``, ``1234.0`` and ``\\text{1234 km}`` are
  one answer. An integer expected answer must be met exactly (up to float noise, 1e-9 relative).
  An expected answer with d decimal places (the question asked to round) also accepts any answer
  that rounds to it, i.e. within half a unit of its last place (so the unrounded 12.3456 earns
  12.35, and neither rounding rule for ties is penalised);
- dates and clock times compare as their numbers (``2031-7-4`` is ``2031-07-04``, ``9:05`` is
  ``09:05``);
- anything else compares as text, case-folded, whitespace collapsed, a trailing period dropped.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUMBER_WITH_UNIT = re.compile(r"^([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*[A-Za-z°][A-Za-z°/ .²³]*$")
_SEPARATED = re.compile(r"^\d+(?:[-:/]\d+)+$")
_NOISE = 1e-9


def expected_answer(raw) -> str:
    """A dataset's answer field as the canonical string: GSM8K's worked answer ends in ``#### N``."""
    text = str(raw)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip()


def answers_match(given: str, expected: str) -> bool:
    """Whether ``given`` (a model's boxed answer) is ``expected`` (see the module docstring)."""
    g, e = _clean(given), _clean(expected)
    e_num = _number(e)
    if e_num is not None:
        g_num = _number(g)
        if g_num is None:
            return False
        if abs(g_num - e_num) <= Fraction(_NOISE) * max(1, abs(e_num)):
            return True
        places = _decimals(e)
        return places > 0 and abs(g_num - e_num) <= Fraction(1, 2 * 10 ** places)
    if _SEPARATED.match(e) and _SEPARATED.match(g):
        return _separated(g) == _separated(e)
    return _text(g) == _text(e)


def _clean(text: str) -> str:
    s = text.strip()
    for _ in range(3):  # \text{\textbf{12}}
        s = _TEXT.sub(r"\1", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\,", "").replace("\\!", "").replace("{,}", ",").replace("\\ ", " ").replace("\u2009", "")
    s = s.replace("\u2212", "-").strip().rstrip(".").strip()  # a typeset minus sign
    return s


def _number(s: str) -> Optional[Fraction]:
    s = s.replace(" ", "") if re.fullmatch(r"[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?", s) else s
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    m = _FRAC.match(s)
    if m:
        if int(m.group(3)) == 0:
            return None
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) else value
    m = _NUMBER_WITH_UNIT.match(s)
    if m:
        s = m.group(1)
    if not re.fullmatch(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?\d+/\d+", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _decimals(s: str) -> int:
    m = re.fullmatch(r"[-+]?[\d,]*\.(\d+)", s)
    return len(m.group(1)) if m else 0


def _separated(s: str) -> tuple:
    return tuple(re.findall(r"[-:/]", s)), tuple(int(x) for x in re.findall(r"\d+", s))


def _text(s: str) -> str:
    return " ".join(s.strip("\"'` ").split()).casefold()
