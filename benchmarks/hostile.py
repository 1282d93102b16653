"""Hostile requests for the reliability campaign (issue 40, item 7): what a broken or malicious
client, or a web page in the user's browser, sends a local ``clawrl serve``.

Each case sends its request(s) and says whether the server handled them as issue 40 demands; after
every case a normal chat must still be answered (a case that kills the engine or wedges the event
loop is not handled, whatever its own reply). ``benchmarks/reliability.py --hostile`` runs them all
and ``tests/test_reliability_campaign.py`` runs the machinery.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlsplit

import httpx

CHAT = "/v1/chat/completions"
FOREIGN_ORIGIN = "http://attacker.example"
FOREIGN_HOST = "attacker.example"
BIG_MESSAGE_BYTES = 7 * 10 ** 6  # under server.max_body_bytes (8 MiB): it is read and tokenized
RESENDS = 6


def _chat(url: str, model: str, content: str = "What is 2+3?", timeout: float = 60, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return httpx.post(url + CHAT, json=body, timeout=timeout)


def _openai_error(r: httpx.Response) -> bool:
    """A 4xx whose body is OpenAI's error object."""
    try:
        error = r.json().get("error")
    except ValueError:
        return False
    return 400 <= r.status_code < 500 and isinstance(error, dict) and isinstance(error.get("message"), str)


def _refused_or_answered(r: httpx.Response) -> tuple[bool, str]:
    return (r.status_code == 200 or _openai_error(r)), f"{r.status_code} {r.text[:160]}"


def seed_overflow(url: str, model: str) -> tuple[bool, str]:
    """seed 2**63 - 1 with n=2: the second choice's seed (seed + 1) overflows a 64-bit integer."""
    return _refused_or_answered(_chat(url, model, seed=2 ** 63 - 1, n=2))


def _huge(param: str, value, **more):
    def case(url: str, model: str) -> tuple[bool, str]:
        started = time.monotonic()
        ok, detail = _refused_or_answered(_chat(url, model, **{param: value}, **more))
        return ok, f"{detail} in {time.monotonic() - started:.1f} s"
    case.__doc__ = f"{param}={value}: refused (4xx) or answered within the timeout, never run as asked"
    return case


def _body_of_type(content_type: str, data: bytes):
    def case(url: str, model: str) -> tuple[bool, str]:
        r = httpx.post(url + CHAT, content=data, headers={"Content-Type": content_type}, timeout=30)
        return r.status_code == 415 and _openai_error(r), f"{r.status_code} {r.text[:160]}"
    case.__doc__ = f"a {content_type} body (a cross-site form can send it without a preflight): 415"
    return case


def foreign_origin_pause(url: str, model: str) -> tuple[bool, str]:
    """POST /admin/pause from a web page of another origin: 403, and training is not paused."""
    r = httpx.post(url + "/admin/pause", headers={"Origin": FOREIGN_ORIGIN}, timeout=30)
    paused = httpx.get(url + "/admin/status", timeout=30).json()["training"]["paused"]
    if paused:
        httpx.post(url + "/admin/resume", timeout=30)
    return r.status_code == 403 and not paused, f"{r.status_code}, training paused afterwards: {paused}"


def foreign_host_sessions(url: str, model: str) -> tuple[bool, str]:
    """GET /admin/sessions with a Host that is not the server's (DNS rebinding): refused, no sessions."""
    r = httpx.get(url + "/admin/sessions", headers={"Host": FOREIGN_HOST}, timeout=30)
    return 400 <= r.status_code < 500 and "data" not in r.text, f"{r.status_code} {r.text[:160]}"


def disconnect_mid_body(url: str, model: str) -> tuple[bool, str]:
    """A client that announces 100 kB, sends 1 kB and hangs up: nothing is stored."""
    before = httpx.get(url + "/admin/status", timeout=30).json()["turns"]
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 100000\r\n\r\n".encode() + b'{"model": "' + b"x" * 1000)
    time.sleep(1.0)
    after = httpx.get(url + "/admin/status", timeout=30).json()["turns"]
    return after == before, f"turns stored {before} -> {after}"


def slash_session_id(url: str, model: str) -> tuple[bool, str]:
    """X-Session-Id 'a/b': refused, or stored and readable back under that very id."""
    sid = f"hostile/{uuid.uuid4().hex[:8]}"
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(url + CHAT, json=body, headers={"X-Session-Id": sid}, timeout=60)
    if r.status_code != 200:
        return _openai_error(r), f"{r.status_code} {r.text[:160]}"
    back = httpx.get(url + "/admin/sessions/" + quote(sid, safe=""), timeout=30)
    found = back.status_code == 200 and back.json().get("session_id") == sid
    return found, f"200; GET /admin/sessions/{quote(sid, safe='')}: {back.status_code}"


