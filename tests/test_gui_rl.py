"""gui-rl: MiniWoB++ and OSWorld-style pages in headless Chromium.

Without a browser: replies that are not actions, or actions the screen cannot take, get an
observation saying why; the task set's train and test splits share no instance; the OSWorld loader
refuses what needs a VM or the network. With one (slow; CI lists chromium in CLAWRL_REQUIRE, so
these fail there rather than skip): the scripted oracles solve their tasks and the no-op does not,
a browser killed mid-episode is replaced and the episode still ends solved, the page can reach no
network (not even the host's loopback ports), Selenium Manager is never asked for a driver, and
MiniWoB's EPISODE_MAX_TIME comes from the config.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clawrl.envs.base import EnvError, Task
from clawrl.envs.computer_use import Element
from clawrl.envs.gui import browser as browser_mod
from clawrl.envs.gui.browser import Browser, BrowserPool
from clawrl.envs.gui.env import GuiEnv
from clawrl.envs.gui.miniwob_tasks import FIXED, SOLVERS, TASKS, TEST_SEED_BASE
from clawrl.envs.gui.osworld import load_task
from required_tools import skip_unless_available

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "gui-rl"


def _rows(split):
    return [json.loads(line) for line in (RECIPE / "data" / f"{split}.jsonl").read_text().splitlines()]


def need_chromium():
    skip_unless_available("chromium", "chromium and chromium-driver are not installed (apt-get install chromium "
                          "chromium-driver)", available=bool(shutil.which("chromium") and shutil.which("chromedriver")))


# ---------------------------------------------------------------------- no browser needed

def _env_on_screen():
    env = GuiEnv(BrowserPool(1), 60, None)
    env.task = Task("t", {"miniwob": "click-button", "seed": 0})
    env.elements = [Element(64, "button", "Ok", (62, 134, 95, 155))]
    return env


@pytest.mark.parametrize("reply, says", [
    ("click the Ok button", "not one JSON object"),
    ('{"action": "drag", "element": 64}', "unknown action 'drag'"),
    ('{"action": "click", "elemnt": 64}', "click takes x, y, not elemnt"),
    ('{"action": "type", "text": 5}', "type needs 'text' as a string"),
])
def test_a_reply_that_is_not_an_action_gets_an_observation_saying_why(reply, says):
    out = asyncio.run(_env_on_screen().step(reply))
    assert not out.done and out.info["malformed"] and out.reward is None
    assert says in out.observation.messages[0]["content"]


@pytest.mark.parametrize("action, says", [
    ({"action": "click", "element": 99}, "there is no element 99 on the screen"),
    ({"action": "click", "x": 5, "y": 90}, "(5, 90) is off the screen (x 60..559, y 60..459)"),
    ({"action": "key", "key": "Hyper+q"}, "no key 'Hyper+q'"),
    ({"action": "type", "text": ""}, "type needs some text"),
])
def test_an_action_the_screen_cannot_take_gets_an_observation_and_changes_nothing(action, says):
    env = _env_on_screen()
    out = asyncio.run(env.step(json.dumps(action)))
    assert not out.done and out.info["impossible"] and env.history == []
    assert says in out.observation.messages[0]["content"]


@pytest.mark.parametrize("reply", ["click the Ok button", '{"action": "click", "element": 99}'])
def test_after_a_reply_that_changed_nothing_the_screen_is_shown_again(reply):
    # the format's user turns are screens: with the reason alone the embedded model left the format
    out = asyncio.run(_env_on_screen().step(reply))
    text = out.observation.messages[0]["content"]
    assert text.endswith('Screen (accessibility tree):\n[64] button "Ok" (62, 134, 95, 155)'), text


def test_train_and_test_share_no_instance_and_thirty_tasks_are_wired():
    train = [r for s in ("train", "train_click", "train_click_easy") for r in _rows(s)]
    test = [r for s in ("test", "test_click") for r in _rows(s)]
    instances = lambda rows: {(r["miniwob"], r["seed"]) for r in rows if "miniwob" in r}  # noqa: E731
    assert not instances(train) & instances(test)
    assert all(r["seed"] < TEST_SEED_BASE for r in train if "miniwob" in r)
    assert all(r["seed"] >= TEST_SEED_BASE for r in test if "miniwob" in r)
    osworld = lambda rows: {r["osworld"]["id"] for r in rows if "osworld" in r}  # noqa: E731
    assert osworld(train) and osworld(test) and not osworld(train) & osworld(test)  # split by task
    assert {r["miniwob"] for r in _rows("test") if "miniwob" in r} == set(TASKS) - FIXED
    assert len(TASKS) >= 30 and len(SOLVERS) >= 10 and set(SOLVERS) <= set(TASKS)
    check = subprocess.run([sys.executable, str(RECIPE / "make_tasks.py"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("edit, says", [
    ({"config": [{"type": "launch", "parameters": {"command": ["gedit"]}}]}, "config step 'launch' is not supported"),
    ({"config": [{"type": "open_page", "parameters": {"path": "https://example.com/"}}]}, "is not a local page"),
    ({"evaluator": {"func": "compare_pdfs"}}, "evaluator.func must be one of exact_match, includes, is_true"),
    ({"instruction": " "}, "the task has no instruction"),
])
def test_the_osworld_loader_refuses_what_needs_a_vm_or_the_network(tmp_path, edit, says):
    task = json.loads((RECIPE / "osworld" / "profile-name.json").read_text())
    (tmp_path / "pages").mkdir()
    shutil.copy(RECIPE / "osworld" / "pages" / "profile.html", tmp_path / "pages")
    (tmp_path / "t.json").write_text(json.dumps({**task, **edit}))
    with pytest.raises(EnvError, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
        load_task(tmp_path / "t.json")
    assert "\n" not in str(e.value)


def test_importing_the_environments_does_not_import_selenium_and_key_names_still_map():
    """Selenium is imported by what drives a browser, so every environment (and the GPU image) loads
    without it; the agent's key names still become WebDriver keys."""
    code = ("import sys, clawrl.envs, clawrl.envs.gui.screen as s; assert 'selenium' not in sys.modules; "
            "print(repr(s.key_chord('Ctrl+Enter')), s.key_chord('Hyper+a'), s.key_chord('Nope'), s.key_chord('x'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['\\ue009',", "'\\ue007']", "None", "None", "['x']"]


