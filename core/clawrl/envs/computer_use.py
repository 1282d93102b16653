"""The computer-use action format: how a GUI agent sees a screen and says what to do on it.

gui-rl (OpenClaw-RL's GUI track; issue 19) is not built yet, but the embedded model learns this
format now, with every other agentic format in one corpus change, so that the environment only has
to follow it (``docs/action_formats.md``). A turn shows the instruction and the screen as an
accessibility tree, one element a line::

    [72] button "Save" (120, 80, 200, 104)

(the element's id, its role, its name, and its bounding box as left, top, right, bottom in
pixels). The
agent replies with exactly one JSON object, one of ``ACTIONS``::

    {"action": "click", "element": 72}      {"action": "click", "x": 140, "y": 90}
    {"action": "type", "text": "hello"}     {"action": "key", "key": "Enter"}
    {"action": "scroll", "dy": 200}         {"action": "done"}

``parse_action`` reads a reply into that dict, or says in one line what is wrong with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

SYSTEM_PROMPT = (
    "You operate a computer through its screen. Each turn shows the instruction and the screen as an "
    "accessibility tree, one element per line: [id] role \"name\" (left, top, right, bottom). Reply with exactly "
    "one JSON action: {\"action\": \"click\", \"element\": ID}, {\"action\": \"click\", \"x\": X, \"y\": Y}, "
    "{\"action\": \"type\", \"text\": \"...\"}, {\"action\": \"key\", \"key\": \"Enter\"}, "
    "{\"action\": \"scroll\", \"dy\": PIXELS}, or {\"action\": \"done\"} when the instruction is complete.")
# Each action and the fields it requires, with their types (extra fields are an error: a typo such
# as "elemnt" must not silently click nowhere).
ACTIONS: dict[str, dict[str, type]] = {
    "click": {},  # either "element", or "x" and "y"
    "type": {"text": str},
    "key": {"key": str},
    "scroll": {"dy": int},
    "done": {},
}


@dataclass(frozen=True)
class Element:
    """One accessibility-tree node: id, role, name and bounding box (left, top, right, bottom)."""

    id: int
    role: str
    name: str
    box: tuple[int, int, int, int]

    def line(self) -> str:
        return f"[{self.id}] {self.role} {json.dumps(self.name, ensure_ascii=False)} ({', '.join(map(str, self.box))})"


def render_screen(elements: list[Element], instruction: Optional[str] = None) -> str:
    """The user message of a turn: the instruction (first turn only) and the tree."""
    tree = "Screen (accessibility tree):\n" + "\n".join(e.line() for e in elements)
    return f"Instruction: {instruction}\n\n{tree}" if instruction is not None else tree


def parse_action(reply: str) -> tuple[Optional[dict], Optional[str]]:
    """(action, None) for a reply that is one valid JSON action (surrounding whitespace allowed),
    else (None, what is wrong)."""
    try:
        action = json.loads(reply.strip())
    except ValueError as e:
        return None, f"the reply is not one JSON object ({e})"
    if not isinstance(action, dict) or not isinstance(action.get("action"), str):
        return None, 'an action is a JSON object with an "action" field'
    kind = action["action"]
    if kind not in ACTIONS:
        return None, f"unknown action {kind!r}; one of {', '.join(ACTIONS)}"
    fields = dict(ACTIONS[kind])
    if kind == "click":
        fields = {"element": int} if "element" in action else {"x": int, "y": int}
    extra = set(action) - set(fields) - {"action"}
    if extra:
        return None, f"{kind} takes {', '.join(fields) or 'no fields'}, not {', '.join(sorted(extra))}"
    for name, typ in fields.items():
        value = action.get(name)
        if not isinstance(value, typ) or isinstance(value, bool):
            return None, f"{kind} needs {name!r} as {'an integer' if typ is int else 'a string'}"
    return action, None
