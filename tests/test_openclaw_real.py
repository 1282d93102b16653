"""The real OpenClaw CLI (2026.9.6) against ``clawrl serve``: what a user gets when they paste the
printed provider snippet into OpenClaw and chat, with and without the ``rl-training-headers`` plugin.

Two ``clawrl serve`` subprocesses (module-scoped, ``server.port=0``, a tmp ``run_dir``,
``train.enabled=false``), both on the embedded default model:

- ``server``: stock ``clawrl serve``, nothing replaced.
- ``tool_server``: ``clawrl serve`` whose engine is :class:`ScriptedToolEngine`, the real
  ``TorchEngine`` except that it *calls OpenClaw's ``ls`` tool* when the latest user message asks
  :data:`TOOL_TRIGGER`. The tiny model will not reliably call OpenClaw's tools, and a recorded
  tool call needs one. The call's tokens are the tokenizer's encoding of :data:`FORCED_CALL` and
  their logprobs the model's own (``Engine.score``); everything after the engine is real: the
  gateway parses the call, OpenClaw runs ``ls`` and sends its result, the linker stores it as the
  next state. Every other request (the reply after the tool result included) is sampled by the model.

Stored turns are read back through the admin API and the run's SQLite store. Each OpenClaw turn
costs one prefill of its ~40 KB prompt on the first request of a server (~20 s on 2 cores), then
mostly prefix-cache hits.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawrl.engines.base import TokenChunk
from clawrl.engines.torch_engine import TorchEngine
from clawrl.store import TurnStore
from tests import openclaw_cli

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "extensions" / "rl-training-headers"
PLUGIN_ID = "rl-training-headers"
MAX_TOKENS = 48  # server.default_max_tokens: the printed snippet's maxTokens, so OpenClaw asks for this many
TURN_BOUND_S = 60  # generous bound on serving a turn after the first (measured 1-2 s on 2 busy cores)
INTERNAL_CONTEXT = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
TOOL_TRIGGER = "What files are in the workspace?"
FORCED_CALL = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'


# --- the engine the tool test controls -----------------------------------------------------------


class ScriptedToolEngine(TorchEngine):
    """See the module docstring: ``ls`` on :data:`TOOL_TRIGGER`, the model's own sampling otherwise."""

    def stream(self, prompt_ids, params, request_id=None):
        if not self._asks_for_files(prompt_ids):
            return super().stream(prompt_ids, params, request_id)
        ids = self.tokenizer.encode(FORCED_CALL, add_special_tokens=False) + [self.loaded.eos_token_ids[0]]
        return self._forced(list(prompt_ids), ids, params.temperature or 1.0)

    def _asks_for_files(self, prompt_ids) -> bool:
        """True when the conversation's latest message (OpenClaw's trailing internal-context message
        and the generation prompt aside) is the user's, asking TOOL_TRIGGER; a tool result is not."""
        blocks = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False).split("<|im_start|>")[:-1]
        said = [b for b in blocks if not b.startswith("user\n" + INTERNAL_CONTEXT)]
        last = said[-1] if said else ""
        return last.startswith("user\n") and TOOL_TRIGGER in last and "<tool_response>" not in last

    async def _forced(self, prompt_ids, ids, temperature):
        scored = await self.score(prompt_ids, ids, temperature=temperature)
        yield TokenChunk(ids, scored.logprobs, [scored.weight_version] * len(ids), finish_reason="stop",
                         matched_stop=ids[-1])


def serve_with_scripted_tool_calls() -> int:
    """``clawrl serve ARGS`` (``sys.argv[1:]``) with :class:`ScriptedToolEngine` as its engine."""
    from clawrl.cli import main
    from clawrl.engines.loading import load_model
    from clawrl.orchestration import serve

    def make_engine(cfg):
        m = cfg.model
        return ScriptedToolEngine(load_model(m.path, device=m.device, dtype=m.dtype, name=m.name), cfg.engine)

    serve.make_engine = make_engine  # the name serve_cli builds its engine with
    return main(sys.argv[1:])


# --- clawrl serve as a subprocess ----------------------------------------------------------------

CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]
CLAWRL_SCRIPTED_TOOLS = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                         "from tests.test_openclaw_real import serve_with_scripted_tool_calls as s; sys.exit(s())"]