def test_a_missing_browser_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("MINIWOB_CHROME_BINARY", "/nonexistent/chromium")
    monkeypatch.setenv("MINIWOB_CHROMEDRIVER", "/nonexistent/chromedriver")
    with pytest.raises(EnvError, match="^/nonexistent/chromium is not an executable file$"):
        Browser()


# ---------------------------------------------------------------------- in the browser

@pytest.mark.slow
def test_env_check_oracles_solve_every_scripted_task_and_the_nop_does_not(tmp_path):
    """One held-out instance per scripted MiniWoB task, and the OSWorld-style tasks of both splits."""
    need_chromium()
    rows = [next(r for r in _rows("test") if r.get("miniwob") == name) for name in SOLVERS if name not in FIXED]
    rows += [next(r for r in _rows("train") if r.get("miniwob") == name) for name in FIXED]
    rows += [r for s in ("train", "test") for r in _rows(s) if "osworld" in r]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "clawrl.cli", "env", "check", str(tmp_path), "env.name=gui",
                          f"run_dir={tmp_path / 'run'}", "env.max_turns=8"], capture_output=True, text=True,
                         timeout=300)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(lines) == len(rows) >= 24 and all(line["status"] == "ok" for line in lines)
    assert all(line["oracle"] == 1.0 and line["nop"] == -1.0 for line in lines)


@pytest.mark.slow
def test_a_browser_killed_mid_episode_is_replaced_and_the_episode_still_ends_solved(tmp_path):
    need_chromium()
    pool = BrowserPool(1)

    async def main():
        env = GuiEnv(pool, 60, tmp_path / "screens")
        first = await env.reset(Task("login-user/3", {"miniwob": "login-user", "seed": 3}))
        shot = Path(first.messages[-1]["screenshot"])
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and first.images == [shot.read_bytes()]
        actions = await env.oracle_actions()
        out = await env.step(actions[0])  # into the username box
        out = await env.step(actions[1])  # the username typed
        for pid in env.browser.browser_pids():
            # Chromium dies mid-episode (its driver lives on); a child may already have gone with its parent
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for action in actions[2:]:
            out = await env.step(action)
            if out.done:
                break
        await env.close()
        assert out.reward == 1.0 and out.info["success"] and out.info["browser_restarts"] == 1
        # the run goes on: the pool hands the next episode a live browser
        env = GuiEnv(pool, 60, None)
        await env.reset(Task("click-button/1", {"miniwob": "click-button", "seed": 1}))
        corner = await env.step('{"action": "click", "x": 559, "y": 459}')  # the screen's last pixel is on the page
        assert not corner.done and corner.observation and corner.info["browser_restarts"] == 0
        for action in await env.oracle_actions():
            out = await env.step(action)
            if out.done:
                break
        await env.close()
        assert out.reward == 1.0

    try:
        asyncio.run(main())
    finally:
        pool.close()


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        self.hits.append(self.path)
        self.send_response(200)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()
        self.wfile.write(b"reachable")

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_the_browser_reaches_no_network_not_even_the_hosts_loopback(monkeypatch):
    """Requests go to a proxy at 127.0.0.1:9 where nothing listens, loopback included
    (<-loopback>), and no name resolves: a page can fetch or open nothing off the machine's files."""
    need_chromium()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    managed = []
    from selenium.webdriver.common.selenium_manager import SeleniumManager
    monkeypatch.setattr(SeleniumManager, "binary_paths", lambda *a, **k: managed.append(a) or {})
    browser = Browser()
    try:
        assert os.environ["SE_OFFLINE"] == "true" and managed == []  # the driver came by path, not from Manager
        d = browser.driver
        d.get((RECIPE / "osworld" / "pages" / "search.html").as_uri())  # local pages load
        assert d.title == "Library search"
        for url in (f"http://127.0.0.1:{port}/fetch", f"http://localhost:{port}/fetch", "http://example.com/"):
            got = d.execute_script("return fetch(arguments[0]).then(r => 'ok ' + r.status).catch(e => 'failed: ' + e)",
                                   url)
            assert got.startswith("failed:"), (url, got)
        try:
            d.get(f"http://127.0.0.1:{port}/navigate")
        except Exception:
            pass
        assert "reachable" not in d.page_source
        assert _Recorder.hits == []  # nothing ever arrived
    finally:
        browser.close()
        server.shutdown()


@pytest.mark.slow
def test_episode_max_time_comes_from_the_config_and_ends_the_episode_at_minus_one():
    need_chromium()
    pool = BrowserPool(1)

    async def main():
        env = GuiEnv(pool, 1.0, None)
        await env.reset(Task("click-button/2", {"miniwob": "click-button", "seed": 2}))
        await asyncio.sleep(1.5)
        out = await env.step('{"action": "click", "x": 100, "y": 100}')
        await env.close()
        return out

    try:
        out = asyncio.run(main())
    finally:
        pool.close()
    assert out.done and out.reward == -1.0 and not out.info["success"] and out.info["reason"] == "task_ended"
