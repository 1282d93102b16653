"""The gateway under concurrency, on a live uvicorn server with the real TorchEngine: the event
loop stays responsive while a huge prompt is rendered, and identical requests sent at once are
linked as if sent one by one (one main turn, the rest regenerates)."""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from clawrl.config import compose
from clawrl.engines.torch_engine import TorchEngine
from clawrl.gateway.app import create_app
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import ServerThread, build_tiny_model, load_tiny, model_cache_dir

SMALL = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_model(model_cache_dir())
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose([f"run_dir={run_dir}", "engine.threads=1"])
    engine = TorchEngine(load_tiny(path), cfg.engine)
    store = TurnStore(run_dir)
    app = create_app(cfg, engine, SessionLinker(store, cfg.sessions.idle_timeout_s))
    with ServerThread(app) as srv:
        srv.store = store
        yield srv


def post(server, body, headers=None):
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def small_chat_latency(server, pool: ThreadPoolExecutor, n: int = 3) -> float:
    """Median latency of ``n`` small chats sent at once (all wait if the loop is blocked)."""
    def one(_):
        t = time.perf_counter()
        assert post(server, SMALL).status_code == 200
        return time.perf_counter() - t
    return statistics.median(pool.map(one, range(n)))


def test_a_7mb_message_does_not_delay_a_concurrent_small_chat(server):
    with ThreadPoolExecutor(3) as pool:
        small_chat_latency(server, pool)  # warm up
        baseline = statistics.median(small_chat_latency(server, pool) for _ in range(3))
        big = {**SMALL, "messages": [{"role": "user", "content": "x" * 7_000_000}]}
        answer = []
        sender = threading.Thread(target=lambda: answer.append(post(server, big)))
        sender.start()
        time.sleep(1.0)  # the upload is in and rendering has begun (it takes seconds)
        loaded = small_chat_latency(server, pool)
        overlapped = sender.is_alive()
        sender.join()
    assert answer[0].status_code == 400 and answer[0].json()["error"]["code"] == "context_length_exceeded"
    print(f"small chat: {baseline * 1000:.0f} ms alone, {loaded * 1000:.0f} ms beside a 7 MB message")
    assert loaded - baseline < 0.1
    assert overlapped, "the big request finished before the small chats: nothing was measured"


def session_turn_types(server, answers) -> list[str]:
    """The turn types stored for ``answers`` (all in one session), main first."""
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    sessions = {a.headers["X-Session-Id"] for a in answers}
    assert len(sessions) == 1, sessions
    return sorted((t["turn_type"], t["link_rule"]) for t in server.store.get_session(sessions.pop())["turns"])


@pytest.mark.parametrize("opening", [True, False], ids=["opening", "follow_up"])
def test_concurrent_identical_requests_link_as_sequential_ones(server, opening):
    def body(tag):
        first = {**SMALL, "messages": [{"role": "user", "content": f"race {tag}"}]}
        if opening:
            return first
        reply = post(server, first).json()["choices"][0]["message"]["content"]  # a stored parent
        return {**SMALL, "messages": [*first["messages"], {"role": "assistant", "content": reply},
                                      {"role": "user", "content": "again"}]}

    one_by_one, at_once = body(f"one by one {opening}"), body(f"at once {opening}")
    sequential = [post(server, one_by_one) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda _: post(server, at_once), range(8)))
    expected = session_turn_types(server, sequential)
    assert [t for t, _ in expected].count("main") == (1 if opening else 2)  # a follow-up: its opening too
    assert session_turn_types(server, concurrent) == expected
