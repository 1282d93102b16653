"""OSWorld-style task files for pages on this machine.

An OSWorld task is JSON: an ``instruction``, ``config`` steps that set the machine up, and an
``evaluator`` (``func`` with its ``result`` getter, ``expected`` value and ``options``) that judges the
final state. OSWorld runs them in a VM; gui-rl takes the ones whose whole world is one local web
page, in the same headless browser as MiniWoB::

    {"id": "form-name", "instruction": "Type Ada into the Name field and press Save.",
     "config": [{"type": "open_page", "parameters": {"path": "pages/form.html"}}],
     "evaluator": {"func": "exact_match", "result": {"type": "element_value", "selector": "#saved"},
                   "expected": {"type": "rule", "rules": {"expected": "Ada"}},
                   "options": {"case_sensitive": false}},
     "solution": [{"action": "click", "role": "textbox", "index": 0}, ...]}

- config steps: ``open_page`` (``path``, relative to the JSON file) and OSWorld's own
  ``chrome_open_tabs`` (``urls_to_open``: one local path); anything else (``launch``, ``download``,
  remote URLs) is refused, since it needs a VM or the network;
- evaluator funcs: ``exact_match`` (the result equals the expected value), ``includes`` (the expected
  value is in the result), ``is_true`` (the result is true: a checkbox); result getters
  ``element_value``, ``element_text``, ``element_checked`` (a CSS ``selector``) and ``page_title``;
  options ``case_sensitive`` (default true) and ``strip`` (default true);
- ``solution`` (ours, optional): the oracle's actions, where a ``click`` names its target on the
  first screen by ``text`` (the element of that name) or by ``role`` and ``index`` (the index-th
  element of that role), since ids are the screen's to assign.

``load_task(path)`` reads a file and inlines its page, so a task row carries everything it needs
(``gui-rl/make_tasks.py`` writes them).
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Optional

from clawrl.envs.base import EnvError
from clawrl.envs.computer_use import Element, parse_action

STEP_TYPES = ("open_page", "chrome_open_tabs")
GETTERS = ("element_value", "element_text", "element_checked", "page_title")
FUNCS = ("exact_match", "includes", "is_true")
_PAGES = Path(tempfile.gettempdir()) / "clawrl-gui-pages"


def load_task(path: str | Path) -> dict:
    """The task in the OSWorld-style file ``path``, validated, its page inlined as ``html``."""
    path = Path(path)
    try:
        task = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EnvError(f"{path}: not a readable JSON task ({e})") from None
    if not isinstance(task, dict) or not isinstance(task.get("config"), list):
        raise EnvError(f"{path}: an OSWorld task is an object with a config list")
    steps = []
    for step in task["config"]:
        kind = step.get("type") if isinstance(step, dict) else None
        params = step.get("parameters", {}) if isinstance(step, dict) else {}
        if kind == "chrome_open_tabs":
            urls = params.get("urls_to_open") or []
            if len(urls) != 1:
                raise EnvError(f"{path}: chrome_open_tabs takes one local page here, got {len(urls)}")
            params, kind = {"path": urls[0]}, "open_page"
        if kind != "open_page":
            raise EnvError(f"{path}: config step {kind!r} is not supported: only {', '.join(STEP_TYPES)} of a local "
                           "page (no VM, no network)")
        page = str(params.get("path", ""))
        if "://" in page:
            raise EnvError(f"{path}: {page} is not a local page (the browser has no network)")
        try:
            html = (path.parent / page).read_text()
        except OSError as e:
            raise EnvError(f"{path}: page {page}: {e}") from None
        steps.append({"type": "open_page", "parameters": {"path": page, "html": html}})
    task = {**task, "config": steps}
    validate(task, str(path))
    return task


def validate(task: dict, where: str) -> None:
    """EnvError naming what is wrong with an (inlined) task."""
    if not isinstance(task.get("instruction"), str) or not task["instruction"].strip():
        raise EnvError(f"{where}: the task has no instruction")
    pages = [s for s in task.get("config", []) if s.get("type") == "open_page" and "html" in s.get("parameters", {})]
    if len(pages) != 1 or len(task["config"]) != 1:
        raise EnvError(f"{where}: the task's config opens exactly one inlined local page (load it with load_task)")
    ev = task.get("evaluator")
    if not isinstance(ev, dict) or ev.get("func") not in FUNCS:
        raise EnvError(f"{where}: evaluator.func must be one of {', '.join(FUNCS)}, got "
                       f"{ev.get('func') if isinstance(ev, dict) else ev!r}")
    result = ev.get("result")
    if not isinstance(result, dict) or result.get("type") not in GETTERS:
        raise EnvError(f"{where}: evaluator.result.type must be one of {', '.join(GETTERS)}")
    if result["type"] != "page_title" and not isinstance(result.get("selector"), str):
        raise EnvError(f"{where}: evaluator.result needs a CSS selector")
    if ev["func"] != "is_true" and "expected" not in ev.get("expected", {}).get("rules", {}):
        raise EnvError(f"{where}: evaluator.expected.rules.expected is missing")
    for action in task.get("solution", []):
        plain = action
        if action.get("action") == "click" and ("text" in action or "role" in action):
            plain = {"action": "click", "element": 0}
        if not isinstance(action, dict) or parse_action(json.dumps(plain))[1] is not None:
            raise EnvError(f"{where}: solution step {action} is not a computer-use action")


def _page_file(task: dict) -> Path:
    html = task["config"][0]["parameters"]["html"]
    _PAGES.mkdir(parents=True, exist_ok=True)
    file = _PAGES / f"{hashlib.sha256(html.encode()).hexdigest()[:16]}.html"
    if not file.exists():
        tmp = file.with_suffix(".tmp")
        tmp.write_text(html)
        tmp.replace(file)
    return file


def set_up(driver, task: dict) -> None:
    """Run the task's config steps in ``driver`` (open its page)."""
    driver.get(_page_file(task).as_uri())


