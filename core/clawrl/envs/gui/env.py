"""The GUI environment (``env.name=gui``): operate a web page in a real headless browser.

A task is a row naming a MiniWoB++ task and a seed (``{"miniwob": "click-button", "seed": 3}``),
or an OSWorld-style task (``{"osworld": {...}}``, ``clawrl.envs.gui.osworld``) whose page is a local
file. The agent speaks the computer-use format the embedded model learned
(``clawrl.envs.computer_use``): each turn shows the instruction (first turn) and the screen as an
accessibility tree; the reply is one JSON action, ``click`` (an element or a point), ``type``,
``key``, ``scroll`` or ``done``. A reply that is not a valid action, or that names an element not on
the screen, a point off it or a key there is no such key, gets an observation saying why, then the
unchanged screen again.

Each screen's PNG is written under ``<run_dir>/screens/`` and named in the user message's
``screenshot`` field, and travels in ``Observation.images``: recorded for a vision model later, not
shown to the text-only model trained today (the rollout renders text).

Reward: MiniWoB's raw reward (in [-1, 1]: 1 for a solved task, partial credit on a few, -1 for a
wrong end or for ``EPISODE_MAX_TIME`` running out, set from ``env.gui_episode_max_time_s``), as
soon as the page says the task ended; success when it is above 0. ``done`` before the page ended
the task, or running out of turns, is -1. OSWorld-style tasks are scored by their evaluator, 1 or -1.

Browsers come from a pool (``clawrl.envs.gui.browser``). A browser that crashes or hangs mid-episode
is killed and replaced, the task reopened with the same seed and the episode's actions replayed,
then the action retried: the episode goes on. A second failure in the same step fails the episode,
never the run.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from pathlib import Path
from typing import Optional

from clawrl.envs.base import Env, EnvError, Observation, StepOutcome, Task
from clawrl.envs.computer_use import SYSTEM_PROMPT, Element, parse_action, render_screen
from clawrl.envs.gui.miniwob_tasks import HTML_DIR, TASKS, solve, task_url
from clawrl.envs.gui.osworld import evaluate as osworld_evaluate
from clawrl.envs.gui.osworld import set_up as osworld_set_up
from clawrl.envs.gui.osworld import solution as osworld_solution
from clawrl.envs.gui.osworld import validate as osworld_validate
from clawrl.envs.gui.screen import (DOM_SCRIPT, OFFSET, center, click, elements, key_chord, page_point, press, scroll,
                                   type_text)
from clawrl.envs.gui.browser import COMMAND_TIMEOUT_S, WINDOW, Browser, BrowserPool, shared_pool

log = logging.getLogger(__name__)

# After an action, the page's handlers run before the next screen is read.
SETTLE_S = 0.05
POOL_POLL_S = 0.05
FORMAT_HINT = ('Reply with exactly one JSON action, e.g. {"action": "click", "element": ID}, '
               '{"action": "type", "text": "..."} or {"action": "done"}.')


class BrowserFailed(Exception):
    """The browser crashed or stopped answering during an operation."""


class GuiEnv(Env):
    def __init__(self, pool: BrowserPool, max_time_s: float, screens_dir: Optional[Path]):
        self.pool, self.max_time_s, self.screens_dir = pool, max_time_s, screens_dir
        self.browser: Optional[Browser] = None
        self.task: Optional[Task] = None
        self.instruction = ""
        self.elements: list[Element] = []
        self.history: list[dict] = []  # the actions applied so far (replayed on a fresh browser)
        self.verdict: Optional[StepOutcome] = None
        self.shots = 0
        self.episode_key = uuid.uuid4().hex[:12]
        self.counts = {"malformed_replies": 0, "impossible_actions": 0, "browser_restarts": 0}

    @classmethod
    def from_config(cls, cfg) -> "GuiEnv":
        return cls(shared_pool(cfg.env.gui_browsers), cfg.env.gui_episode_max_time_s, Path(cfg.run_dir) / "screens")

    # ------------------------------------------------------------------ the browser, from async code

    async def _call(self, fn, *args):
        """``fn(driver, *args)`` in a worker thread; BrowserFailed when the browser errs or hangs."""
        browser = self.browser
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, browser.driver, *args), COMMAND_TIMEOUT_S + 10)
        except (EnvError, LookupError):
            raise
        except asyncio.TimeoutError:
            browser.kill()  # also frees the worker thread stuck on it
            raise BrowserFailed("the browser stopped answering") from None
        except Exception as e:
            raise BrowserFailed(f"the browser failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None

    async def _open(self) -> None:
        """A browser with the task's first screen: a pooled one, or a fresh one if it fails."""
        for attempt in (1, 2):
            while self.browser is None:
                # Waiting for a free browser must not hold a worker thread: the episodes that hold
                # the browsers need those threads to finish (asyncio's default pool is small).
                self.browser = await asyncio.to_thread(self.pool.acquire, False)
                if self.browser is None:
                    await asyncio.sleep(POOL_POLL_S)
            try:
                await self._call(_open_task, self.task.data, self.max_time_s)
                return
            except BrowserFailed as e:
                log.warning("gui: task %s: %s; starting a fresh browser", self.task.task_id, e)
                await self._drop_browser()
                if attempt == 2:
                    raise EnvError(f"task {self.task.task_id}: {e}, twice") from None

    async def _drop_browser(self) -> None:
        if self.browser is not None:
            browser, self.browser = self.browser, None
            self.counts["browser_restarts"] += 1
            await asyncio.to_thread(self.pool.release, browser, False)

    async def _screen(self) -> tuple[str, list[Element], bytes]:
        instruction, dom, png = await self._call(_read_page, self.task.data)
        return instruction, elements(dom, _window()) if dom else [], png

    # ------------------------------------------------------------------ the episode

    async def reset(self, task: Task) -> Observation:
        _task_kind(task)
        self.task = task
        await self._open()
        self.instruction, self.elements, png = await self._screen()
        return self._observation(render_screen(self.elements, self.instruction), png, system=True)

    def _observation(self, text: str, png: Optional[bytes], system: bool = False) -> Observation:
        message = {"role": "user", "content": text}
        if png:
            path = self._save(png)
            if path is not None:
                message["screenshot"] = str(path)
        messages = ([{"role": "system", "content": SYSTEM_PROMPT}] if system else []) + [message]
        return Observation(messages, images=[png] if png else [])

    def _save(self, png: bytes) -> Optional[Path]:
        if self.screens_dir is None:
            return None
        folder = self.screens_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', self.task.task_id)}-{self.episode_key}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.shots:02d}.png"
        path.write_bytes(png)
        self.shots += 1
        return path

    async def step(self, action: str) -> StepOutcome:
        if self.task is None:
            raise EnvError("step before reset")
        if self.verdict is not None:
            raise EnvError("the episode is over")
        parsed, error = parse_action(action)
        if error is not None:
            self.counts["malformed_replies"] += 1
            return StepOutcome(self._retry(f"Not a valid action: {error}. {FORMAT_HINT}"),
                               info={"malformed": True, "error": error, **self.counts})
        if parsed["action"] == "done":
            return await self._judge("done")
        why = self._impossible(parsed)
        if why is not None:
            self.counts["impossible_actions"] += 1
            return StepOutcome(self._retry(f"Cannot do that: {why}. Nothing happened."),
                               info={"impossible": True, "error": why, **self.counts})
        try:
            return await self._act(parsed)
        except BrowserFailed as e:
            log.warning("gui: task %s: %s; replaying %d actions on a fresh browser", self.task.task_id, e,
                        len(self.history))
        try:
            await self._replay()
            return await self._act(parsed)
        except BrowserFailed as again:
            raise EnvError(f"task {self.task.task_id}: the browser failed again after a restart: {again}") from None

    def _retry(self, why: str) -> Observation:
        """The observation after a reply that changed nothing: why, then the same screen again, so the
        turn reads like every other (the format's user turns are screens). With the reason alone the
        embedded model left the format on the next turn (greedy: a valid action 0 of 60 times after
        a click on a missing element; 54 of 60 with the screen after it; gui-rl/README.md)."""
        return Observation([{"role": "user", "content": f"{why}\n\n{render_screen(self.elements)}"}])

    async def _act(self, action: dict) -> StepOutcome:
        # The page may have ended the task since the last screen (EPISODE_MAX_TIME ran out); acting
        # now would click MiniWoB's cover, which starts a new instance.
        ended = await self._ended()
        if ended is not None:
            return ended
        await self._call(_perform, action, self.elements)
        self.history.append(action)
        ended = await self._ended()
        if ended is not None:
            return ended
        _, self.elements, png = await self._screen()
        return StepOutcome(self._observation(render_screen(self.elements), png), info=dict(self.counts))

    def _impossible(self, action: dict) -> Optional[str]:
        """Why ``action`` cannot be done on the current screen, or None."""
        kind = action["action"]
        if kind == "click" and "element" in action:
            if not any(e.id == action["element"] for e in self.elements):
                return f"there is no element {action['element']} on the screen"
        elif kind == "click":
            x, y = page_point(action["x"], action["y"])
            w, h = _window()
            if not (0 <= x < w and 0 <= y < h):
                lo = OFFSET
                return (f"({action['x']}, {action['y']}) is off the screen (x {lo}..{lo + w - 1}, "
                        f"y {lo}..{lo + h - 1})")
        elif kind == "key" and key_chord(action["key"]) is None:
            return f"no key {action['key']!r} (Enter, Tab, Backspace, Escape, Arrow*, a character, Ctrl+KEY, ...)"
        elif kind == "type" and not action["text"]:
            return "type needs some text"
        return None

    async def _replay(self) -> None:
        """A fresh browser in the state the episode had: the task reopened (same seed) and the
        actions so far applied again."""
        await self._drop_browser()
        await self._open()
        _, self.elements, _ = await self._screen()
        for earlier in self.history:
            await self._call(_perform, earlier, self.elements)
            _, self.elements, _ = await self._screen()

    async def _ended(self) -> Optional[StepOutcome]:
        """The verdict if the page ended the task (MiniWoB) or None while it goes on."""
        if "miniwob" not in self.task.data:
            return None
        meta = await self._call(_miniwob_state)
        if not meta["done"]:
            return None
        return self._verdict(float(meta["raw_reward"]), "task_ended", str(meta.get("reason")))

    def _verdict(self, reward: float, reason: str, detail: str = "", truncated: bool = False) -> StepOutcome:
        self.verdict = StepOutcome(None, reward=reward, done=not truncated, truncated=truncated,
                                   info={"success": reward > 0, "reason": reason, "detail": detail,
                                         "actions": len(self.history), **self.counts})
        return self.verdict

    async def _judge(self, reason: str, truncated: bool = False) -> StepOutcome:
        """The verdict when the agent says done (or runs out of turns): MiniWoB's reward if the page
        already ended the task, else -1; an OSWorld-style task's evaluator."""
        if "osworld" in self.task.data:
            ok, detail = await self._call(osworld_evaluate, self.task.data["osworld"])
            return self._verdict(1.0 if ok else -1.0, reason, detail, truncated)
        ended = await self._ended()
        if ended is not None:
            return ended
        return self._verdict(-1.0, reason, "the task was not completed", truncated)

    async def finish(self) -> Optional[StepOutcome]:
        if self.verdict is not None:
            return self.verdict
        if self.browser is None:
            return None
        try:
            return await self._judge("max_turns", truncated=True)
        except BrowserFailed as e:
            raise EnvError(f"task {self.task.task_id}: judging failed: {e}") from None

    async def oracle_actions(self) -> Optional[list[str]]:
        if self.task is None:
            return None
        if "osworld" in self.task.data:
            actions = osworld_solution(self.task.data["osworld"], self.elements)
        else:
            actions = solve(self.task.data["miniwob"], self.instruction, self.elements)
        return None if actions is None else [json.dumps(a) for a in actions] + ['{"action": "done"}']

    async def close(self) -> None:
        if self.browser is not None:
            browser, self.browser = self.browser, None
            healthy = await asyncio.to_thread(browser.alive)
            await asyncio.to_thread(self.pool.release, browser, healthy)

    @classmethod
    def tasks(cls, split: str) -> list[Task]:
        raise EnvError("env.name=gui plays rows of a task set: give one with env.tasks=PATH (gui-rl/ ships one)")