class ClawrlServe:
    """``clawrl serve`` on a free loopback port (``server.port=0``); output goes to ``log``."""

    def __init__(self, launcher: list[str], run_dir: Path, *overrides: str):
        self.run_dir, self.log = run_dir, run_dir / "serve.log"
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [*launcher, "serve", "server.port=0", f"run_dir={run_dir}", "train.enabled=false",
                 f"server.default_max_tokens={MAX_TOKENS}", *overrides],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + 600  # loads (or waits for the build of) the embedded model
        while "\n}\n" not in self.output():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise AssertionError(f"clawrl serve did not start: {self.output()[-3000:]}")
            time.sleep(0.2)
        out = self.output()
        self.snippet = json.loads(out[out.index("\n{") + 1: out.index("\n}\n") + 2])
        self.base_url = self.snippet["models"]["providers"]["clawrl"]["baseUrl"]
        self.url = self.base_url.removesuffix("/v1")
        while httpx.get(self.url + "/healthz", timeout=30).status_code != 200:
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text()

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def session(self, session_id: str) -> dict:
        return self.get(f"/admin/sessions/{session_id}")

    def turns(self) -> list[dict]:
        """Every stored turn, messages included (read from the run's store, as ``clawrl export`` does)."""
        store = TurnStore(self.run_dir, create=False)
        try:
            return list(store.iter_turns())
        finally:
            store.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def text_of(message: dict) -> str:
    c = message.get("content")
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [])


def mentions(turn: dict, text: str) -> bool:
    return any(text in text_of(m) for m in turn["messages"])


