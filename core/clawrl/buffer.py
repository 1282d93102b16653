"""The rollout buffer: turns become judged, trainable samples, each trained exactly once.

Lifecycle of a sample (table ``samples`` in the turn store's SQLite file)::

    pending -> judged -> ready -> consumed -> trained
        \\________\\_______\\_________\\-----> skipped (with a reason)

- **pending**: created by :meth:`RolloutBuffer.sync` for every *closed* turn. A turn that is not a
  main, complete, trainable turn closed with a next state is created directly as skipped with
  its reason: ``side_turn``, ``excluded`` (admin), ``untrainable:<reason>`` (aborted, error,
  secret_redacted, empty_response), ``no_next_state`` (closed by session end or idle timeout).
  So no turn disappears: each ends trained, or skipped with a recorded reason.
- **judged**: a reward judge (``clawrl.orchestration.judging.JudgeWorker``) stored a verdict
  (reward = its score, every vote in table ``votes``). Garbage, timeouts and judge errors, after
  ``judge.retries`` retries, skip the sample (``judge_garbage``, ``judge_timeout``, ``judge_error``). A verdict *without signal* (the rules
  judge saw no explicit feedback, no environment verdict applied) is skipped as ``no_signal``:
  its 0 means "unknown", and training on it as a neutral reward would teach the policy that
  unremarked replies are average -- while under the default ``train.baseline=reward`` it would
  produce a zero advantage and train nothing anyway. A judge model's considered 0 is kept.
- **ready**: the advantage is set. Samples of one prompt (same prompt ids, e.g. ``n > 1``
  choices of one request) form a GRPO group, normalised with ``train.group_advantage``; a group
  waits until every turn of that request is closed and judged. A live-chat turn (group of one)
  gets ``reward`` (``train.baseline=reward``) or ``reward - EMA`` (``train.baseline=ema``, decay
  ``train.baseline_decay``, the EMA state kept in the store so it survives restarts) -- never a
  normalised group of one, which would always be 0.
- **consumed**: handed to the trainer by :meth:`RolloutBuffer.take_batch` (one transaction, so
  two takers -- threads or processes -- never get the same sample). At take time an admin
  relabel (excluded, side) skips the sample, and staleness is applied: the lag is the most
  optimizer updates between a token's weight version and the current one along the run's lineage
  (``clawrl.weight_lineage``: a restart that re-serves older weights under a new version number
  adds no lag of its own); beyond ``train.max_weight_lag`` a sample
  is skipped as ``stale`` (``stale_policy=drop``) or kept (``importance_weight``: the trainer's
  truncated importance sampling uses the exact per-token rollout logprobs).
- **trained**: :meth:`RolloutBuffer.mark_trained` after the optimiser step, with the step and the
  new weight version. After a restart from a checkpoint at step S,
  :meth:`RolloutBuffer.requeue_after_restore` returns consumed samples and samples trained in
  steps after S to ready, so each sample trains exactly once in the surviving model lineage.

Use (the orchestrator)::

    buffer = RolloutBuffer(store, cfg.train, method.readiness)
    buffer.requeue_after_restore(step)                      # at start-up, after loading checkpoint `step`
    worker = JudgeWorker(buffer, make_judge(cfg.judge, judge_engine), cfg.judge)  # clawrl.orchestration.judging
    worker.start()                                          # an asyncio task; worker.notify() wakes it
    if buffer.ready_count() >= cfg.train.batch_size:
        batch = await asyncio.to_thread(buffer.take_batch, cfg.train.batch_size, engine_weight_version)
        ... train on batch (list[clawrl.samples.Sample]) ...
        buffer.mark_trained([s.sample_id for s in batch], train_step, new_weight_version)
    buffer.counts()                                         # for /admin/status

Which signals a sample waits for is the method's readiness rule (:class:`Readiness`, from
``Method.readiness`` in ``clawrl.methods``): a reward judge's verdict, a teacher outcome, or both.
On-policy distillation (``method=opd|combine``) adds the teacher's score of a turn
(``clawrl.methods.opd``), resolved per sample with :meth:`RolloutBuffer.resolve_opd` (``opd_state``:
``scored``, ``none`` -- no hint or the teacher failed --, or ``timeout``). With ``Readiness.teacher`` a
judged sample is promoted to ready only once its OPD is resolved, so a sample never trains without a
teacher score that is still coming. Without ``Readiness.reward`` (``method=opd``) no reward judge runs:
a pending sample with a teacher score becomes ready (``rl_signal=0``, advantage 0), one without is
skipped as ``no_hint:<reason>`` / ``teacher_failed:<reason>``. With both (``combine``) a verdict without
signal is kept (``rl_signal=0``) while its hint may still train it, and skipped as ``no_signal`` once
the teacher has nothing either; a sample with a reward whose teacher score has not come after
``combine.opd_wait_s`` is resolved as ``timeout`` and trains RL-only (the caller decides the timeout).
Samples without a reward signal take no part in group statistics or the EMA baseline.

The buffer stores what a judge decided without depending on the judges: a verdict is anything shaped
like ``clawrl.judges.base.Verdict`` (:class:`VerdictRecord`).

The buffer's tables are declared, with their own version, in ``clawrl.schema`` (the one owner of the
store's schema and migrations) and brought up to date when a buffer opens the store.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Protocol, Sequence

import torch

from clawrl.config import TrainConfig
from clawrl.losses import GROUP_MODES, RunningBaseline, group_advantages
from clawrl.samples import Sample
from clawrl.step_size import step_size
from clawrl.schema import BUFFER
from clawrl.store import TurnStore, load_messages, load_prompt, unpack
from clawrl.weight_lineage import lag_counter

log = logging.getLogger(__name__)

STATES = ("pending", "judged", "ready", "consumed", "trained", "skipped")
STALE_POLICIES = ("drop", "importance_weight")
BASELINES = ("reward", "ema")

OPD_OUTCOMES = ("scored", "none", "timeout")
_META_SCAN = "buffer_scan_from"  # every turn below this id is closed and has its sample
_META_BASELINE = "buffer_baseline"


@dataclass(frozen=True)
class Readiness:
    """Which signals a sample waits for before it is ready: a method's rule (``Method.readiness``).

    ``reward``: a reward judge scores every pending sample (``record_verdict``/``record_failure``);
    without one, a sample leaves pending only through its teacher outcome. ``teacher``: a judged sample
    is promoted only once its teacher outcome is in (``resolve_opd``), and a sample without a reward
    signal is kept while its teacher may still train it.
    """

    reward: bool = True
    teacher: bool = False

    def __post_init__(self):
        if not (self.reward or self.teacher):
            raise ValueError("a rollout buffer needs a reward judge, an OPD teacher, or both")


class VoteRecord(Protocol):
    """One judge vote as the ``votes`` table keeps it (``clawrl.judges.base.Vote``)."""

    score: Optional[int]
    rationale: str
    raw: str


class VerdictRecord(Protocol):
    """A judge's verdict as the buffer stores it (``clawrl.judges.base.Verdict``)."""

    score: int
    votes: list
    kind: str
    signal: bool
    rationale: str


