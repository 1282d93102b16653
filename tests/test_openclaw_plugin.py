"""The OpenClaw plugin ``extensions/rl-training-headers`` with the real OpenClaw CLI (2026.9.6).

It must tag each model request to a clawrl provider with OpenClaw's session id and whether the user
drove the turn (``main``) or OpenClaw did (``side``: heartbeats, memory flushes, ...), and tell
clawrl when a session ends. The real CLI talks to a loopback endpoint that records what arrives.

``RecordingEndpoint`` stands in for clawrl: a test needs only its ``base_url`` and ``requests``, so
the same flows can later run against the real clawrl server (asserting on its turn store instead).
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests import openclaw_cli

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "extensions" / "rl-training-headers"
PLUGIN_ID = "rl-training-headers"
MODEL = "tiny"
REPLY = "Hello from the recording endpoint."


@dataclass
class RecordedRequest:
    path: str
    headers: dict  # lower-cased names
    body: dict

    @property
    def session_headers(self) -> dict:
        return {k: v for k, v in self.headers.items() if k in ("x-session-id", "x-turn-type", "x-session-done")}

    def user_texts(self) -> list[str]:
        out = []
        for m in self.body.get("messages", []):
            if m.get("role") == "user":
                c = m.get("content")
                out.append(c if isinstance(c, str) else "".join(p.get("text", "") for p in c or []))
        return out


class RecordingEndpoint:
    """A loopback OpenAI-compatible endpoint: answers chat completions (streamed or not) with a fixed
    reply and records every request's headers and body. Use as a context manager."""

    def __init__(self):
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, ctype: str, data: bytes):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, "application/json",
                           json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                with endpoint._lock:
                    endpoint.requests.append(RecordedRequest(
                        self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, "application/json", b'{"error": {"message": "not found"}}')
                usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
                if not body.get("stream"):
                    return self._send(200, "application/json", json.dumps({
                        "id": "r1", "object": "chat.completion", "created": 0, "model": body.get("model"),
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                                     "finish_reason": "stop"}], "usage": usage}).encode())
                base = {"id": "r1", "object": "chat.completion.chunk", "created": 0, "model": body.get("model")}
                chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": REPLY},
                                                "finish_reason": None}]},
                          {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                          {**base, "choices": [], "usage": usage}]
                data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
                self._send(200, "text/event-stream", data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "RecordingEndpoint":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def take(self) -> list[RecordedRequest]:
        """The requests recorded since the last take."""
        with self._lock:
            out, self.requests = self.requests, []
        return out

    def wait_for(self, predicate, timeout: float = 120) -> list[RecordedRequest]:
        """Wait until a recorded request satisfies ``predicate``; returns (and takes) all recorded so far."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self._lock:
                if any(predicate(r) for r in self.requests):
                    break
            time.sleep(0.5)
        return self.take()


def openclaw_home_with_plugin(home: Path, base_url: str) -> Path:
    """An isolated OpenClaw home whose provider ``clawrl`` points at ``base_url``, with the plugin
    installed the way the README says. ``base_url`` may be a RecordingEndpoint or a real clawrl server."""
    openclaw_cli.write_provider_config(home, base_url, "test-key", MODEL)
    openclaw_cli.install_plugin(home, PLUGIN_DIR, PLUGIN_ID)
    return home


def chat_requests(requests: list[RecordedRequest]) -> list[RecordedRequest]:
    return [r for r in requests if r.path.endswith("/chat/completions")]


# --- fast ----------------------------------------------------------------------------------------


def test_plugin_logic_unit_tests_pass():
    """The plugin's OpenClaw-free logic (trigger -> turn type, run lookup, close request) under node --test."""
    openclaw_cli.skip_without_npm()
    proc = subprocess.run([str(openclaw_cli.node_path()), "--test", "test/run-ledger.test.mjs"], cwd=PLUGIN_DIR,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "fail 0" in proc.stdout


def test_plugin_package_declares_entry_and_default_provider():
    """What `openclaw plugins install` reads: the manifest id and provider, and a JS entry (no build step)."""
    manifest = json.loads((PLUGIN_DIR / "openclaw.plugin.json").read_text())
    package = json.loads((PLUGIN_DIR / "package.json").read_text())
    assert manifest["id"] == PLUGIN_ID
    assert manifest["providers"] == ["clawrl"]
    assert manifest["configSchema"]["additionalProperties"] is False
    entries = package["openclaw"]["extensions"]
    assert entries == ["./index.js"] and (PLUGIN_DIR / "index.js").exists()
    assert "dependencies" not in package  # nothing to install but openclaw itself


# --- real CLI (slow) -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint():
    with RecordingEndpoint() as ep:
        yield ep


@pytest.fixture(scope="module")
def home(tmp_path_factory, endpoint):
    openclaw_cli.skip_without_npm()
    return openclaw_home_with_plugin(tmp_path_factory.mktemp("openclaw-home"), endpoint.base_url)


@pytest.mark.slow
def test_installed_plugin_registers_its_provider_hooks_and_typed_hooks(home):
    proc = openclaw_cli.checked(openclaw_cli.openclaw(home, "plugins", "inspect", PLUGIN_ID, "--runtime", "--json"),
                                "plugins inspect")
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    text = json.dumps(report)
    assert '"clawrl"' in text, text[:2000]
    for hook in ("before_model_resolve", "session_end", "before_reset"):
        assert hook in text, f"{hook} not registered: {text[:3000]}"
    assert "blocked" not in text, text[:3000]


@pytest.mark.slow
def test_local_agent_turn_is_tagged_main_with_openclaws_session_id(home, endpoint):
    endpoint.take()
    result = openclaw_cli.agent_turn(home, "plugin-local-1", "What is two plus two?")
    assert '"sessionId": "plugin-local-1"' in json.dumps(result)
    reqs = chat_requests(endpoint.take())
    assert reqs, "OpenClaw sent no model request"
    for r in reqs:
        assert r.session_headers == {"x-session-id": "plugin-local-1", "x-turn-type": "main"}, r.session_headers
    assert any("What is two plus two?" in t for t in reqs[-1].user_texts())


MEMORY_FLUSH_MARK = "Pre-compaction memory flush"
HEARTBEAT_MARK = "heartbeat monitor"


def new_user_text(request: RecordedRequest) -> str:
    """The run's own prompt: the last user message, or the one before OpenClaw's trailing
    internal-context message."""
    return "\n".join(request.user_texts()[-2:])


def expected_turn_type(request: RecordedRequest) -> str:
    """What the run really was, read from OpenClaw's own prompt: its memory-flush and heartbeat
    prompts are host-written (side); anything else in these tests is the user's message (main)."""
    text = new_user_text(request)
    return "side" if MEMORY_FLUSH_MARK in text or HEARTBEAT_MARK in text else "main"


@pytest.mark.slow
def test_gateway_runs_are_typed_by_who_drove_them_and_new_sends_session_done(home, endpoint):
    """Through the Gateway, in one session: user turns (main), the memory flush OpenClaw runs once
    the transcript passes ``forceFlushTranscriptBytes`` (side), a heartbeat woken in the session
    (side); then ``/new``, after which the plugin's closing request carries X-Session-Done."""
    sid = "plugin-gw-1"
    cfg_path = home / ".openclaw" / "openclaw.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["agents"]["defaults"]["compaction"] = {"memoryFlush": {"enabled": True, "forceFlushTranscriptBytes": 1000}}
    cfg_path.write_text(json.dumps(cfg, indent=1))
    with openclaw_cli.Gateway(home) as gw:
        endpoint.take()
        gw.agent_turn(sid, "Remember that my cat is called Tom.")
        gw.agent_turn(sid, "And my dog is called Rex.")
        seen = chat_requests(endpoint.wait_for(lambda r: MEMORY_FLUSH_MARK in new_user_text(r)))
        gw.system_event(f"agent:main:explicit:{sid}", "Check whether the nightly build finished.")
        seen += chat_requests(endpoint.wait_for(lambda r: HEARTBEAT_MARK in new_user_text(r)))

        kinds = {(expected_turn_type(r), MEMORY_FLUSH_MARK in new_user_text(r),
                  HEARTBEAT_MARK in new_user_text(r)) for r in seen}
        assert {("main", False, False), ("side", True, False), ("side", False, True)} <= kinds, kinds
        for r in seen:
            assert r.session_headers == {"x-session-id": sid, "x-turn-type": expected_turn_type(r)}, \
                (r.session_headers, r.user_texts()[-2:])

        gw.agent_turn(sid, "/new")
        done = [r for r in chat_requests(endpoint.wait_for(lambda r: "x-session-done" in r.headers, timeout=60))
                if "x-session-done" in r.headers]
        assert [r.session_headers for r in done] == [
            {"x-session-id": sid, "x-turn-type": "side", "x-session-done": "1"}]
        assert done[0].headers["authorization"] == "Bearer test-key"
        assert done[0].body["model"] == MODEL and done[0].body["stream"] is False

        # OpenClaw reuses an explicit session id for the fresh conversation: tagged main, not done
        gw.agent_turn(sid, "Hello again.")
        fresh = [r for r in chat_requests(endpoint.take()) if expected_turn_type(r) == "main"]
        assert fresh and all(r.session_headers == {"x-session-id": sid, "x-turn-type": "main"} for r in fresh)
        assert not any("Tom" in t for t in fresh[-1].user_texts())