def wait_until(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def report_times(who: str, wall: list[float], turns: list[dict]) -> None:
    """Print the measured times (wall: the whole ``openclaw agent`` command; server: the stored turn)."""
    served = ", ".join("%.1f s (%d prompt tokens)" % (t["completed_at"] - t["created_at"], t["prompt_tokens"])
                       for t in turns)
    print(f"\n{who}: agent command wall {', '.join('%.1f s' % w for w in wall)}; served in {served}")


def shape(turns: list[dict]) -> list[tuple]:
    """What linking decided for a session's turns, independent of ids and of who decided the type."""
    index = {t["turn_id"]: i for i, t in enumerate(turns)}
    return [(t["turn_index"], index.get(t["parent_turn_id"]), t["link_rule"], t["turn_type"],
             t["close_reason"]) for t in turns]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    """The embedded default, greedy for requests that send no temperature (OpenClaw sends none).
    At temperature 1 the tiny model starts about one reply in six on OpenClaw's prompt with a tool
    call it cannot finish, or ends it at once; OpenClaw then sends a retry request of its own ("The
    previous attempt did not produce a user-visible answer"), and a turn count became a matter of
    sampling luck. Greedy, its first replies are plain text."""
    s = ClawrlServe(CLAWRL, tmp_path_factory.mktemp("clawrl-embedded"), "server.default_temperature=0")
    yield s
    s.stop()


def _home(tmp_path_factory, name: str, snippet: dict, plugin: bool) -> Path:
    openclaw_cli.skip_without_npm()
    home = tmp_path_factory.mktemp(name)
    openclaw_cli.paste_provider(home, snippet)
    if plugin:
        openclaw_cli.install_plugin(home, PLUGIN_DIR, PLUGIN_ID)
    return home


def timed_turn(run, session_id: str, message: str) -> tuple[dict, float]:
    start = time.time()
    result = run(session_id, message)
    return result, time.time() - start


M1 = "Hello! What is the capital of France?"
# The second message, one phrasing per attempt (two_turns): the server samples reproducibly, so a
# session that got a malformed reply would get it again for the same words.
M2S = ("Thanks. And what is 7+5?", "Thanks! Tell me about yourself.", "Great, thank you.", "Thanks. What is 3+4?")


# The tiny model sometimes answers M2 with a malformed <tool_call> block (OpenClaw's prompt differs
# by install path and the current minute). OpenClaw then asks once more in the same session ("The
# previous attempt did not produce a user-visible answer...": a third main turn, which clawrl rightly
# stores with that message as turn 2's next state), or gives up on the turn ("Agent couldn't generate
# a response", exit 1, '"reason": "format"'). Both are the model's doing; the tests need the plain
# two-turn conversation, so such a session is set aside and a fresh one started with the next M2.
MODEL_FORMAT_FAILURE = '"reason": "format"'
ATTEMPTS = len(M2S)


def two_turns(run, name: str, stored) -> tuple[str, str, list[dict], list[float]]:
    """M1 then M2 in a new session, ``run(session_id, message)`` for each; ``stored(session_id)`` is
    the session's stored turns. A fresh session (``name``, then ``name-1``, ...) when OpenClaw
    rejected a reply or asked again (above). Returns the session id and second message used, the
    two results and their wall times."""
    for attempt in range(ATTEMPTS):
        sid, m2 = (f"{name}-{attempt}" if attempt else name), M2S[attempt]
        try:
            (r1, wall1), (r2, wall2) = timed_turn(run, sid, M1), timed_turn(run, sid, m2)
        except RuntimeError as e:
            if MODEL_FORMAT_FAILURE not in str(e):
                raise
            print(f"{sid}: OpenClaw rejected the model's reply ({MODEL_FORMAT_FAILURE}); a new session")
            continue
        main = [t for t in stored(sid) if t["turn_type"] == "main"]
        if len(main) == 2:
            return sid, m2, [r1, r2], [wall1, wall2]
        print(f"{sid}: {len(main)} main turns (OpenClaw asked again after a reply it could not use); a new session")
    pytest.fail(f"OpenClaw did not get a usable reply to both turns in any of {ATTEMPTS} sessions")


@pytest.fixture(scope="module")
def stock_session(tmp_path_factory, server):
    """Two turns of one session from stock OpenClaw (``agent --local``, no plugin)."""
    home = _home(tmp_path_factory, "openclaw-stock", server.snippet, plugin=False)

    def run(s, m):
        return openclaw_cli.agent_turn(home, s, m)

    def stored(s):
        return [t for t in server.turns() if mentions(t, f"sessionId={s} ")]  # OpenClaw's runtime line

    sid, m2, (r1, r2), (wall1, wall2) = two_turns(run, "oc-stock", stored)
    mine = stored(sid)
    return {"m2": m2, "results": [r1, r2], "wall": [wall1, wall2], "turns": mine}


@pytest.fixture(scope="module")
def plugin_session(tmp_path_factory, server):
    """Through ``openclaw gateway run`` with the plugin: two user turns, a heartbeat, then ``/new``."""
    home = _home(tmp_path_factory, "openclaw-plugin", server.snippet, plugin=True)
    with openclaw_cli.Gateway(home) as gw:
        sid, m2, (r1, r2), (wall1, wall2) = two_turns(gw.agent_turn, "oc-plugin", lambda s: server.session(s)["turns"])
        before_heartbeat = server.session(sid)["turns"]
        gw.system_event(f"agent:main:explicit:{sid}", "Check whether the nightly build finished.")
        wait_until(lambda: [t for t in server.session(sid)["turns"] if t["turn_type"] == "side"], 300,
                   "the heartbeat turn")
        gw.agent_turn(sid, "/new")
        wait_until(lambda: [t for t in server.session(sid)["turns"] if t["close_reason"] == "session_done"
                            and t["turn_type"] == "side" and t["response_tokens"] <= 1], 120,
                   "the plugin's closing request")
    turns = [t for t in server.turns() if t["session_id"] == sid]
    return {"sid": sid, "m2": m2, "results": [r1, r2], "wall": [wall1, wall2], "before_heartbeat": before_heartbeat,
            "turns": turns}


# --- issue 3: two turns on the embedded default --------------------------------------------------


def _reply_text(result: dict) -> str:
    payloads = result.get("result", result).get("payloads") or result.get("payloads") or []
    return " ".join(p.get("text") or "" for p in payloads)


@pytest.mark.slow
def test_two_openclaw_turns_on_the_embedded_default_are_answered_and_linked(server, stock_session):
    turns = stock_session["turns"]
    main = [t for t in turns if t["turn_type"] == "main"]
    report_times("stock OpenClaw", stock_session["wall"], main)
    assert len(main) == 2, [(t["turn_id"], t["turn_type"], t["type_rule"]) for t in turns]
    first, second = main
    for t in main:
        assert t["status"] == "complete" and t["response_tokens"] > 0, t
    # linked: one inferred session, turn 2 continues turn 1, and turn 1's next state is the user's next message
    assert first["session_id"] == second["session_id"]
    assert second["parent_turn_id"] == first["turn_id"] and second["link_rule"] == "prefix"
    assert first["close_reason"] == "next_state"
    assert [m["role"] for m in first["next_state"]] == ["user"]
    assert stock_session["m2"] in text_of(first["next_state"][0])
    assert INTERNAL_CONTEXT not in json.dumps(first["next_state"])
    assert second["next_state"] is None and second["close_reason"] is None  # open until the session goes on
    assert all(t["type_rule"] == "default_main" for t in main)
    # each turn after the first reuses the prefix cache: bounded well below a cold 40 KB prefill
    assert second["completed_at"] - second["created_at"] < TURN_BOUND_S
    assert stock_session["wall"][1] < TURN_BOUND_S + 90  # plus `openclaw agent --local` starting up (~30 s)


# --- issue 6: the plugin's headers, prefix linking without it, background runs ------------------


@pytest.mark.slow
def test_plugin_headers_store_turns_under_openclaws_session_id_as_main(server, plugin_session):
    sid = plugin_session["sid"]
    main = [t for t in plugin_session["before_heartbeat"] if t["turn_type"] == "main"]
    report_times("OpenClaw Gateway + plugin", plugin_session["wall"], main)
    assert sid in [s["session_id"] for s in server.get("/admin/sessions?limit=1000")["data"]]
    assert server.session(sid)["source"] == "header"
    assert len(main) == 2, plugin_session["before_heartbeat"]
    for t in main:
        assert t["session_id"] == sid and t["type_rule"] == "header" and t["status"] == "complete", t
    first, second = main
    assert second["parent_turn_id"] == first["turn_id"] and second["link_rule"] == "prefix"
    assert plugin_session["m2"] in text_of(first["next_state"][0])
    for r in plugin_session["results"]:
        assert f'"sessionId": "{sid}"' in json.dumps(r)


@pytest.mark.slow
def test_prefix_linking_without_the_plugin_gives_the_same_session(server, stock_session, plugin_session):
    """Stock OpenClaw sends no session headers; linking by conversation prefix must reach the
    structure the plugin's headers state outright (only the session's name and the rule that
    typed the turns differ)."""
    stock = [t for t in stock_session["turns"] if t["turn_type"] == "main"]
    plugin = [t for t in plugin_session["before_heartbeat"] if t["turn_type"] == "main"]
    assert shape(stock) == shape(plugin) == [(0, None, "new", "main", "next_state"),
                                             (1, 0, "prefix", "main", None)]
    sid = stock[0]["session_id"]
    assert not sid.startswith("oc-stock") and server.session(sid)["source"] == "inferred"
    assert [t["type_rule"] for t in stock] == ["default_main"] * 2
    assert [t["type_rule"] for t in plugin] == ["header"] * 2


HEARTBEAT_MARK = "heartbeat"


@pytest.mark.slow
def test_background_runs_are_side_turns_and_new_closes_the_session(plugin_session):
    """A heartbeat woken in the session is stored as side (by the plugin's header) and does not
    become the user's reaction to turn 2; ``/new`` makes the plugin close the session, so turn 2
    keeps no next state."""
    turns = plugin_session["turns"]
    main = [t for t in turns if t["turn_type"] == "main"][:2]
    heartbeats = [t for t in turns if t["turn_type"] == "side" and t["messages"]
                  and HEARTBEAT_MARK in text_of([m for m in t["messages"] if m["role"] == "user"
                                                 and not text_of(m).startswith(INTERNAL_CONTEXT)][-1]).lower()]
    assert heartbeats, [(t["turn_id"], t["turn_type"], t["type_rule"], text_of(t["messages"][-1])[:200])
                        for t in turns]
    hb = heartbeats[0]
    assert hb["type_rule"] == "header" and hb["session_id"] == plugin_session["sid"]
    assert hb["parent_turn_id"] == main[1]["turn_id"] and hb["branch_id"] != main[1]["branch_id"]
    closing = [t for t in turns if t["close_reason"] == "session_done" and t["turn_type"] == "side"
               and any("session ended" in text_of(m) for m in t["messages"])]
    assert len(closing) == 1 and closing[0]["type_rule"] == "header"
    # the heartbeat left turn 2 open; the session end then closed it without a next state
    assert main[1]["next_state"] is None and main[1]["close_reason"] == "session_done"


# --- tool calls: the next state of a call is OpenClaw's tool result ------------------------------


def tool_tags_reach_the_client(model_dir: Path) -> bool:
    """Whether the gateway's text decoding keeps this tokenizer's ``<tool_call>`` tags; without
    them no tool call can be parsed from the model's output."""
    from transformers import AutoTokenizer

    from clawrl.gateway.text import IncrementalDecoder

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    decoder = IncrementalDecoder(tok)
    return "<tool_call>" in decoder.push(tok.encode(FORCED_CALL, add_special_tokens=False)) + decoder.flush()


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, tiny_model_dir):
    if not tool_tags_reach_the_client(tiny_model_dir):
        pytest.xfail("known bug: the embedded tokenizer marks <tool_call> as a special token and the gateway "
                     "decodes with skip_special_tokens=True, so the model's tool calls reach the client as text")
    # greedy for the same reason as ``server``: at temperature 1 the reply to the tool result was
    # sometimes empty or an unfinished call, OpenClaw dropped it from its history, and the user's
    # follow-up no longer linked to it (the CI run of 1d50b09 failed so)
    s = ClawrlServe(CLAWRL_SCRIPTED_TOOLS, tmp_path_factory.mktemp("clawrl-tools"), "server.default_temperature=0")
    yield s
    s.stop()