# ---------------------------------------------------------------------- what runs in the worker thread

def _window() -> tuple[int, int]:
    return WINDOW


def _task_kind(task: Task) -> None:
    data = task.data
    if "miniwob" in data:
        name = data["miniwob"]
        if not HTML_DIR.is_dir():
            raise EnvError("MiniWoB's task pages are missing: pip install miniwob (requirements.txt pins it)")
        if name not in TASKS:
            raise EnvError(f"task {task.task_id}: {name!r} is not a MiniWoB task gui-rl wires "
                           f"(clawrl.envs.gui.TASKS)")
        if not isinstance(data.get("seed"), int) or isinstance(data.get("seed"), bool):
            raise EnvError(f"task {task.task_id}: a MiniWoB row needs an integer seed")
    elif "osworld" in data:
        osworld_validate(data["osworld"], task.task_id)
    else:
        raise EnvError(f"task {task.task_id}: a gui task row has a miniwob (with seed) or an osworld field")


def _open_task(driver, data: dict, max_time_s: float) -> None:
    if "osworld" in data:
        osworld_set_up(driver, data["osworld"])
        return
    driver.get(task_url(data["miniwob"]))
    driver.execute_script(
        "core.EPISODE_MAX_TIME = arguments[0]; Math.seedrandom(arguments[1]); core.setDataMode('train');"
        "core.startEpisodeReal();", int(max_time_s * 1000), data["seed"])
    deadline = time.monotonic() + 5
    while not driver.execute_script("return WOB_TASK_READY;"):
        if time.monotonic() > deadline:
            raise EnvError(f"MiniWoB task {data['miniwob']} did not become ready")
        time.sleep(0.05)


