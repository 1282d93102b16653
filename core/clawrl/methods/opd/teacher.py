"""OPD's teacher: hint each judged turn, then score its sampled tokens under the hinted prompt.

For every closed main turn that could train (the same turns the rollout buffer samples), the
:class:`TeacherWorker`

1. asks a hint judge (``clawrl.judges.hints``) whether the next state holds a hint; the verdict,
   every vote and, for a rejection, the reason are stored (table ``opd_hints``);
2. for an accepted hint, renders the turn's stored messages with the hint appended to the last
   user message of the history -- ``[Hint: answer in one line]``, the format the embedded model was
   pretrained to follow -- through the tokenizer's chat template, and asks the teacher engine for
   the exact logprob of each *stored* response id after that prompt (``Engine.score``), plus its
   top-k ids and logprobs when ``opd.topk > 0``. The response ids are never re-tokenised: the
   hinted prompt is a new prompt, the response is the one that was sampled.
3. with ``opd.hinted_sample``, also samples the teacher's own reply under the hinted prompt
   (``Engine.generate``, ``opd.hinted_temperature``) and stores its token ids and logprobs as
   sampled. The student trains on those ids under its *original* prompt with token NLL weighted by
   the hint judge's acceptance (``clawrl.trainers.objective``): a behaviour the policy gives
   probability ~e^-12 without the hint is then learned from the hinted policy's own tokens, where an
   advantage on the student's sampled tokens (or an importance weight against the student) cannot.

Results are durable rows keyed by turn id, so a restart neither re-judges nor re-scores a turn
(an accepted but unscored turn is scored after a restart). Each row records the teacher
(``opd.teacher``: ``policy`` or a model path) and the weight version that scored it.

Serving first: at most ``opd.concurrency`` turns are in flight, and before each score request the
worker waits (up to ``busy_wait_s``) while the engine has requests queued, so teacher prefills only
fill gaps between user requests; the engine batches them with decoding.

A turn's prompt is rebuilt from its messages, so it must render to exactly the stored prompt ids
(a forced tool-call prefill after it is carried over). A prompt cut by ``server.truncate_history``
or a changed chat template does not; such a turn fails with ``prompt_mismatch`` rather than being
scored under a prompt that differs from the student's by more than the hint.

Use (the orchestrator)::

    opd = OpdStore(store)
    worker = TeacherWorker(opd, make_hint_judge(cfg.opd, judge_engine), teacher_engine, cfg.opd)
    worker.start()                                   # an asyncio task; worker.notify() wakes it
    ...
    batch = buffer.take_batch(...)
    opd.attach(batch)                                # Sample.teacher for scored turns
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from dataclasses import replace
from typing import Iterable, Optional, Sequence

from clawrl.buffer import turn_skip_reason
from clawrl.config import OpdConfig
from clawrl.engines.base import ROLLOUT_PRIORITY, ContextLengthExceeded, Engine, GenerateResult, SamplingParams, ScoreResult
from clawrl.engines.chat_template import render_chat
from clawrl.judges.base import JudgeInput
from clawrl.judges.hints import HintJudge, HintVerdict
from clawrl.samples import Sample, TeacherSignal
from clawrl.schema import OPD
from clawrl.store import TurnStore, load_messages, load_prompt, load_tools, pack, unpack
from clawrl.workers import PollingWorker

log = logging.getLogger(__name__)

STATES = ("accepted", "rejected", "scored", "failed")



class TeacherError(RuntimeError):
    """A turn the teacher cannot score; ``reason`` is the short recorded failure reason."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


def hint_tag(hint: str) -> str:
    """The hint as the embedded model learned hints: ``[Hint: answer in one line]`` (lower-case
    start unless it is an acronym, no closing full stop)."""
    text = " ".join(hint.split()).rstrip(".")
    if len(text) > 1 and not text[1].isupper():
        text = text[0].lower() + text[1:]
    return f"[Hint: {text}]"


def hinted_messages(messages: Sequence[dict], history_len: int, hint: str) -> list[dict]:
    """A copy of ``messages`` with ``hint_tag(hint)`` appended to the last user message of the
    history (the request the reply answered; a trailer after the history is left alone)."""
    history = list(messages[:history_len]) or list(messages)
    index = next((i for i in range(len(history) - 1, -1, -1) if history[i].get("role") == "user"), None)
    if index is None:
        raise TeacherError("no_user_message", "the turn's history has no user message to append the hint to")
    out = copy.deepcopy(list(messages))
    content = out[index].get("content")
    tag = hint_tag(hint)
    if isinstance(content, list):
        out[index]["content"] = content + [{"type": "text", "text": " " + tag}]
    else:
        out[index]["content"] = f"{content or ''} {tag}".lstrip()
    return out