def big_message_beside_small_chat(url: str, model: str) -> tuple[bool, str]:
    """A 7 MB message that is one token-less word while a small chat runs: the small chat's delay
    stays within 3 s of its usual time (tokenizing must not hold the event loop)."""
    usual = min(_timed(url, model) for _ in range(3))
    big: dict = {}

    def send_big():
        try:
            big["r"] = _chat(url, model, content="a" * BIG_MESSAGE_BYTES, timeout=300)
        except httpx.HTTPError as e:
            big["error"] = repr(e)

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.5)  # the body is on its way and being read or tokenized
    beside = _timed(url, model)
    sender.join(300)
    r = big.get("r")
    big_ok = r is not None and (r.status_code == 200 or _openai_error(r))
    delay = beside - usual
    detail = (f"small chat {beside:.2f} s beside it (usual {usual:.2f} s, delay {delay:.2f} s); "
              f"the 7 MB message: {r.status_code if r is not None else big.get('error')}")
    return big_ok and delay <= 3.0, detail


def _timed(url: str, model: str) -> float:
    started = time.monotonic()
    r = _chat(url, model)
    if r.status_code != 200:
        raise RuntimeError(f"a small chat failed: {r.status_code} {r.text[:160]}")
    return time.monotonic() - started


def concurrent_resends(url: str, model: str) -> tuple[bool, str]:
    """The same first message sent 6 times at once in one session: one main-line turn, the rest are
    resends beside it (regenerates), never 6 parallel main lines."""
    sid = f"resend-{uuid.uuid4().hex[:8]}"
    body = {"model": model, "messages": [{"role": "user", "content": "Name a prime number."}], "max_tokens": 4}
    start = threading.Barrier(RESENDS)

    def send(_):
        start.wait()
        return httpx.post(url + CHAT, json=body, headers={"X-Session-Id": sid}, timeout=120).status_code

    with ThreadPoolExecutor(RESENDS) as pool:
        codes = list(pool.map(send, range(RESENDS)))
    turns = httpx.get(url + "/admin/sessions/" + quote(sid, safe=""), timeout=30).json().get("turns", [])
    main = sum(t["turn_type"] == "main" for t in turns)
    return main == 1 and all(c < 500 for c in codes), f"replies {codes}; main-line turns {main} of {len(turns)}"


CASES = {
    "seed overflow, n=2": seed_overflow,
    "top_k=10**12": _huge("top_k", 10 ** 12),
    "n=10**6": _huge("n", 10 ** 6),
    "top_logprobs=10**6": _huge("top_logprobs", 10 ** 6, logprobs=True),
    "max_tokens=10**12": _huge("max_tokens", 10 ** 12),
    "text/plain body": _body_of_type("text/plain", json.dumps({"model": "x", "messages": []}).encode()),
    "form body": _body_of_type("application/x-www-form-urlencoded", b"model=x&messages=hi"),
    "foreign Origin on /admin/pause": foreign_origin_pause,
    "foreign Host on /admin/sessions": foreign_host_sessions,
    "disconnect mid-body": disconnect_mid_body,
    "session id with '/'": slash_session_id,
    "7 MB one-word message beside a small chat": big_message_beside_small_chat,
    "6 identical resends at once": concurrent_resends,
}


def still_serving(url: str, model: str) -> str | None:
    """None when a normal chat is answered within 60 s, else why not."""
    try:
        r = _chat(url, model)
    except httpx.HTTPError as e:
        return f"a normal chat afterwards failed: {e!r}"
    return None if r.status_code == 200 else f"a normal chat afterwards got {r.status_code} {r.text[:160]}"


def run_cases(url: str, model: str, revive=None, progress=print) -> list[dict]:
    """Every case in turn; a case that raises, or after which the server stops serving, is not
    handled. ``revive()`` (kill and restart the server; returns its url) lets the later cases run."""
    rows = []
    for name, case in CASES.items():
        try:
            handled, detail = case(url, model)
        except Exception as e:  # a timeout or a dropped connection is the server failing the case
            handled, detail = False, f"{type(e).__name__}: {e}"
        if broken := still_serving(url, model):
            handled, detail = False, f"{detail}; {broken}"
            if revive is not None:
                url = revive()
        rows.append({"case": name, "demand": (case.__doc__ or "").split("\n")[0], "handled": handled,
                     "detail": detail})
        progress(f"hostile: {name}: {'handled' if handled else 'NOT handled'} ({detail})")
    return rows
