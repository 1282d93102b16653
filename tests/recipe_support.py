"""Helpers for tests that launch a method's ``run.sh`` and drive it like a user."""
from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import httpx


def wait_until(check, procs: list[subprocess.Popen], logs: list[Path], timeout: float):
    """``check()``'s first truthy value, polled while every process in ``procs`` still runs (a
    server that is not up yet, ``httpx.TransportError``, counts as not yet). Fails with the
    logs' tails when a process exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        for p, log in zip(procs, logs):
            assert p.poll() is None, f"exited with {p.returncode}:\n{log.read_text()[-4000:]}"
        try:
            value = check()
            if value:
                return value
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "\n".join(log.read_text()[-3000:] for log in logs)
        time.sleep(0.2)


def process_environ(pid: int) -> dict[str, str]:
    """The environment a process was started with (``/proc/<pid>/environ``)."""
    return dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)


def ask_then_reply(client, model: str, question: str, feedback: str) -> None:
    """One session through an OpenAI client: a question, then the user's feedback as the next
    state, closing the session (``X-Session-Done``) so the turn is judged at once."""
    session = {"X-Session-Id": uuid.uuid4().hex}
    asked = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(model=model, messages=asked, max_tokens=12,
                                           extra_headers=session).choices[0].message.content
    client.chat.completions.create(
        model=model, max_tokens=1, extra_headers={**session, "X-Session-Done": "1"},
        messages=asked + [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}])