def turn_skip_reason(turn_type: str, trainable: int, untrainable_reason: Optional[str],
                     close_reason: Optional[str]) -> Optional[str]:
    """Why a closed turn cannot be a training sample, or None if it can."""
    if turn_type == "side":
        return "side_turn"
    if untrainable_reason == "excluded_by_admin":
        return "excluded"
    if not trainable:
        return f"untrainable:{untrainable_reason}"
    if close_reason != "next_state":
        return "no_next_state"
    return None


def _group_id(prompt_blob: Optional[bytes], turn_id: int) -> str:
    if prompt_blob is None:  # stored without tokens (secret): never trains, a group of its own
        return f"turn-{turn_id}"
    return hashlib.sha256(prompt_blob).hexdigest()[:24]


class RolloutBuffer:
    """Samples on the turn store (see the module docstring). Methods are synchronous SQLite
    transactions; from the event loop call them with ``asyncio.to_thread``."""

    def __init__(self, store: TurnStore, train: TrainConfig, readiness: Readiness = Readiness()):
        if train.stale_policy not in STALE_POLICIES:
            raise ValueError(f"train.stale_policy must be one of {', '.join(STALE_POLICIES)}, not {train.stale_policy!r}")
        if train.baseline not in BASELINES:
            raise ValueError(f"train.baseline must be one of {', '.join(BASELINES)}, not {train.baseline!r}")
        if train.group_advantage not in GROUP_MODES:
            raise ValueError(f"train.group_advantage must be one of {', '.join(GROUP_MODES)}, "
                             f"not {train.group_advantage!r}")
        if train.max_weight_lag < 0:
            raise ValueError("train.max_weight_lag must be >= 0")
        self.store = store
        self.train = train
        self.readiness = readiness
        self._migrate()

    # --- schema --------------------------------------------------------------------------------

    def _migrate(self) -> None:
        self.store.register(BUFFER)

    @staticmethod
    def _meta(c, key: str) -> Optional[str]:
        row = c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    @staticmethod
    def _set_meta(c, key: str, value: str) -> None:
        c.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                  (key, value))

    # --- creating samples ----------------------------------------------------------------------

    def sync(self, now: Optional[float] = None) -> int:
        """Create a sample for every newly closed turn and promote groups that became complete.

        Returns how many samples were created. Cheap to call often: it scans only from the oldest
        turn that was still open last time.
        """
        now = time.time() if now is None else now
        if not self._sync_needed():
            return 0
        skipped = []
        with self.store.transaction() as c:
            scan_from = int(self._meta(c, _META_SCAN) or 0)
            rows = c.execute(
                "SELECT turn_id, turn_type, trainable, untrainable_reason, close_reason, prompt_ids, prompt_blobs, "
                "request_key FROM turns t WHERE turn_id >= ? AND close_reason IS NOT NULL "
                "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.turn_id = t.turn_id) ORDER BY turn_id",
                (scan_from,),
            ).fetchall()
            for turn_id, turn_type, trainable, reason, close_reason, inline, chunks, request_key in rows:
                skip = turn_skip_reason(turn_type, trainable, reason, close_reason)
                prompt_blob = load_prompt(c, inline, chunks)
                c.execute(
                    "INSERT INTO samples (source, source_id, turn_id, group_id, request_key, state, skip_reason, "
                    "created_at, done_at) VALUES ('turn', ?, ?, ?, ?, ?, ?, ?, ?)",
                    (turn_id, turn_id, _group_id(prompt_blob, turn_id), request_key, "skipped" if skip else "pending",
                     skip, now, now if skip else None),
                )
                if skip:
                    skipped.append((turn_id, skip, close_reason))
            low = c.execute(
                "SELECT COALESCE((SELECT MIN(turn_id) FROM turns WHERE close_reason IS NULL AND turn_id >= ?), "
                "(SELECT MAX(turn_id) + 1 FROM turns), ?)",
                (scan_from, scan_from),
            ).fetchone()[0]
            if low != scan_from:
                self._set_meta(c, _META_SCAN, str(low))
            ready = self._promote(c, now)
        for turn_id, reason, close_reason in skipped:
            log.info("turn %d skipped: %s (closed by %s)", turn_id, reason, close_reason)
        self._log_ready(ready)
        if rows:
            log.info("%d new sample(s): %d pending, %d skipped", len(rows), len(rows) - len(skipped), len(skipped))
        return len(rows)

    def _sync_needed(self) -> bool:
        """Whether a closed turn lacks its sample or a judged sample waits: a read, so idle polling
        never takes the write lock the gateway records turns under."""
        c = self.store.connection()
        scan_from = int(self._meta(c, _META_SCAN) or 0)
        return c.execute(
            "SELECT EXISTS (SELECT 1 FROM turns t WHERE turn_id >= ? AND close_reason IS NOT NULL "
            "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.turn_id = t.turn_id)) "
            "OR EXISTS (SELECT 1 FROM samples WHERE state = 'judged')",
            (scan_from,),
        ).fetchone()[0] == 1

    def skipped_between(self, start: float, end: float) -> list[tuple[str, str]]:
        """(origin, reason) of samples skipped in the time window (start, end], in sample order; the
        origin as ``Sample.origin`` words it ("turn 12", "episode 3")."""
        rows = self.store.connection().execute(
            "SELECT source, source_id, skip_reason FROM samples WHERE state = 'skipped' AND done_at > ? "
            "AND done_at <= ? ORDER BY sample_id", (start, end))
        return [(f"{source} {sid}", why) for source, sid, why in rows]

    def add_ready(self, c, group_id: str, entries: Sequence[tuple[str, int, float, float]], now: float) -> list[int]:
        """Inside the caller's transaction ``c``: samples that are born ready, as an environment's are
        (its verdict is the reward, its group's advantages already computed: ``clawrl.episode_store``).
        ``entries``: (source, source_id, reward, advantage). Returns the new sample ids; a source that
        already has its sample is refused by the table (UNIQUE), so nothing trains twice."""
        ids = []
        for source, source_id, reward, advantage in entries:
            cur = c.execute("INSERT INTO samples (source, source_id, group_id, state, judge_kind, verdict, reward, "
                            "advantage, created_at, judged_at) VALUES (?, ?, ?, 'ready', 'env', NULL, ?, ?, ?, ?)",
                            (source, source_id, group_id, reward, advantage, now, now))
            ids.append(cur.lastrowid)
        return ids

    def judged_count(self) -> int:
        """Samples that have at least one stored vote."""
        return self.store.connection().execute("SELECT COUNT(DISTINCT sample_id) FROM votes").fetchone()[0]

    def ready_count(self) -> int:
        """How many samples wait for the trainer (it starts a step at ``train.batch_size``)."""
        return self.store.connection().execute("SELECT COUNT(*) FROM samples WHERE state = 'ready'").fetchone()[0]

    # --- judging -------------------------------------------------------------------------------

    def pending_turns(self, limit: int, exclude: Iterable[int] = ()) -> list[tuple[int, dict]]:
        """Up to ``limit`` pending samples (oldest first, not in ``exclude``) with the stored turn a
        judge reads (``JudgeInput.from_turn``). A sample whose turn was relabelled (excluded, side)
        since is skipped here instead."""
        exclude = set(exclude)
        out, relabelled = [], []
        rows = self.store.connection().execute(
            "SELECT s.sample_id, t.turn_id, t.turn_type, t.trainable, t.untrainable_reason, t.close_reason, "
            "t.messages, t.message_blobs, t.history_len, t.response_text, t.tool_calls, t.next_state FROM samples s "
            "JOIN turns t ON t.turn_id = s.turn_id "
            "WHERE s.state = 'pending' ORDER BY s.sample_id"
        )
        for (sid, turn_id, turn_type, trainable, reason, close_reason, messages, message_blobs, hist_len, text, calls,
             next_state) in rows:
            if sid in exclude:
                continue
            skip = turn_skip_reason(turn_type, trainable, reason, close_reason)
            if skip:
                relabelled.append((sid, skip))
                continue
            out.append((sid, {
                "turn_id": turn_id, "messages": load_messages(self.store.connection(), messages, message_blobs),
                "history_len": hist_len, "response_text": text,
                "tool_calls": json.loads(calls) if calls else None, "next_state": json.loads(next_state),
            }))
            if len(out) >= limit:
                break
        for sid, reason in relabelled:
            self._skip_if_open(sid, reason)
        return out

    def skip_relabelled_pending(self) -> int:
        """Skip pending samples whose turn was relabelled (excluded, side) since they were created;
        without a reward judge (``method=opd``) nothing else looks at them, and no teacher will."""
        rows = self.store.connection().execute(
            "SELECT s.sample_id, t.turn_type, t.trainable, t.untrainable_reason, t.close_reason FROM samples s "
            "JOIN turns t ON t.turn_id = s.turn_id WHERE s.state = 'pending' AND "
            "(t.turn_type != 'main' OR t.trainable = 0)").fetchall()
        for sid, turn_type, trainable, reason, close_reason in rows:
            self._skip_if_open(sid, turn_skip_reason(turn_type, trainable, reason, close_reason))
        return len(rows)

    def _skip_if_open(self, sample_id: int, reason: str) -> None:
        with self.store.transaction() as c:
            n = c.execute("UPDATE samples SET state = 'skipped', skip_reason = ?, done_at = ? "
                          "WHERE sample_id = ? AND state IN ('pending', 'judged', 'ready')",
                          (reason, time.time(), sample_id)).rowcount
        if n:
            log.info("sample %d skipped: %s (relabelled after sampling)", sample_id, reason)

    @staticmethod
    def _insert_votes(c, sample_id: int, kind: str, votes: Sequence[tuple[int, VoteRecord]], now: float) -> None:
        for i, (attempt, v) in enumerate(votes):
            c.execute(
                "INSERT INTO votes (sample_id, attempt, vote_index, judge_kind, score, rationale, raw, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (sample_id, attempt, i, kind, v.score, v.rationale, v.raw, now),
            )

    def record_verdict(self, sample_id: int, verdict: VerdictRecord, attempt: int = 1,
                       earlier: Sequence[tuple[int, VoteRecord]] = (), now: Optional[float] = None) -> str:
        """Store a verdict reached on ``attempt``, its votes and the (attempt, vote) pairs of earlier
        failed attempts. Returns the sample's new state (ready, judged, or skipped as no_signal)."""
        now = time.time() if now is None else now
        all_votes = list(earlier) + [(attempt, v) for v in verdict.votes]
        with self.store.transaction() as c:
            self._insert_votes(c, sample_id, verdict.kind, all_votes, now)
            # under OPD a verdict without signal waits for the teacher, unless the teacher has nothing
            hint_may_train = self.readiness.teacher and self._opd_state(c, sample_id) in (None, "scored")
            if not verdict.signal and not hint_may_train:
                state = self._finish_skip(c, sample_id, "no_signal", now, verdict=verdict.score, kind=verdict.kind)
                ready = []
            else:
                n = c.execute(
                    "UPDATE samples SET state = 'judged', judge_kind = ?, verdict = ?, reward = ?, rl_signal = ?, "
                    "judged_at = ? WHERE sample_id = ? AND state = 'pending'",
                    (verdict.kind, verdict.score, float(verdict.score) if verdict.signal else 0.0,
                     int(verdict.signal), now, sample_id),
                ).rowcount
                state = "judged" if n else self._state(c, sample_id)
                ready = self._promote(c, now)
                if any(r[0] == sample_id for r in ready):
                    state = "ready"
        scores = ", ".join("?" if v.score is None else f"{v.score:+d}" for _, v in all_votes)
        log.info("sample %d judged %+d by %s (votes %s): %s -> %s", sample_id, verdict.score, verdict.kind, scores,
                 verdict.rationale[:200], state if state != "skipped" else "skipped: no_signal")
        self._log_ready(ready)
        return state

    def record_failure(self, sample_id: int, reason: str, kind: str, votes: Sequence[tuple[int, VoteRecord]] = (),
                       now: Optional[float] = None) -> None:
        """The judge never gave a usable verdict: keep its votes, skip the sample with ``reason`` --
        except under OPD while its hint may still train it: then it waits for the teacher like a
        verdict without signal (and is skipped as ``no_signal`` if the teacher has nothing)."""
        now = time.time() if now is None else now
        with self.store.transaction() as c:
            self._insert_votes(c, sample_id, kind, votes, now)
            if self.readiness.teacher and self._opd_state(c, sample_id) in (None, "scored"):
                # no reward, but its hint may still train it: as a verdict without signal
                c.execute("UPDATE samples SET state = 'judged', judge_kind = ?, reward = 0, rl_signal = 0, "
                          "judged_at = ? WHERE sample_id = ? AND state = 'pending'", (kind, now, sample_id))
                ready = self._promote(c, now)
                kept = True
            else:
                self._finish_skip(c, sample_id, reason, now, kind=kind)
                kept = False
        log.warning("sample %d %s: %s after %d attempt(s) (%s)", sample_id,
                    "has no reward, waits for its teacher" if kept else "skipped", reason,
                    len({a for a, _ in votes}) or 1, "; ".join(v.rationale[:80] for _, v in votes[-3:]))
        if kept:
            self._log_ready(ready)

    def _finish_skip(self, c, sample_id: int, reason: str, now: float, verdict: Optional[int] = None,
                     kind: Optional[str] = None) -> str:
        n = c.execute(
            "UPDATE samples SET state = 'skipped', skip_reason = ?, done_at = ?, verdict = COALESCE(?, verdict), "
            "judge_kind = COALESCE(?, judge_kind) WHERE sample_id = ? AND state IN ('pending', 'judged', 'ready')",
            (reason, now, verdict, kind, sample_id),
        ).rowcount
        return "skipped" if n else self._state(c, sample_id)

    @staticmethod
    def _opd_state(c, sample_id: int) -> Optional[str]:
        row = c.execute("SELECT opd_state FROM samples WHERE sample_id = ?", (sample_id,)).fetchone()
        return row[0] if row else None

    def resolve_opd(self, sample_id: int, outcome: str, reason: str = "", now: Optional[float] = None) -> str:
        """Record the teacher's outcome for a sample (module docstring) and promote or skip it.

        ``outcome``: ``scored`` (teacher logprobs are stored), ``none`` (no hint, or the teacher
        failed: ``reason`` says which, e.g. ``no_hint:no_hindsight``) or ``timeout`` (a rewarded
        sample stops waiting). A sample already resolved, trained or skipped is left alone.
        Returns the sample's state afterwards."""
        if outcome not in OPD_OUTCOMES:
            raise ValueError(f"OPD outcome must be one of {', '.join(OPD_OUTCOMES)}, not {outcome!r}")
        if not self.readiness.teacher:
            raise ValueError("this buffer does not wait for OPD (its readiness has no teacher)")
        now = time.time() if now is None else now
        ready: list = []
        with self.store.transaction() as c:
            row = c.execute("SELECT state, rl_signal, opd_state FROM samples WHERE sample_id = ?",
                            (sample_id,)).fetchone()
            if row is None:
                raise KeyError(f"no sample with id {sample_id}")
            state, rl_signal, current = row
            if current is not None or state not in ("pending", "judged"):
                return state
            c.execute("UPDATE samples SET opd_state = ? WHERE sample_id = ?", (outcome, sample_id))
            if state == "pending" and not self.readiness.reward:
                if outcome != "scored":
                    state = self._finish_skip(c, sample_id, reason or "no_hint", now, kind="opd")
                else:
                    c.execute("UPDATE samples SET state = 'judged', judge_kind = 'opd', reward = 0, rl_signal = 0, "
                              "judged_at = ? WHERE sample_id = ?", (now, sample_id))
                    state = "judged"
            elif state == "judged" and not rl_signal and outcome != "scored":
                state = self._finish_skip(c, sample_id, "no_signal", now)
            if state == "judged":
                ready = self._promote(c, now)
                if any(r[0] == sample_id for r in ready):
                    state = "ready"
        log.info("sample %d: teacher %s%s -> %s", sample_id, outcome, f" ({reason})" if reason else "", state)
        self._log_ready(ready)
        return state

    @staticmethod
    def _state(c, sample_id: int) -> str:
        row = c.execute("SELECT state FROM samples WHERE sample_id = ?", (sample_id,)).fetchone()
        if row is None:
            raise KeyError(f"no sample with id {sample_id}")
        return row[0]

    # --- advantages ----------------------------------------------------------------------------

    def _load_baseline(self, c) -> RunningBaseline:
        rb = RunningBaseline(self.train.baseline_decay)
        state = self._meta(c, _META_BASELINE)
        if state:
            rb.load_state_dict(json.loads(state))
            rb.decay = float(self.train.baseline_decay)  # the configured decay applies from now on
        return rb

    def _promote(self, c, now: float) -> list[tuple]:
        """Give judged samples of complete groups their advantage and make them ready.

        A group is complete when no sample of it is pending and every turn sharing its request
        key has a sample (a sibling choice still open may yet be judged).
        """
        # with OPD, a group waits until every judged member's teacher outcome is in, too
        opd_wait = ("AND NOT EXISTS (SELECT 1 FROM samples o WHERE o.group_id = s.group_id AND o.state = 'judged' "
                    "AND o.opd_state IS NULL) " if self.readiness.teacher else "")
        rows = c.execute(
            "SELECT s.sample_id, s.turn_id, s.group_id, s.reward, s.rl_signal FROM samples s WHERE s.state = 'judged' "
            "AND NOT EXISTS (SELECT 1 FROM samples p WHERE p.group_id = s.group_id AND p.state = 'pending') "
            "AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.request_key = s.request_key "
            "                AND NOT EXISTS (SELECT 1 FROM samples q WHERE q.turn_id = t.turn_id)) "
            + opd_wait + "ORDER BY s.sample_id"
        ).fetchall()
        if not rows:
            return []
        # samples without a judged reward (OPD only) get advantage 0 and stay out of the statistics
        out = [(sid, turn_id, reward, 0.0, 1) for sid, turn_id, _, reward, rl in rows if not rl]
        for sid, *_ in out:
            c.execute("UPDATE samples SET state = 'ready', advantage = 0 WHERE sample_id = ?", (sid,))
        rows = [r[:4] for r in rows if r[4]]
        if not rows:
            return out
        group_index = {g: i for i, g in enumerate(dict.fromkeys(r[2] for r in rows))}
        rewards = torch.tensor([r[3] for r in rows], dtype=torch.float64)
        gids = torch.tensor([group_index[r[2]] for r in rows], dtype=torch.int64)
        sizes = torch.bincount(gids)[gids]
        ema = self.train.baseline == "ema"
        rb = self._load_baseline(c) if ema else None
        adv = group_advantages(rewards, gids, mode=self.train.group_advantage,
                               singleton_baseline=rb.value if ema else 0.0)
        if ema:
            rb.update(rewards[sizes == 1].tolist())
            self._set_meta(c, _META_BASELINE, json.dumps(rb.state_dict()))
        for (sid, turn_id, _, reward), a, size in zip(rows, adv.tolist(), sizes.tolist()):
            c.execute("UPDATE samples SET state = 'ready', advantage = ? WHERE sample_id = ?", (a, sid))
            out.append((sid, turn_id, reward, a, size))
        return out

    def _log_ready(self, ready: list[tuple]) -> None:
        for sid, turn_id, reward, adv, size in ready:
            how = f"group of {size}, {self.train.group_advantage}" if size > 1 else f"baseline {self.train.baseline}"
            log.info("sample %d (turn %d) ready: reward %+.0f, advantage %+.3f (%s)", sid, turn_id, reward, adv, how)

    # --- training ------------------------------------------------------------------------------

    def take_batch(self, n: int, current_version: int) -> list[Sample]:
        """Atomically mark ready samples consumed, earliest deadline first, and return them.

        A step takes at least ``n`` (``train.batch_size``) and, when a backlog would otherwise age
        past ``train.max_weight_lag`` before its turn, as many as keep every waiting sample within
        it, up to ``train.max_batch_size`` (``clawrl.step_size``). The deadline order is by lag,
        the most behind first, then by sample id. Samples relabelled since they were judged are
        skipped (``excluded``, ``side_turn``); stale ones (oldest token more than
        ``train.max_weight_lag`` versions behind ``current_version``) are skipped as ``stale`` under
        ``stale_policy=drop``. Neither counts towards the step. An environment's samples come as
        whole groups: the first one taken brings every ready sample of its group along, even past
        the step's size, so a step never trains half a group's comparison.
        """
        if n < 1:
            return []
        now = time.time()
        out: list[Sample] = []
        skipped: list[tuple[int, str, str]] = []
        with self.store.transaction() as c:
            lag_of = lag_counter(dict(c.execute("SELECT version, source FROM weight_aliases").fetchall()),
                                 current_version)
            payloads = _Payloads(c)
            queue = self._ready_by_deadline(c, payloads, lag_of)
            limit = self.train.max_weight_lag
            keeps_stale = self.train.stale_policy == "importance_weight"
            size = step_size([limit - lag for _, lag in queue if keeps_stale or lag <= limit], n,
                             self.train.max_batch_size)
            groups: dict[str, list[tuple]] = {}
            for row, _ in sorted(queue, key=lambda q: q[0][0]):
                if row[1] != "turn":
                    groups.setdefault(row[4], []).append(row)
            groups_taken = set()
            for row, _ in queue:
                if len(out) >= size:
                    break
                if row[1] == "turn":
                    batch = [row]
                elif row[4] in groups_taken:
                    continue
                else:  # the whole group, in sample order
                    groups_taken.add(row[4])
                    batch = groups[row[4]]
                for sample_row in batch:
                    sample, why = self._take_one(c, sample_row, payloads, lag_of, current_version, now)
                    if sample is None:
                        skipped.append((sample_row[0], f"{sample_row[1]} {sample_row[2]}", why))
                    else:
                        out.append(sample)
        for sid, origin, why in skipped:
            log.info("sample %d (%s) skipped at take time: %s", sid, origin, why)
        if out:
            stale = sum(s.extra["weight_lag"] > self.train.max_weight_lag for s in out)
            grown = (f", more than train.batch_size={n}: {len(queue)} were ready, and taking {n} a step would "
                     f"leave some past max_weight_lag={limit} before their turn" if size > n else "")
            log.info("took %d sample(s) for training at weight version %d%s%s", len(out), current_version, grown,
                     f" ({stale} beyond max_weight_lag, kept for importance weighting)" if stale else "")
        return out

    def _ready_by_deadline(self, c, payloads: "_Payloads", lag_of) -> list[tuple[tuple, int]]:
        """Every ready sample as (``_TAKE_COLUMNS`` row, lag now), the most behind first, then by id."""
        rows = c.execute(f"SELECT {_TAKE_COLUMNS} FROM samples WHERE state = 'ready' ORDER BY sample_id").fetchall()
        queue = [(row, max(map(lag_of, set(payloads.versions(row[1], row[2]))), default=0)) for row in rows]
        queue.sort(key=lambda q: -q[1])  # stable: ties keep sample order
        return queue

    def _take_one(self, c, row: tuple, payloads: "_Payloads", lag_of, current_version: int,
                  now: float) -> tuple[Optional[Sample], str]:
        """Consume one ready sample (or skip it: relabelled turn, stale); (sample or None, why skipped)."""
        sid, source, source_id, turn_id, group_id, reward, adv, kind, rl_signal, opd_state = row
        p = payloads.of(source, source_id)
        skip = p.skip
        lag = max(map(lag_of, set(p.versions)), default=0)
        if skip is None and lag > self.train.max_weight_lag and self.train.stale_policy == "drop":
            skip = "stale"
        if skip:
            c.execute("UPDATE samples SET state = 'skipped', skip_reason = ?, weight_lag = ?, done_at = ? "
                      "WHERE sample_id = ?", (skip, lag, now, sid))
            return None, skip if skip != "stale" else f"stale (lag {lag})"
        c.execute("UPDATE samples SET state = 'consumed', weight_lag = ?, consumed_version = ?, consumed_at = ? "
                  "WHERE sample_id = ?", (lag, current_version, now, sid))
        return _sample(row, p, lag), ""

    def recorded_batches(self) -> Iterator[tuple[int, int, int, list[Sample]]]:
        """Read only: every recorded train step of the surviving lineage (table ``train_batches``), in
        step order, as ``(train_step, consumed_version, trained_version, samples)``, the samples built
        exactly as :meth:`take_batch` handed them to the trainer, in the same order (``clawrl replay``).
        A relabel since the step does not change what it trained."""
        c = self.store.connection()
        steps = [r[0] for r in c.execute("SELECT DISTINCT train_step FROM train_batches ORDER BY train_step")]
        columns = ", ".join(f"s.{col.strip()}" for col in _TAKE_COLUMNS.split(","))
        for step in steps:
            rows = c.execute(f"SELECT {columns}, b.weight_lag, b.consumed_version, b.trained_version "
                             "FROM train_batches b JOIN samples s ON s.sample_id = b.sample_id "
                             "WHERE b.train_step = ? ORDER BY b.position", (step,)).fetchall()
            payloads = _Payloads(c)
            samples = [_sample(r[:-3], payloads.of(r[1], r[2]), r[-3]) for r in rows]
            yield step, rows[0][-2], rows[0][-1], samples

    def mark_trained(self, sample_ids: Sequence[int], train_step: int, weight_version: int) -> None:
        """Consumed samples were trained in ``train_step``, producing ``weight_version``. All or none."""
        ids = list(dict.fromkeys(sample_ids))
        now = time.time()
        with self.store.transaction() as c:
            states = self._states(c, ids)
            wrong = {sid: st for sid, st in states.items() if st != "consumed"}
            if wrong:
                raise ValueError("only consumed samples can be marked trained; "
                                 + ", ".join(f"{sid} is {st}" for sid, st in sorted(wrong.items())))
            c.executemany("UPDATE samples SET state = 'trained', train_step = ?, trained_version = ?, done_at = ? "
                          "WHERE sample_id = ?", [(train_step, weight_version, now, sid) for sid in ids])
            # the batch as the trainer got it, in order, in the same transaction (clawrl replay)
            first = c.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM train_batches WHERE train_step = ?",
                              (train_step,)).fetchone()[0]
            c.executemany("INSERT INTO train_batches (train_step, position, sample_id, consumed_version, weight_lag, "
                          "trained_version) SELECT ?, ?, sample_id, COALESCE(consumed_version, 0), "
                          "COALESCE(weight_lag, 0), ? FROM samples WHERE sample_id = ?",
                          [(train_step, first + i, weight_version, sid) for i, sid in enumerate(ids)])
        log.info("%d sample(s) trained in step %d -> weight version %d", len(ids), train_step, weight_version)

    def mark_skipped(self, sample_ids: Sequence[int], reason: str) -> None:
        """Skip samples that are not trained yet (e.g. the trainer rejected them). All or none."""
        if not reason:
            raise ValueError("a skip needs a reason")
        ids = list(dict.fromkeys(sample_ids))
        now = time.time()
        with self.store.transaction() as c:
            states = self._states(c, ids)
            final = {sid: st for sid, st in states.items() if st in ("trained", "skipped")}
            if final:
                raise ValueError("trained or skipped samples cannot be skipped; "
                                 + ", ".join(f"{sid} is {st}" for sid, st in sorted(final.items())))
            c.executemany("UPDATE samples SET state = 'skipped', skip_reason = ?, done_at = ? WHERE sample_id = ?",
                          [(reason, now, sid) for sid in ids])
        for sid in ids:
            log.info("sample %d skipped: %s", sid, reason)

    def _states(self, c, ids: list[int]) -> dict[int, str]:
        states = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            states.update(c.execute(f"SELECT sample_id, state FROM samples WHERE sample_id IN "
                                    f"({','.join('?' * len(chunk))})", chunk).fetchall())
        missing = [sid for sid in ids if sid not in states]
        if missing:
            raise KeyError(f"no sample with id {', '.join(map(str, missing))}")
        return states

    def record_alias(self, version: int, source: int) -> None:
        """``version`` serves the weights of ``source`` again (a restart resumed older weights under a
        new number): tokens of ``source`` and its ancestors stay as fresh as they were."""
        if not 0 <= source < version:
            raise ValueError(f"a re-served version must be newer than its source, got {version} -> {source}")
        with self.store.transaction() as c:
            c.execute("INSERT OR REPLACE INTO weight_aliases (version, source, at) VALUES (?, ?, ?)",
                      (version, source, time.time()))
        log.info("weight version %d serves the weights of version %d (staleness counts from %d)",
                 version, source, source)

    def requeue_after_restore(self, checkpoint_step: int) -> int:
        """After restoring the checkpoint of ``checkpoint_step``: samples consumed but not trained,
        or trained in a later step (their update was lost with the weights), become ready again."""
        with self.store.transaction() as c:
            rows = c.execute("SELECT sample_id, state, train_step FROM samples "
                             "WHERE state = 'consumed' OR (state = 'trained' AND train_step > ?)",
                             (checkpoint_step,)).fetchall()
            c.executemany("UPDATE samples SET state = 'ready', train_step = NULL, trained_version = NULL, "
                          "consumed_version = NULL, consumed_at = NULL, done_at = NULL, requeues = requeues + 1 "
                          "WHERE sample_id = ?", [(r[0],) for r in rows])
            # the lost steps leave the record of train batches: it holds the surviving lineage only
            c.execute("DELETE FROM train_batches WHERE train_step > ?", (checkpoint_step,))
        if rows:
            consumed = sum(r[1] == "consumed" for r in rows)
            log.info("restored checkpoint step %d: %d sample(s) back to ready (%d consumed untrained, %d trained "
                     "after step %d)", checkpoint_step, len(rows), consumed, len(rows) - consumed, checkpoint_step)
        return len(rows)

    # --- status --------------------------------------------------------------------------------

    def counts(self) -> dict:
        """Sample counts by state, skips by reason, and judge statistics (for ``/admin/status``)."""
        c = self.store.connection()
        out = {state: 0 for state in STATES}
        out.update(c.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall())
        out["skipped_by_reason"] = dict(c.execute(
            "SELECT skip_reason, COUNT(*) FROM samples WHERE state = 'skipped' GROUP BY skip_reason ORDER BY 2 DESC"
        ).fetchall())
        votes, garbage = c.execute("SELECT COUNT(*), COALESCE(SUM(score IS NULL), 0) FROM votes").fetchone()
        total, agree = c.execute(
            "SELECT COUNT(*), COALESCE(SUM(v.score = s.verdict), 0) FROM votes v JOIN samples s ON s.sample_id = v.sample_id "
            "WHERE v.score IS NOT NULL AND s.verdict IS NOT NULL"
        ).fetchone()
        out["votes"] = votes
        out["garbage_votes"] = garbage
        # fraction of valid votes that equal their turn's majority verdict (1.0: judges never disagree)
        out["judge_agreement"] = agree / total if total else None
        if self.train.baseline == "ema":
            out["baseline"] = self._load_baseline(c).state_dict()
        return out

    def get_sample(self, sample_id: int) -> dict:
        cols = ("sample_id", "source", "source_id", "turn_id", "group_id", "state", "skip_reason", "judge_kind", "verdict", "reward",
                "advantage", "weight_lag", "consumed_version", "train_step", "trained_version", "requeues",
                "rl_signal", "opd_state")
        row = self.store.connection().execute(f"SELECT {', '.join(cols)} FROM samples WHERE sample_id = ?",
                                         (sample_id,)).fetchone()
        if row is None:
            raise KeyError(f"no sample with id {sample_id}")
        return dict(zip(cols, row))

    def samples(self) -> list[dict]:
        """Every sample (id, turn, state, reason, reward...), in id order."""
        ids = [r[0] for r in self.store.connection().execute("SELECT sample_id FROM samples ORDER BY sample_id")]
        return [self.get_sample(i) for i in ids]

    def votes(self, sample_id: int) -> list[dict]:
        cols = ("attempt", "vote_index", "judge_kind", "score", "rationale", "raw")
        rows = self.store.connection().execute(f"SELECT {', '.join(cols)} FROM votes WHERE sample_id = ? ORDER BY vote_id",
                                          (sample_id,))
        return [dict(zip(cols, r)) for r in rows]



