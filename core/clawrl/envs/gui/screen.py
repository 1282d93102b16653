"""A MiniWoB page as the computer-use format's screen, and the format's actions as WebDriver input.

``DOM_SCRIPT`` (``dom.js``) walks any page the way MiniWoB's ``core.getDOMInfo()`` does (tag, box,
text, value, and a ``ref`` per element that it keeps while it lives), and ``elements(dom)`` turns
that into ``computer_use.Element`` lines:

- ids are ``ref + ID_BASE - 1`` and boxes are shifted by ``OFFSET`` pixels: the task frame sits
  at (60, 60) on the agent's screen, because the embedded model learned screens whose every id and
  coordinate is at least 60 (``docs/action_formats.md``); ``page_point`` maps a click back;
- text that shares its parent with elements (``t`` pseudo-elements, ref 0) gets the ids after the largest ref, in document order;
- containers with nothing of their own (no text, no role an agent acts on) are left out, and so is
  anything outside the window.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from clawrl.envs.computer_use import Element

DOM_SCRIPT = (Path(__file__).parent / "dom.js").read_text()
ID_BASE = 60
OFFSET = 60
ROLES = {"BUTTON": "button", "A": "link", "TEXTAREA": "textbox", "SELECT": "combobox", "OPTION": "option",
         "LABEL": "label", "H1": "heading", "H2": "heading", "H3": "heading", "H4": "heading", "LI": "listitem",
         "TD": "cell", "TH": "cell", "IMG": "img", "INPUT_checkbox": "checkbox", "INPUT_radio": "radio",
         "INPUT_submit": "button", "INPUT_button": "button", "INPUT_range": "slider", "t": "text"}
TEXTBOXES = {"INPUT_text", "INPUT_password", "INPUT_email", "INPUT_number", "INPUT_search", "INPUT_tel",
             "INPUT_url", "INPUT_date", "INPUT_time"}
ACTIONABLE = {"button", "link", "textbox", "combobox", "option", "checkbox", "radio", "slider"}
# Key names the agent may use (the format's examples: Enter, Tab, ...), and single characters, as
# the names of selenium's ``Keys`` constants. Selenium is imported by the functions that drive a
# browser, so that importing clawrl.envs (every environment, and the GPU image) does not need it.
KEYS = {"Enter": "ENTER", "Return": "ENTER", "Tab": "TAB", "Backspace": "BACKSPACE", "Delete": "DELETE",
        "Escape": "ESCAPE", "Esc": "ESCAPE", "Space": "SPACE", "ArrowUp": "ARROW_UP", "ArrowDown": "ARROW_DOWN",
        "ArrowLeft": "ARROW_LEFT", "ArrowRight": "ARROW_RIGHT", "Up": "ARROW_UP", "Down": "ARROW_DOWN",
        "Left": "ARROW_LEFT", "Right": "ARROW_RIGHT", "Home": "HOME", "End": "END", "PageUp": "PAGE_UP",
        "PageDown": "PAGE_DOWN"}
MODIFIERS = {"Ctrl": "CONTROL", "Control": "CONTROL", "Shift": "SHIFT", "Alt": "ALT", "Meta": "META",
             "Cmd": "META"}


def _role(node: dict) -> str:
    tag = node["tag"]
    if tag in TEXTBOXES:
        return "textbox"
    if tag in ROLES:
        return ROLES[tag]
    if "alink" in str(node.get("classes", "")).split():
        return "link"  # MiniWoB's links are spans
    return "text" if node.get("text") else tag.lower()


def _name(node: dict, role: str) -> str:
    if role in ("checkbox", "radio"):
        return "checked" if node.get("value") else "unchecked"
    if role == "textbox":
        return str(node.get("value") or "")
    text = str(node.get("text") or "").strip()
    if text:
        return text
    if node.get("id") and not node["children"]:
        return str(node["id"])  # e.g. grid-coordinate's points are named by their id
    color = node.get("bgColor", "")
    return color if not node["children"] and color and color != "rgba(0, 0, 0, 0)" else ""


def elements(dom: dict, window: tuple[int, int]) -> list[Element]:
    """The screen's elements from MiniWoB's DOM info, in document order."""
    nodes: list[dict] = []

    def walk(node: dict) -> None:
        nodes.append(node)
        for child in node.get("children", []):
            walk(child)

    walk(dom)
    next_id = ID_BASE - 1 + max((n["ref"] for n in nodes if n["ref"] > 0), default=0) + 1
    out = []
    for node in nodes:
        if node["ref"] > 0:
            eid = ID_BASE - 1 + node["ref"]
        else:
            eid, next_id = next_id, next_id + 1
        left, top = round(node["left"]), round(node["top"])
        right, bottom = round(node["left"] + node["width"]), round(node["top"] + node["height"])
        if right <= 0 or bottom <= 0 or left >= window[0] or top >= window[1]:
            continue
        role = _role(node)
        name = _name(node, role)
        if role not in ACTIONABLE and not name:
            continue
        out.append(Element(eid, role, name, (left + OFFSET, top + OFFSET, right + OFFSET, bottom + OFFSET)))
    return out


def page_point(x: int, y: int) -> tuple[int, int]:
    """A screen point the agent names, in the page's own pixels."""
    return x - OFFSET, y - OFFSET


def center(element: Element) -> tuple[int, int]:
    left, top, right, bottom = element.box
    return (left + right) // 2, (top + bottom) // 2


def _chain(driver, **kwargs):
    from selenium.webdriver.common.action_chains import ActionChains

    return ActionChains(driver, **kwargs)


def click(driver, x: int, y: int) -> None:
    """A real mouse click at page pixel (x, y): the page sees move, down, up and click."""
    chain = _chain(driver, duration=0)
    chain.w3c_actions.pointer_action.move_to_location(x, y)
    chain.w3c_actions.pointer_action.click()
    chain.w3c_actions.perform()


def type_text(driver, text: str) -> None:
    """Keystrokes into the focused element."""
    chain = _chain(driver, duration=0)
    for ch in text:
        chain.w3c_actions.key_action.key_down(ch)
        chain.w3c_actions.key_action.key_up(ch)
    chain.perform()


def key_chord(name: str) -> Optional[list[str]]:
    """The WebDriver keys of ``Enter``, ``a``, ``Ctrl+a``, ...; None for a name it does not know."""
    parts = name.split("+") if len(name) > 1 else [name]
    *mods, key = parts
    if any(m not in MODIFIERS for m in mods) or (key not in KEYS and len(key) != 1):
        return None
    from selenium.webdriver.common.keys import Keys

    main = getattr(Keys, KEYS[key]) if key in KEYS else key
    return [getattr(Keys, MODIFIERS[m]) for m in mods] + [main]


def press(driver, keys: list[str]) -> None:
    chain = _chain(driver, duration=0)
    for k in keys:
        chain.w3c_actions.key_action.key_down(k)
    for k in reversed(keys):
        chain.w3c_actions.key_action.key_up(k)
    chain.perform()


def scroll(driver, x: int, y: int, dy: int) -> None:
    """The mouse wheel at page pixel (x, y), ``dy`` pixels (positive: down)."""
    chain = _chain(driver)
    chain.w3c_actions.wheel_action.scroll(x=x, y=y, delta_y=dy, duration=0)
    chain.w3c_actions.perform()
