"""Per-caller rate limits on /v1: requests and tokens per minute, refused with 429 and Retry-After.

A caller is one of ``server.api_key``'s keys (each key is its own caller, as in session linking);
without keys, the server answers loopback only and its callers share one allowance. Each limit is
a token bucket holding a minute's worth and refilling continuously, so a caller may burst up to
its limit and then runs at the limit's rate, and the refusal can say exactly when to come back.

Tokens are charged before generation, when the cost is not yet known: a chat request reserves its
prompt plus ``n * max_tokens`` (after the clamp to the context left) and, once it ends, gets back
what it did not generate. That is how a burst of long requests is stopped before it reaches the
engine rather than after. A single request larger than the whole per-minute allowance could never
pass, so it gets a 400 that says so, not a 429 that a client would retry forever.

Refusals are logged once per caller until that caller is admitted again (a limited client retrying
in a loop does not flood the log), naming the caller by its position in ``server.api_key``, never
by the key.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

from clawrl.config import RateLimitConfig
from clawrl.gateway.protocol import ApiError

log = logging.getLogger(__name__)

SECONDS_PER_MINUTE = 60.0


class TokenBucket:
    """``per_minute`` units, refilled at ``per_minute / 60`` a second, never above ``per_minute``."""

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / SECONDS_PER_MINUTE
        self.level = self.capacity
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units are there (0: now)."""
        self._refill(now)
        return max(0.0, (cost - self.level) / self.rate)

    def take(self, cost: float) -> None:
        self.level -= cost

    def give(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


class Reservation:
    """Tokens a request holds against its caller's allowance until ``settle`` returns the unused."""

    def __init__(self, limiter: Optional["RateLimiter"], caller: Optional[str], reserved: int):
        self._limiter, self.caller, self.reserved = limiter, caller, reserved
        self._settled = False

    def settle(self, used: int) -> None:
        """Give back ``reserved - used`` tokens (once; later calls do nothing)."""
        if self._settled:
            return
        self._settled = True
        if self._limiter is not None and used < self.reserved:
            self._limiter.refund(self.caller, self.reserved - used)


class RateLimiter:
    """The buckets of every caller, made on first use (callers are bounded: the configured keys,
    or the one keyless caller)."""

    def __init__(self, cfg: RateLimitConfig, keys: list[str], clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self._position = {k: i + 1 for i, k in enumerate(keys)}
        self._requests: dict[Optional[str], TokenBucket] = {}
        self._tokens: dict[Optional[str], TokenBucket] = {}
        self._limited: set[tuple[Optional[str], str]] = set()  # (caller, what) refused since last admitted
        limits = [f"{v} {what} per minute" for v, what in ((cfg.requests_per_minute, "requests"),
                                                             (cfg.tokens_per_minute, "tokens")) if v]
        if limits:
            log.info("rate limits per caller: %s", ", ".join(limits))

    def _who(self, caller: Optional[str]) -> str:
        return f"caller {self._position[caller]} of server.api_key" if caller in self._position else \
            "the keyless loopback caller"

    def _bucket(self, table: dict, caller: Optional[str], per_minute: int) -> TokenBucket:
        bucket = table.get(caller)
        if bucket is None:
            bucket = table[caller] = TokenBucket(per_minute, self.clock())
        return bucket

    def _refuse(self, caller: Optional[str], what: str, wait_s: float, limit: int) -> ApiError:
        retry = max(1, math.ceil(wait_s))
        if (caller, what) not in self._limited:
            self._limited.add((caller, what))
            log.warning("rate limit: %s is over %d %s per minute; answering 429 (retry after %d s) until it "
                        "is under again", self._who(caller), limit, what, retry)
        return ApiError(429, f"rate limit reached: {limit} {what} per minute for this API key; retry after "
                        f"{retry} s", type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(retry)})

    def _admitted(self, caller: Optional[str], what: str) -> None:
        if (caller, what) in self._limited:
            self._limited.discard((caller, what))
            log.info("rate limit: %s is admitted again (%s)", self._who(caller), what)

    def check_request(self, caller: Optional[str]) -> None:
        """Count one request against ``caller``'s requests per minute; 429 when none is left."""
        limit = self.cfg.requests_per_minute
        if not limit:
            return
        bucket = self._bucket(self._requests, caller, limit)
        wait = bucket.wait_s(1, self.clock())
        if wait > 0:
            raise self._refuse(caller, "requests", wait, limit)
        bucket.take(1)
        self._admitted(caller, "requests")

    def reserve(self, caller: Optional[str], tokens: int) -> Reservation:
        """Hold ``tokens`` of ``caller``'s tokens per minute for one request: 429 while they are
        not there yet, 400 when they never can be."""
        limit = self.cfg.tokens_per_minute
        if not limit:
            return Reservation(None, caller, tokens)
        if tokens > limit:
            raise ApiError(400, f"this request needs up to {tokens} tokens (its prompt plus n * max_tokens), "
                           f"more than this API key's {limit} tokens per minute; lower max_tokens or shorten "
                           "the prompt", param="max_tokens", code="rate_limit_request_too_large")
        bucket = self._bucket(self._tokens, caller, limit)
        wait = bucket.wait_s(tokens, self.clock())
        if wait > 0:
            raise self._refuse(caller, "tokens", wait, limit)
        bucket.take(tokens)
        self._admitted(caller, "tokens")
        return Reservation(self, caller, tokens)

    def refund(self, caller: Optional[str], tokens: int) -> None:
        bucket = self._tokens.get(caller)
        if bucket is not None:
            bucket.give(tokens, self.clock())
