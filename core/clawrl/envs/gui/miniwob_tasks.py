"""The MiniWoB++ tasks gui-rl wires, and scripted solvers for some of them (the oracle).

Every MiniWoB task generates its instance from a seed (``Math.seedrandom``), so the split is **by
seed**: gui-rl's train rows use seeds below ``TEST_SEED_BASE`` and its test rows seeds from it up,
for the same tasks. A held-out instance is a new layout, new words and new targets of a task
family trained on; tasks whose every seed gives one and the same screen (``FIXED``) are train only,
since no seed of theirs could be held out.

A solver reads the first screen (its instruction and elements) and returns the actions of an agent
that knows how, in the computer-use format; MiniWoB's own reward function judges them.
"""
from __future__ import annotations

import importlib.util
import operator
import re
from pathlib import Path
from typing import Callable, Optional

from clawrl.envs.computer_use import Element

# The package's task pages, found without importing it (its __init__ registers Gymnasium envs).
_SPEC = importlib.util.find_spec("miniwob")
HTML_DIR = Path(_SPEC.origin).parent / "html" / "miniwob" if _SPEC else Path("/nonexistent/miniwob")
TEST_SEED_BASE = 100_000
# Single-page MiniWoB tasks whose state the accessibility tree shows (no canvas-only or drag tasks).
TASKS = (
    "click-test", "click-test-2", "click-button", "click-button-sequence", "click-link", "click-dialog",
    "click-dialog-2", "click-checkboxes", "click-checkboxes-soft", "click-option", "click-tab", "click-tab-2",
    "click-widget", "click-collapsible", "click-collapsible-2", "click-color", "click-menu", "click-scroll-list",
    "click-shape", "focus-text", "focus-text-2", "enter-text", "enter-text-2", "enter-text-dynamic",
    "enter-password", "enter-date", "login-user", "unicode-test", "grid-coordinate", "simple-arithmetic",
    "simple-algebra", "choose-list", "identify-shape", "navigate-tree", "read-table", "use-autocomplete",
    "search-engine", "email-inbox", "social-media", "find-word", "guess-number", "copy-paste",
)
# One screen whatever the seed: nothing to hold out.
FIXED = frozenset({"click-test", "focus-text"})

Action = dict
Solver = Callable[[str, list[Element]], Optional[list[Action]]]


def task_url(name: str) -> str:
    return (HTML_DIR / f"{name}.html").as_uri()


def _quoted(utterance: str) -> list[str]:
    return re.findall(r'"([^"]*)"', utterance)


def _named(screen: list[Element], role: str, name: str) -> Optional[Element]:
    return next((e for e in screen if e.role == role and e.name == name), None)


def _click(e: Optional[Element]) -> Action:
    if e is None:
        raise LookupError("target not on the screen")
    return {"action": "click", "element": e.id}


def _of_role(screen: list[Element], role: str) -> list[Element]:
    return [e for e in screen if e.role == role]


def _box_beside(screen: list[Element], label: str, role: str) -> Element:
    """The checkbox or radio button on the same row as the text ``label``."""
    text = next(e for e in screen if e.role == "text" and e.name == label)
    row = (text.box[1] + text.box[3]) / 2
    return min(_of_role(screen, role), key=lambda e: abs((e.box[1] + e.box[3]) / 2 - row) + abs(e.box[2] - text.box[0]))


def _type_into(box: Element, text: str) -> list[Action]:
    return [_click(box), {"action": "type", "text": text}]


def _submit(screen: list[Element], name: str = "Submit") -> Action:
    return _click(next(e for e in screen if e.role == "button" and e.name.lower() == name.lower()))


def _button_named(u: str, s: list[Element]) -> list[Action]:
    return [_click(_named(s, "button", _quoted(u)[0]))]


def _focus_nth(u: str, s: list[Element]) -> list[Action]:
    n = int(re.search(r"(\d+)(st|nd|rd|th)", u).group(1))
    return [_click(_of_role(s, "textbox")[n - 1])]


def _select(role: str) -> Solver:
    def solve(u: str, s: list[Element]) -> list[Action]:
        wanted = re.match(r"Select (.*) and click Submit\.", u).group(1)
        labels = [] if wanted == "nothing" else [w.strip() for w in re.split(r",\s*", wanted) if w.strip()]
        return [_click(_box_beside(s, w, role)) for w in labels] + [_submit(s)]
    return solve


def _arithmetic(u: str, s: list[Element]) -> list[Action]:
    problem = next(e.name for e in s if e.role == "text" and e.name.endswith("="))
    a, op, b = re.match(r"\s*(-?\d+)\s*([-+x*])\s*(-?\d+)", problem).groups()
    ops = {"+": operator.add, "-": operator.sub, "x": operator.mul, "*": operator.mul}
    return _type_into(_of_role(s, "textbox")[0], str(ops[op](int(a), int(b)))) + [_submit(s)]


SOLVERS: dict[str, Solver] = {
    "click-test": lambda u, s: [_click(_named(s, "button", "Click Me!"))],
    "click-test-2": lambda u, s: [_click(_named(s, "button", re.search(r"button (\w+)", u).group(1)))],
    "click-button": _button_named,
    "unicode-test": _button_named,
    "click-dialog-2": lambda u, s: [_click(_named(s, "button", "" if _quoted(u)[0] == "x" else _quoted(u)[0]))],
    "click-button-sequence": lambda u, s: [_click(_named(s, "button", "ONE")), _click(_named(s, "button", "TWO"))],
    "click-link": lambda u, s: [_click(_named(s, "link", _quoted(u)[0]))],
    "click-dialog": lambda u, s: [_click(next(e for e in s if e.role == "button" and e.name == ""))],
    "click-tab": lambda u, s: [_click(_named(s, "link", "Tab #" + re.search(r"#(\d+)", u).group(1)))],
    "click-checkboxes": _select("checkbox"),
    "click-option": _select("radio"),
    "focus-text": lambda u, s: [_click(_of_role(s, "textbox")[0])],
    "focus-text-2": _focus_nth,
    "enter-text": lambda u, s: _type_into(_of_role(s, "textbox")[0], _quoted(u)[0]) + [_submit(s)],
    "enter-text-2": lambda u, s: _type_into(_of_role(s, "textbox")[0], _quoted(u)[0].upper() if "upper case" in u
                                            else _quoted(u)[0].lower()) + [_submit(s)],
    "enter-password": lambda u, s: [a for box in _of_role(s, "textbox")[:2] for a in _type_into(box, _quoted(u)[0])]
    + [_submit(s)],
    "login-user": lambda u, s: _type_into(_of_role(s, "textbox")[0], _quoted(u)[0])
    + _type_into(_of_role(s, "textbox")[1], _quoted(u)[1]) + [_submit(s, "Login")],
    "grid-coordinate": lambda u, s: [_click(next(e for e in s if e.name == re.search(r"(\(.*\))", u).group(1)))],
    "simple-arithmetic": _arithmetic,
}


def solve(name: str, utterance: str, screen: list[Element]) -> Optional[list[Action]]:
    """The solver's actions for this first screen (then ``done``), or None when ``name`` has no
    solver or this screen is one it cannot read."""
    solver = SOLVERS.get(name)
    if solver is None:
        return None
    try:
        return solver(utterance, screen)
    except (LookupError, AttributeError, StopIteration, ValueError):
        return None


__all__ = ["FIXED", "HTML_DIR", "SOLVERS", "TASKS", "TEST_SEED_BASE", "solve", "task_url"]
