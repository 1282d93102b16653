"""Per-caller rate limits (issue 20, item 4): requests and tokens per minute per API key, answered
with 429 in OpenAI's format and a Retry-After that is the actual wait, logged once per episode of
limiting and never with the key. The bucket arithmetic runs on a fake clock; the HTTP behaviour
against a live server with the real engine and the OpenAI client."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest

from clawrl.config import ConfigError, RateLimitConfig, compose
from clawrl.gateway.app import create_app
from clawrl.gateway.protocol import ApiError
from clawrl.gateway.rate_limits import RateLimiter
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import ServerThread, build_tiny_model, load_tiny, make_controlled_engine, model_cache_dir

KEYS = ["key-alpha-1234567890", "key-beta-0987654321"]
HI = [{"role": "user", "content": "Hi"}]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def limiter(clock, **limits) -> RateLimiter:
    return RateLimiter(RateLimitConfig(**limits), KEYS, clock)


def test_requests_per_minute_refill_continuously_and_each_key_has_its_own(caplog):
    clock = Clock()
    rl = limiter(clock, requests_per_minute=3)
    with caplog.at_level(logging.INFO, logger="clawrl.gateway.rate_limits"):
        for _ in range(3):
            rl.check_request(KEYS[0])
        with pytest.raises(ApiError) as e:
            rl.check_request(KEYS[0])
        assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
        assert e.value.type == "rate_limit_error"
        assert e.value.headers["Retry-After"] == "20"  # one request comes back every 60/3 s
        rl.check_request(KEYS[1])  # the other key is untouched
        clock.t += 19.0
        with pytest.raises(ApiError) as e:
            rl.check_request(KEYS[0])
        assert e.value.headers["Retry-After"] == "1"
        clock.t += 1.0
        rl.check_request(KEYS[0])
        with pytest.raises(ApiError):
            rl.check_request(KEYS[0])
        clock.t += 3600  # a long pause refills to the limit, not beyond it
        for _ in range(3):
            rl.check_request(KEYS[0])
        with pytest.raises(ApiError):
            rl.check_request(KEYS[0])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one warning per stretch of refusals (three stretches), naming the caller by position only
    assert len(warnings) == 3 and all("caller 1 of server.api_key" in w for w in warnings), warnings
    assert not any(k in caplog.text for k in KEYS)


def test_keyless_server_limits_its_callers_together():
    clock = Clock()
    rl = RateLimiter(RateLimitConfig(requests_per_minute=1), [], clock)
    rl.check_request(None)
    with pytest.raises(ApiError) as e:
        rl.check_request(None)
    assert e.value.headers["Retry-After"] == "60"


def test_tokens_are_reserved_up_front_and_the_unused_part_comes_back():
    clock = Clock()
    rl = limiter(clock, tokens_per_minute=600)  # 10 tokens a second
    first = rl.reserve(KEYS[0], 500)
    with pytest.raises(ApiError) as e:
        rl.reserve(KEYS[0], 200)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "10"  # 100 short at 10/s
    first.settle(120)  # generated far less than it reserved: 380 come back
    first.settle(0)  # settling twice gives nothing more
    second = rl.reserve(KEYS[0], 480)
    with pytest.raises(ApiError):
        rl.reserve(KEYS[0], 1)
    second.settle(480)  # used everything: nothing comes back
    with pytest.raises(ApiError):
        rl.reserve(KEYS[0], 1)
    with pytest.raises(ApiError) as e:
        rl.reserve(KEYS[1], 601)  # more than a whole minute's allowance: retrying cannot help
    assert e.value.status == 400 and e.value.code == "rate_limit_request_too_large"
    assert e.value.param == "max_tokens"


def test_no_limits_by_default_and_zero_is_refused():
    rl = RateLimiter(compose([]).server.rate_limit, KEYS)
    for _ in range(1000):
        rl.check_request(KEYS[0])
    rl.reserve(KEYS[0], 10 ** 9).settle(0)
    with pytest.raises(ConfigError, match="requests_per_minute"):
        compose(["server.rate_limit.requests_per_minute=0"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_model(model_cache_dir())
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose([f"run_dir={run_dir}", f"server.api_key='{','.join(KEYS)}'", "engine.threads=1",
                   "server.rate_limit.requests_per_minute=3", "server.rate_limit.tokens_per_minute=1000"])
    engine = make_controlled_engine(load_tiny(path), cfg.engine)
    app = create_app(cfg, engine, SessionLinker(TurnStore(run_dir), cfg.sessions.idle_timeout_s))
    with ServerThread(app) as srv:
        yield srv


def post(server, key, **body):
    return httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "messages": HI, **body}, timeout=60)


def test_live_server_answers_429_with_retry_after_per_key_and_the_openai_client_sees_it(server):
    # KEYS[0]: a request too large for the whole token allowance is a 400, and still counts as a request
    r = post(server, KEYS[0], max_tokens=1500)
    assert r.status_code == 400 and r.json()["error"]["code"] == "rate_limit_request_too_large"
    r = post(server, KEYS[0], max_tokens=8)
    assert r.status_code == 200, r.text
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 200  # the third request of the minute
    r = post(server, KEYS[0], max_tokens=8)
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 20 and "requests per minute" in err["message"]

    # KEYS[1] has its own allowance. Tokens: a request reserves prompt + max_tokens and gets back
    # what it did not generate, which the third request below needs
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0)
    long = [{"role": "user", "content": "Hi " * 20}]
    out = client.chat.completions.create(model="tiny", messages=long, max_tokens=600)
    assert out.choices[0].finish_reason == "stop"
    prompt, used = out.usage.prompt_tokens, out.usage.prompt_tokens + out.usage.completion_tokens
    assert 20 < prompt and out.usage.completion_tokens < 450, (prompt, used)
    r = post(server, KEYS[1], messages=long, max_tokens=1000 - prompt)  # the whole allowance: not there
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
    # Without the refund, 1000 - (prompt + 600) would be left: less than this reserves by 590 - completion
    out = client.chat.completions.create(model="tiny", messages=long, max_tokens=990 - prompt - used)
    assert out.choices[0].message.content
    with pytest.raises(openai.RateLimitError, match="requests per minute"):
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=8)  # its 4th request