def _sample(row: tuple, p: "_Payload", lag: int) -> Sample:
    """The trainer's sample from a ``_TAKE_COLUMNS`` row, its payload and its staleness at take time."""
    sid, source, source_id, turn_id, group_id, reward, adv, kind, rl_signal, opd_state = row
    return Sample(
        sample_id=sid, turn_id=turn_id or 0, group_id=group_id, prompt_ids=p.prompt_ids,
        response_ids=p.response_ids, rollout_logprobs=p.logprobs, weight_versions=p.versions,
        reward=float(reward), advantage=float(adv), loss_mask=p.loss_mask, rl_signal=bool(rl_signal),
        extra={"weight_lag": lag, "judge_kind": kind, "temperature": p.temperature, "opd_state": opd_state,
               **p.extra},
        source=source, source_id=source_id,
    )


_TAKE_COLUMNS = ("sample_id, source, source_id, turn_id, group_id, reward, advantage, judge_kind, rl_signal, "
                 "opd_state")


@dataclass
class _Payload:
    """What a sample trains on, read from its source row."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    temperature: float
    loss_mask: Optional[list[int]] = None  # None: every response token trains
    skip: Optional[str] = None  # why it cannot train after all (a turn relabelled since it was judged)
    extra: dict = field(default_factory=dict)


class _Payloads:
    """Reads sample payloads inside one transaction, each episode once however many of its steps
    are taken."""

    def __init__(self, c):
        self.c = c
        self._episodes: dict[int, tuple] = {}

    def of(self, source: str, source_id: int) -> _Payload:
        if source == "turn":
            return self._turn(source_id)
        if source == "episode":
            ep = self._episode(source_id)
            return _Payload(ep[0], ep[1], ep[3], ep[4], ep[5], loss_mask=ep[2],
                            extra={"task_id": ep[6], "episode_id": source_id})
        if source == "step":
            row = self.c.execute("SELECT episode_id, step_index, span_start, span_end, step_score FROM episode_steps "
                                 "WHERE step_id = ?", (source_id,)).fetchone()
            if row is None:
                raise KeyError(f"sample source step {source_id} is not in the store")
            episode_id, index, start, end, score = row
            ep = self._episode(episode_id)
            extra = {"task_id": ep[6], "episode_id": episode_id, "step_index": index}
            if score is not None:
                extra["step_score"] = score
            return _Payload(ep[0] + ep[1][:start], ep[1][start:end], ep[3][start:end], ep[4][start:end], ep[5],
                            extra=extra)
        raise KeyError(f"unknown sample source {source!r}")

    def versions(self, source: str, source_id: int) -> list[int]:
        """The weight versions of a sample's trained tokens only: what its lag is counted from."""
        if source == "turn":
            row = self.c.execute("SELECT weight_versions FROM turns WHERE turn_id = ?", (source_id,)).fetchone()
            return unpack(row[0], "q") if row is not None and row[0] is not None else []
        return self.of(source, source_id).versions

    def _turn(self, turn_id: int) -> _Payload:
        row = self.c.execute("SELECT turn_type, trainable, untrainable_reason, close_reason, prompt_ids, "
                             "prompt_blobs, response_ids, logprobs, weight_versions, temperature FROM turns "
                             "WHERE turn_id = ?", (turn_id,)).fetchone()
        if row is None:
            raise KeyError(f"sample source turn {turn_id} is not in the store")
        turn_type, trainable, reason, close_reason, p_blob, p_chunks, r_blob, lp_blob, v_blob, temperature = row
        prompt = unpack(load_prompt(self.c, p_blob, p_chunks), "i")
        return _Payload(prompt, unpack(r_blob, "i"), unpack(lp_blob, "d"), unpack(v_blob, "q") or [], temperature,
                        skip=turn_skip_reason(turn_type, trainable, reason, close_reason))

    def _episode(self, episode_id: int) -> tuple:
        if episode_id not in self._episodes:
            row = self.c.execute("SELECT prompt_ids, response_ids, loss_mask, logprobs, weight_versions, temperature, "
                                 "task_id FROM episodes WHERE episode_id = ?", (episode_id,)).fetchone()
            if row is None:
                raise KeyError(f"sample source episode {episode_id} is not in the store")
            p, r, m, lp, v, temperature, task_id = row
            self._episodes[episode_id] = (unpack(p, "i"), unpack(r, "i"), unpack(m, "b"), unpack(lp, "d"),
                                          unpack(v, "q"), temperature, task_id)
        return self._episodes[episode_id]
