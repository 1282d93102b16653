"""The ``TeacherGate``: moves each sample's teacher outcome from the ``opd_hints`` table into the
rollout buffer (``RolloutBuffer.resolve_opd``).

``scored`` lets a sample train with teacher logprobs; no hint or a failed teacher skips it when no
reward judge runs (``no_hint:<reason>``, ``teacher_failed:<reason>``) and leaves it to its reward
under Combine. With a ``wait_s`` (Combine's ``combine.opd_wait_s``) a rewarded sample whose teacher
outcome has not come after that many seconds (e.g. a slow teacher) is resolved as ``timeout`` and
trains RL-only; without one (OPD alone) a sample never trains without its teacher score.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from clawrl.buffer import RolloutBuffer
from clawrl.store import TurnStore
from clawrl.workers import PollingWorker

log = logging.getLogger(__name__)


class TeacherGate(PollingWorker):
    """Resolves samples from the ``opd_hints`` table (module docstring) on every poll (``poll_s``,
    or sooner after ``notify()``); it has no items of its own in flight."""

    name = "clawrl-teacher-gate"
    item_label = "sample"

    def __init__(self, buffer: RolloutBuffer, store: TurnStore, wait_s: Optional[float], poll_s: float = 0.5):
        if wait_s is not None and not wait_s > 0:
            raise ValueError(f"combine.opd_wait_s must be > 0, got {wait_s}")
        super().__init__(concurrency=1, poll_s=poll_s)
        self.buffer, self.store, self.wait_s = buffer, store, wait_s

    def resolve_now(self, now: Optional[float] = None) -> int:
        """Resolve every sample whose teacher outcome is in (and time out waiting rewarded samples
        when there is a ``wait_s``). Synchronous; returns how many samples were resolved."""
        now = time.time() if now is None else now
        if not self.buffer.readiness.reward:  # no reward judge creates (or relabel-skips) the samples
            self.buffer.sync()
            self.buffer.skip_relabelled_pending()
        rows = self.store.connection().execute(
            "SELECT s.sample_id, h.state, h.reason FROM samples s JOIN opd_hints h ON h.turn_id = s.turn_id "
            "WHERE s.opd_state IS NULL AND s.state IN ('pending', 'judged') "
            "AND h.state IN ('scored', 'rejected', 'failed') ORDER BY s.sample_id").fetchall()
        for sid, state, reason in rows:
            if state == "scored":
                self.buffer.resolve_opd(sid, "scored", now=now)
            else:
                why = f"no_hint:{reason}" if state == "rejected" else f"teacher_failed:{reason}"
                self.buffer.resolve_opd(sid, "none", why, now=now)
        timed_out = []
        if self.wait_s is not None:
            timed_out = [r[0] for r in self.store.connection().execute(
                "SELECT sample_id FROM samples WHERE state = 'judged' AND opd_state IS NULL AND rl_signal = 1 "
                "AND judged_at <= ? ORDER BY sample_id", (now - self.wait_s,))]
            for sid in timed_out:
                log.warning("sample %d: no teacher outcome within combine.opd_wait_s=%g s; it trains RL-only",
                            sid, self.wait_s)
                self.buffer.resolve_opd(sid, "timeout", now=now)
        return len(rows) + len(timed_out)

    async def _prepare(self) -> None:
        await asyncio.to_thread(self.resolve_now)

    async def _next_work(self, free: int, busy: list[int]) -> list:
        return []

    def _started_message(self) -> str:
        wait = "no timeout" if self.wait_s is None else f"rewarded samples train RL-only after {self.wait_s:g} s"
        return f"OPD teacher gate started: samples wait for their teacher outcome ({wait})"