def acceptance(votes: Sequence[dict]) -> float:
    """The hint judge's acceptance of its hint: the share of all votes cast that accepted (1.0 for the
    rules judge's one vote; garbage votes count against, as in ``choose_hint``)."""
    return sum(1 for v in votes if v.get("accept") is True) / len(votes) if votes else 0.0


def _render(tokenizer, messages: list, tools: Optional[list]) -> list[int]:
    text = render_chat(tokenizer, messages, tools)
    return tokenizer.encode(text, add_special_tokens=False)


def teacher_prompt_ids(tokenizer, turn: dict, hint: str) -> list[int]:
    """The hinted prompt ids for a stored turn (see the module docstring on ``prompt_mismatch``).

    The turn's messages are rendered with and without the hint; the unhinted rendering must be a
    prefix of the stored prompt ids, and what follows it there (a forced tool-call prefill) is
    appended to the hinted rendering. Tools are tried as stored, then absent (``tool_choice=none``
    renders none).
    """
    stored = list(turn["prompt_ids"] or ())
    messages = turn["messages"]
    hinted = hinted_messages(messages, turn.get("history_len", len(messages)), hint)
    for tools in dict.fromkeys([json.dumps(turn.get("tools")), "null"]):
        tools = json.loads(tools)
        try:
            plain = _render(tokenizer, messages, tools)
        except Exception as e:  # a template that rejects the stored messages cannot have rendered them
            raise TeacherError("prompt_mismatch", f"the chat template rejects the stored messages: {e}") from None
        if stored[:len(plain)] == plain:
            return _render(tokenizer, hinted, tools) + stored[len(plain):]
    raise TeacherError("prompt_mismatch", "the stored messages do not render to the stored prompt ids "
                                          "(history truncated, or the chat template changed)")


