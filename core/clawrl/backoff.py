"""How a background loop (training, a signal worker) retries a step that keeps failing, and how
any part of the server reports a stretch of refused writes, without flooding the log.

A full disk is expected, not a bug: its stretch gets one WARNING when it starts (what pauses, and
why) and one INFO when a write succeeds again ("disk space is back ... resuming"); the attempts in
between are only counted. Any other error is a bug or a hiccup: the first one is logged with its
traceback, each later one of the same stretch in one line with the count. Either way the next try
waits twice as long as the last, from ``first_s`` up to ``max_s``, so a loop never spins on an error.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from clawrl.storage_faults import storage_fault

log = logging.getLogger(__name__)


class Backoff:
    """One loop's current stretch of failures. ``what`` names the loop in its log lines and
    ``pauses`` says what a full disk pauses, e.g. "checkpointing and training pause". With
    ``first_s=0`` it only reports (the gateway, which answers every request anyway)."""

    def __init__(self, what: str, pauses: str, first_s: float = 1.0, max_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.pauses, self.first_s, self.max_s, self.clock = what, pauses, first_s, max_s, clock
        self.failures = 0  # in the current stretch; 0: none
        self.since: Optional[float] = None
        self.fault: Optional[str] = None  # the storage fault of the current stretch, if it is one

    def delay_s(self) -> float:
        """Seconds to wait before the next try (0 outside a stretch)."""
        return 0.0 if not self.failures else min(self.max_s, self.first_s * 2 ** (self.failures - 1))

    def failed(self, e: BaseException) -> float:
        """Count a failure, log it as its stretch requires, and return the seconds to wait."""
        fault = storage_fault(e)
        if fault is not None and self.fault is None:
            if self.failures:  # a bug stretch turned into a disk stretch: a stretch of its own
                self.failures = 0
            self.fault = fault
        self.failures += 1
        if self.failures == 1:
            self.since = self.clock()
        delay = self.delay_s()
        if self.fault is not None:
            if self.failures == 1:
                retry = f" (retrying after {delay:g} s, then up to every {self.max_s:g} s)" if delay else ""
                log.warning("%s cannot write: %s; %s until it can%s", self.what, self.fault, self.pauses, retry)
        elif self.failures == 1:
            log.error("%s failed; retrying in %g s", self.what, delay, exc_info=e)
        else:
            log.error("%s failed again (%d times in %.0f s): %s: %s; retrying in %g s", self.what, self.failures,
                      self.clock() - self.since, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "",
                      delay)
        return delay

    def succeeded(self) -> None:
        """A try went through: end the stretch (and say so once)."""
        if not self.failures:
            return
        took = self.clock() - self.since
        if self.fault is not None:
            log.info("disk space is back: %s writes again after %.0f s (%d attempt(s) refused); resuming",
                     self.what, took, self.failures)
        else:
            log.info("%s works again after %d failure(s) in %.0f s", self.what, self.failures, took)
        self.failures, self.since, self.fault = 0, None, None