def evaluate(driver, task: dict) -> tuple[bool, str]:
    """(passed, what was compared) by the task's evaluator, on the page as it is now."""
    ev = task["evaluator"]
    result = ev["result"]
    if result["type"] == "page_title":
        value = driver.title
    else:
        value = driver.execute_script(
            "var e = document.querySelector(arguments[0]); if (!e) return null;"
            "return arguments[1] === 'element_checked' ? e.checked : arguments[1] === 'element_value' ? e.value :"
            " e.textContent;", result["selector"], result["type"])
    if value is None:
        return False, f"no element matches {result.get('selector')}"
    if ev["func"] == "is_true":
        return value is True, f"{result['type']} = {value!r}"
    options = ev.get("options", {})
    expected = str(ev["expected"]["rules"]["expected"])
    got = str(value)
    if options.get("strip", True):
        got, expected = got.strip(), expected.strip()
    if not options.get("case_sensitive", True):
        got, expected = got.lower(), expected.lower()
    ok = got == expected if ev["func"] == "exact_match" else expected in got
    return ok, f"{result['type']} = {got!r}, expected {ev['func']} {expected!r}"


def solution(task: dict, screen: list[Element]) -> Optional[list[dict]]:
    """The task's ``solution`` with clicks by ``text`` resolved against the first screen; None
    without one, or when a named target is not there."""
    steps = task.get("solution")
    if not steps:
        return None
    out = []
    for step in steps:
        if step.get("action") == "click" and ("text" in step or "role" in step):
            if "text" in step:
                matches = [e for e in screen if e.name == step["text"]]
            else:
                matches = [e for e in screen if e.role == step["role"]][step.get("index", 0):]
            if not matches:
                return None
            step = {"action": "click", "element": matches[0].id}
        out.append(step)
    return out