def _read_page(driver, data: dict) -> tuple[str, dict, bytes]:
    if "osworld" in data:
        instruction = data["osworld"]["instruction"]
    else:
        utterance = driver.execute_script("return core.getUtterance();")
        instruction = utterance["utterance"] if isinstance(utterance, dict) else str(utterance)
    dom = driver.execute_script(DOM_SCRIPT)
    return instruction, dom, driver.get_screenshot_as_png()


def _miniwob_state(driver) -> dict:
    return driver.execute_script('return {"done": WOB_DONE_GLOBAL, "raw_reward": WOB_RAW_REWARD_GLOBAL, '
                                 '"reason": WOB_REWARD_REASON};')


def _perform(driver, action: dict, elements: list[Element]) -> None:
    kind = action["action"]
    if kind == "click":
        if "element" in action:
            target = next((e for e in elements if e.id == action["element"]), None)
            if target is None:
                raise LookupError(f"no element {action['element']}")
            x, y = center(target)
        else:
            x, y = action["x"], action["y"]
        click(driver, *page_point(x, y))
    elif kind == "type":
        type_text(driver, action["text"])
    elif kind == "key":
        press(driver, key_chord(action["key"]))
    elif kind == "scroll":
        scroll(driver, 80, 100, action["dy"])  # the middle of MiniWoB's 160 x 210 task frame
    time.sleep(SETTLE_S)