@pytest.mark.slow
def test_tool_call_session_is_recorded_with_tool_results_as_next_states(tmp_path_factory, tool_server):
    """Stock OpenClaw through its Gateway, two user messages: the first makes the agent call ``ls``
    (turn 1), OpenClaw runs it and sends the result (turn 2 answers it), then the user's second
    message follows."""
    home = _home(tmp_path_factory, "openclaw-tools", tool_server.snippet, plugin=False)
    sid, follow_up = "oc-tools", "Thanks, that is all."
    with openclaw_cli.Gateway(home) as gw:
        walls = [timed_turn(gw.agent_turn, sid, TOOL_TRIGGER)[1]]
        try:
            walls.append(timed_turn(gw.agent_turn, sid, follow_up)[1])
        except RuntimeError as e:
            # The tiny model's own greedy reply to the follow-up may be a malformed tool call, which
            # OpenClaw rejects (candidate_failed, reason "format"; seen with one build of the embedded
            # model): the request still reached clawrl, and its linking is what this test checks.
            if '"reason": "format"' not in str(e):
                raise
    turns = [t for t in tool_server.turns() if mentions(t, TOOL_TRIGGER)]
    report_times("OpenClaw tool session", walls, turns)
    call, answer = turns[0], turns[1]
    assert [c["function"]["name"] for c in call["tool_calls"]] == ["ls"]
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"path": "."}
    assert call["finish_reason"] == "tool_calls" and call["trainable"]
    assert len(call["response_ids"]) == len(call["logprobs"]) and all(lp <= 0 for lp in call["logprobs"])
    # turn 1's next state is OpenClaw's tool result: what its ls printed of its workspace
    assert [m["role"] for m in call["next_state"]] == ["tool"], call["next_state"]
    assert "AGENTS.md" in text_of(call["next_state"][0])
    assert answer["parent_turn_id"] == call["turn_id"] and answer["link_rule"] == "prefix"
    assert answer["session_id"] == call["session_id"] and answer["turn_type"] == "main"
    # the model answered the tool result itself; what came next is the user's follow-up
    later = [t for t in turns if t["parent_turn_id"] == answer["turn_id"]]
    if answer["tool_calls"]:  # the model chose to call another tool: its result is the next state
        assert [m["role"] for m in answer["next_state"]][:1] == ["tool"]
    else:
        assert [m["role"] for m in answer["next_state"]] == ["user"]
        assert follow_up in text_of(answer["next_state"][0])
        assert later and later[0]["link_rule"] == "prefix" and later[0]["turn_index"] == 2
    for t in turns:
        assert t["session_id"] == call["session_id"] and t["turn_type"] == "main", t
        assert t["turn_index"] == turns.index(t), [(x["turn_id"], x["turn_index"]) for x in turns]