class OpdStore:
    """The ``opd_hints`` table on the turn store. Synchronous SQLite transactions; from the event
    loop call them with ``asyncio.to_thread``."""

    def __init__(self, store: TurnStore):
        self.store = store
        self._migrate()

    def _migrate(self) -> None:
        self.store.register(OPD)

    def unjudged(self, limit: int, exclude: Iterable[int] = ()) -> list[JudgeInput]:
        """Up to ``limit`` closed turns that could train and have no hint verdict yet, oldest first."""
        exclude = set(exclude)
        rows = self.store.connection().execute(
            "SELECT turn_id, turn_type, trainable, untrainable_reason, close_reason, messages, message_blobs, "
            "history_len, response_text, tool_calls, next_state FROM turns t WHERE close_reason = 'next_state' "
            "AND turn_type = 'main' AND trainable = 1 "
            "AND NOT EXISTS (SELECT 1 FROM opd_hints h WHERE h.turn_id = t.turn_id) ORDER BY turn_id")
        out = []
        for turn_id, turn_type, trainable, reason, close, messages, blobs, hist, text, calls, next_state in rows:
            if turn_id in exclude or turn_skip_reason(turn_type, trainable, reason, close):
                continue
            out.append(JudgeInput.from_turn({
                "turn_id": turn_id, "messages": load_messages(self.store.connection(), messages, blobs),
                "history_len": hist, "response_text": text,
                "tool_calls": json.loads(calls) if calls else None, "next_state": json.loads(next_state)}))
            if len(out) >= limit:
                break
        return out

    def record_hint(self, turn_id: int, verdict: HintVerdict) -> bool:
        """Store a verdict; False (and nothing changed) if the turn already has one -- another
        worker got there first, and its verdict stands."""
        state = "accepted" if verdict.accepted else "rejected"
        with self.store.transaction() as c:
            n = c.execute(
                "INSERT INTO opd_hints (turn_id, state, reason, hint, support, judge_kind, votes, judged_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (turn_id) DO NOTHING",
                (turn_id, state, None if verdict.accepted else verdict.reason, verdict.hint or None,
                 verdict.support if verdict.accepted else None, verdict.kind,
                 json.dumps([v.to_json() for v in verdict.votes], ensure_ascii=False), time.time())).rowcount
        if not n:
            return False
        if verdict.accepted:
            log.info("turn %d: hint accepted (%s, support %.2f): %s", turn_id, verdict.kind, verdict.support,
                     verdict.hint)
        else:
            log.info("turn %d: no hint (%s)", turn_id, verdict.reason)
        return True

    def unscored(self, limit: int, exclude: Iterable[int] = ()) -> list[tuple[int, str]]:
        """(turn id, hint) of accepted turns not scored yet, oldest first."""
        exclude = set(exclude)
        rows = self.store.connection().execute(
            "SELECT turn_id, hint FROM opd_hints WHERE state = 'accepted' ORDER BY turn_id").fetchall()
        return [(t, h) for t, h in rows if t not in exclude][:limit]

    def turn(self, turn_id: int) -> dict:
        """What the teacher needs of a turn: messages, history length, tools, prompt and response ids."""
        c = self.store.connection()
        row = c.execute(
            "SELECT messages, message_blobs, history_len, tools, tools_blob, prompt_ids, prompt_blobs, response_ids "
            "FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
        if row is None:
            raise KeyError(f"no turn with id {turn_id}")
        messages, message_blobs, history_len, tools, tools_blob, prompt, prompt_blobs, response = row
        return {"turn_id": turn_id, "messages": load_messages(c, messages, message_blobs), "history_len": history_len,
                "tools": load_tools(c, tools, tools_blob),
                "prompt_ids": unpack(load_prompt(c, prompt, prompt_blobs), "i"), "response_ids": unpack(response, "i")}

    def record_score(self, turn_id: int, teacher: str, prompt_ids: Sequence[int], result: ScoreResult,
                     topk: int, hinted: Optional[GenerateResult] = None,
                     hinted_temperature: Optional[float] = None) -> None:
        """The teacher's scores, and with ``hinted`` its own reply under the hinted prompt, in one
        transaction: the sample becomes ready with both or neither."""
        ids = [i for row in result.topk_ids or () for i in row]
        lps = [x for row in result.topk_logprobs or () for x in row]
        with self.store.transaction() as c:
            n = c.execute(
                "UPDATE opd_hints SET state = 'scored', teacher = ?, teacher_prompt_ids = ?, teacher_logprobs = ?, "
                "topk = ?, topk_ids = ?, topk_logprobs = ?, weight_version = ?, scored_at = ?, hinted_ids = ?, "
                "hinted_logprobs = ?, hinted_temperature = ? WHERE turn_id = ? AND state = 'accepted'",
                (teacher, pack(prompt_ids, "i"), pack(result.logprobs, "d"), topk if ids else 0,
                 pack(ids, "i") if ids else None, pack(lps, "f") if ids else None, result.weight_version,
                 time.time(), pack(hinted.token_ids, "i") if hinted else None,
                 pack(hinted.logprobs, "d") if hinted else None, hinted_temperature if hinted else None,
                 turn_id)).rowcount
        if not n:
            raise ValueError(f"turn {turn_id} has no accepted, unscored hint")

    def record_failure(self, turn_id: int, reason: str) -> None:
        with self.store.transaction() as c:
            c.execute("UPDATE opd_hints SET state = 'failed', reason = ?, scored_at = ? "
                      "WHERE turn_id = ? AND state = 'accepted'", (reason, time.time(), turn_id))
        log.warning("turn %d: teacher scoring failed: %s", turn_id, reason)

    def get(self, turn_id: int) -> Optional[dict]:
        """The OPD record of a turn (None if not judged yet); token arrays unpacked, top-k as rows."""
        cols = ("turn_id", "state", "reason", "hint", "support", "judge_kind", "votes", "teacher",
                "teacher_prompt_ids", "teacher_logprobs", "topk", "topk_ids", "topk_logprobs", "weight_version",
                "hinted_ids", "hinted_logprobs", "hinted_temperature")
        row = self.store.connection().execute(f"SELECT {', '.join(cols)} FROM opd_hints WHERE turn_id = ?",
                                         (turn_id,)).fetchone()
        if row is None:
            return None
        d = dict(zip(cols, row))
        d["votes"] = json.loads(d["votes"])
        d["teacher_prompt_ids"] = unpack(d["teacher_prompt_ids"], "i")
        d["teacher_logprobs"] = unpack(d["teacher_logprobs"], "d")
        d["hinted_ids"] = unpack(d["hinted_ids"], "i") if d["hinted_ids"] is not None else None
        d["hinted_logprobs"] = unpack(d["hinted_logprobs"], "d") if d["hinted_logprobs"] is not None else None
        d["acceptance"] = acceptance(d["votes"])
        k = d["topk"] or 0
        ids, lps = unpack(d["topk_ids"], "i"), unpack(d["topk_logprobs"], "f")
        d["topk_ids"] = [ids[i:i + k] for i in range(0, len(ids), k)] if k and ids else None
        d["topk_logprobs"] = [lps[i:i + k] for i in range(0, len(lps), k)] if k and lps else None
        return d

    def attach(self, samples: Sequence[Sample], hinted: bool = False) -> int:
        """Put each scored turn's teacher signal on its sample (``Sample.teacher``): teacher logprobs
        (one per response token), top-k ids and logprobs (``[T][K]`` or None), the hint, the teacher
        and its weight version; with ``hinted`` (``opd.hinted_sample``) also the teacher's reply under
        the hinted prompt and the hint's acceptance as its weight, where one was sampled. Samples
        without a scored hint get nothing. Returns how many got it."""
        attached = 0
        for s in samples:
            rec = self.get(s.turn_id)
            if rec is None or rec["state"] != "scored":
                continue
            if len(rec["teacher_logprobs"]) != len(s.response_ids):
                raise ValueError(f"turn {s.turn_id}: {len(rec['teacher_logprobs'])} teacher logprobs for "
                                 f"{len(s.response_ids)} response tokens")
            hinted_ids = rec["hinted_ids"] if hinted and rec["hinted_ids"] else None
            s.teacher = TeacherSignal(teacher_logprobs=rec["teacher_logprobs"], topk_ids=rec["topk_ids"],
                                      topk_logprobs=rec["topk_logprobs"], hint=rec["hint"], teacher=rec["teacher"],
                                      weight_version=rec["weight_version"], hinted_ids=hinted_ids,
                                      hinted_weight=rec["acceptance"] if hinted_ids else 0.0)
            attached += 1
        return attached

    def counts(self) -> dict:
        """Turns by OPD state and rejections/failures by reason (for ``/admin/status``)."""
        c = self.store.connection()
        out = {state: 0 for state in STATES}
        out.update(c.execute("SELECT state, COUNT(*) FROM opd_hints GROUP BY state").fetchall())
        out["by_reason"] = dict(c.execute(
            "SELECT reason, COUNT(*) FROM opd_hints WHERE state IN ('rejected', 'failed') GROUP BY reason "
            "ORDER BY 2 DESC").fetchall())
        return out


class TeacherWorker(PollingWorker):
    """Hint-judges closed turns and teacher-scores accepted ones in the background (module docstring).

    The polling loop (``start``, ``notify``, ``drain``, ``stop``) is ``clawrl.workers.PollingWorker``,
    ``opd.concurrency`` turns at a time. A hint judge
    that raises or times out (``timeout_s``) rejects the turn with ``judge_error``/``judge_timeout``;
    a score request that fails records ``failed`` with the reason (``prompt_mismatch``,
    ``context_length``, ``teacher_error``), so one bad turn never blocks the rest.
    """

    name = "OPD teacher worker"
    item_label = "turn"

    def __init__(self, opd: OpdStore, hint_judge: HintJudge, engine: Engine, opd_cfg: OpdConfig,
                 tokenizer=None, temperature: float = 1.0, timeout_s: float = 60.0, busy_wait_s: float = 5.0,
                 poll_s: float = 1.0):
        if opd_cfg.concurrency < 1:
            raise ValueError("opd.concurrency must be at least 1")
        if opd_cfg.topk < 0 or opd_cfg.topk > 20:
            raise ValueError(f"opd.topk must be between 0 and 20, not {opd_cfg.topk}")
        tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("the OPD teacher needs the policy's tokenizer with a chat template")
        self.opd, self.hint_judge, self.engine, self.tokenizer = opd, hint_judge, engine, tokenizer
        super().__init__(opd_cfg.concurrency, poll_s)
        self.teacher, self.topk = opd_cfg.teacher, opd_cfg.topk
        # opd.hinted_sample: also sample the teacher's own reply under the hinted prompt
        self.hinted = (SamplingParams(max_new_tokens=opd_cfg.hinted_max_tokens, temperature=opd_cfg.hinted_temperature,
                                      priority=ROLLOUT_PRIORITY) if opd_cfg.hinted_sample else None)
        self.temperature, self.timeout_s, self.busy_wait_s = temperature, timeout_s, busy_wait_s

    def _started_message(self) -> str:
        hinted = (f", a reply sampled under each hint (temperature {self.hinted.temperature:g}, at most "
                  f"{self.hinted.max_new_tokens} tokens)" if self.hinted else "")
        return (f"OPD teacher worker started: {self.hint_judge.kind} hint judge, teacher {self.teacher}, "
                f"top-k {self.topk}{hinted}, {self.concurrency} at a time")

    async def _next_work(self, free: int, busy: list[int]):
        todo: list = await asyncio.to_thread(self.opd.unscored, free, busy)
        if len(todo) < free:
            todo += await asyncio.to_thread(self.opd.unjudged, free - len(todo), busy)
        return [(work[0] if isinstance(work, tuple) else work.turn_id, self._process(work)) for work in todo]

    async def _process(self, work) -> None:
        if isinstance(work, JudgeInput):
            verdict = await self._judge(work)
            recorded = await asyncio.to_thread(self.opd.record_hint, work.turn_id, verdict)
            if not recorded or not verdict.accepted:
                self.finished += 1
                return
            turn_id, hint = work.turn_id, verdict.hint
        else:
            turn_id, hint = work
        await self._score(turn_id, hint)
        self.finished += 1

    async def _judge(self, item: JudgeInput) -> HintVerdict:
        try:
            return await asyncio.wait_for(self.hint_judge.extract(item), self.timeout_s)
        except asyncio.TimeoutError:
            reason = "judge_timeout"
        except Exception as e:
            reason = "judge_error"
            log.warning("hint judge failed on turn %d: %s", item.turn_id, e)
        return HintVerdict(False, "", reason, [], self.hint_judge.kind)

    async def _score(self, turn_id: int, hint: str) -> None:
        turn = await asyncio.to_thread(self.opd.turn, turn_id)
        try:
            prompt = teacher_prompt_ids(self.tokenizer, turn, hint)
            await self._wait_for_serving_gap()
            result = await asyncio.wait_for(
                self.engine.score(prompt, turn["response_ids"], top_k=self.topk, temperature=self.temperature),
                self.timeout_s)
            hinted = None
            if self.hinted is not None:
                await self._wait_for_serving_gap()
                # one seed per turn: a restart that samples it again gets the same reply from the same weights
                hinted = await asyncio.wait_for(self.engine.generate(
                    prompt, replace(self.hinted, seed=turn_id), request_id=f"opd-hinted-{turn_id}"), self.timeout_s)
                if not hinted.token_ids or hinted.finish_reason == "abort":
                    raise TeacherError("hinted_sample_empty", f"the reply under the hint ended "
                                       f"{hinted.finish_reason!r} with {len(hinted.token_ids)} token(s)")
        except TeacherError as e:
            await asyncio.to_thread(self.opd.record_failure, turn_id, e.reason)
            return
        except ContextLengthExceeded:
            await asyncio.to_thread(self.opd.record_failure, turn_id, "context_length")
            return
        except Exception as e:
            await asyncio.to_thread(self.opd.record_failure, turn_id,
                                    f"teacher_error: {type(e).__name__}: {str(e)[:200]}")
            return
        await asyncio.to_thread(self.opd.record_score, turn_id, self.teacher, prompt, result, self.topk, hinted,
                                self.hinted.temperature if self.hinted else None)
        log.info("turn %d: teacher scored %d token(s) under the hint at weight version %d%s", turn_id,
                 len(result.logprobs), result.weight_version,
                 f", and sampled a reply of {len(hinted.token_ids)} token(s) under it" if hinted else "")

    async def _wait_for_serving_gap(self) -> None:
        """Hold a score request while user requests wait for the engine (at most ``busy_wait_s``)."""
        deadline = time.monotonic() + self.busy_wait_s
        while time.monotonic() < deadline:
            health = await self.engine.health()
            if not health.get("waiting"):
                return
            await asyncio.sleep(0.05)
