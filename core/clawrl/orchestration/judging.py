"""The reward judge beside serving: pending samples of the rollout buffer get a judge's verdict.

Binary RL and Combine (``clawrl.methods.rl``) run one ``JudgeWorker``; it lives here, not in the buffer,
so the buffer's state machine does not depend on the judges (``clawrl.judges``) that feed it.
"""
from __future__ import annotations

import asyncio
import logging

from clawrl.buffer import RolloutBuffer
from clawrl.config import JudgeConfig
from clawrl.judges.base import Judge, JudgeInput, Vote
from clawrl.workers import PollingWorker

log = logging.getLogger(__name__)


class JudgeWorker(PollingWorker):
    """Judges pending samples in the background, ``judge.concurrency`` at a time.

    Each call is bounded by ``judge.timeout_s`` and retried up to ``judge.retries`` times on a
    timeout, an exception or an all-garbage verdict; then the sample is skipped with the reason
    (``judge_timeout``, ``judge_error``, ``judge_garbage``). Every attempt's votes are stored.
    The polling loop (``start``, ``notify``, ``drain``, ``stop``) is ``clawrl.workers.PollingWorker``.
    """

    name = "judge worker"
    item_label = "sample"

    def __init__(self, buffer: RolloutBuffer, judge: Judge, judge_cfg: JudgeConfig, poll_s: float = 1.0):
        if judge_cfg.concurrency < 1:
            raise ValueError("judge.concurrency must be at least 1")
        if judge_cfg.timeout_s <= 0 or judge_cfg.retries < 0:
            raise ValueError("judge.timeout_s must be > 0 and judge.retries >= 0")
        super().__init__(judge_cfg.concurrency, poll_s)
        self.buffer, self.judge, self.judge_cfg = buffer, judge, judge_cfg

    def _started_message(self) -> str:
        return (f"judge worker started: {self.judge.kind} judge, {self.judge_cfg.concurrency} at a time, "
                f"timeout {self.judge_cfg.timeout_s:.0f} s, {self.judge_cfg.retries} retries")

    async def _prepare(self) -> None:
        await asyncio.to_thread(self.buffer.sync)

    async def _next_work(self, free: int, busy: list[int]):
        turns = await asyncio.to_thread(self.buffer.pending_turns, free, busy)
        return [(sid, self._judge_one(sid, JudgeInput.from_turn(turn))) for sid, turn in turns]

    async def _judge_one(self, sample_id: int, item: JudgeInput) -> None:
        tried: list[tuple[int, Vote]] = []
        reason = "judge_error"
        for attempt in range(1, self.judge_cfg.retries + 2):
            try:
                verdict = await asyncio.wait_for(self.judge.judge(item), self.judge_cfg.timeout_s)
            except asyncio.TimeoutError:
                reason = "judge_timeout"
                tried.append((attempt, Vote(None, f"timeout: no verdict within {self.judge_cfg.timeout_s:g} s", "")))
                log.warning("judging sample %d timed out (attempt %d)", sample_id, attempt)
                continue
            except Exception as e:
                reason = "judge_error"
                tried.append((attempt, Vote(None, f"error: {type(e).__name__}: {str(e)[:300]}", "")))
                log.warning("judging sample %d failed (attempt %d): %s", sample_id, attempt, e)
                continue
            if verdict.garbage:
                reason = "judge_garbage"
                tried += [(attempt, v) for v in verdict.votes]
                log.warning("judge answered garbage for sample %d (attempt %d)", sample_id, attempt)
                continue
            await asyncio.to_thread(self.buffer.record_verdict, sample_id, verdict, attempt, tried)
            self.finished += 1
            return
        await asyncio.to_thread(self.buffer.record_failure, sample_id, reason, self.judge.kind, tried)
        self.finished += 1