# --- a header that disagrees with prefix linking wins, and the log says so ----------------------


def _chat(server: ClawrlServe, messages: list[dict], headers: dict | None = None) -> httpx.Response:
    r = httpx.post(server.base_url + "/chat/completions", headers=headers or {}, timeout=120, json={
        "model": server.snippet["models"]["providers"]["clawrl"]["models"][0]["id"], "messages": messages,
        "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_headers_that_disagree_with_prefix_linking_win_and_are_logged(server):
    opening = [{"role": "user", "content": "Header test: hello, who are you?"}]
    first = _chat(server, opening)
    inferred = first.headers["x-session-id"]
    reply = first.json()["choices"][0]["message"]["content"]
    follow = opening + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Header test: go on."}]
    second = _chat(server, follow, {"X-Session-Id": "header-wins", "X-Turn-Type": "side"})
    assert second.headers["x-session-id"] == "header-wins"
    [turn] = server.session("header-wins")["turns"]
    assert turn["turn_type"] == "side" and turn["type_rule"] == "header" and turn["link_rule"] == "new"
    # the prefix-inferred session keeps its turn open: the header moved the request elsewhere
    [before] = server.session(inferred)["turns"]
    assert before["next_state"] is None and before["close_reason"] is None
    log = server.output()
    assert f"X-Session-Id header-wins overrides the inferred session {inferred}" in log
    assert "X-Turn-Type side overrides rule default_main (main) in session header-wins" in log
