"""One episode of an environment, token-in and token-out.

The model's sampled ids are the training data, so they are never re-tokenised. Turn k's prompt is
turn k-1's prompt, plus the ids sampled at turn k-1, plus the ids of what came between: the chat
template's closing of the assistant message and the rendered observation, ending in the opening of
the next assistant message. Those in-between ids are the text the template renders after the
reply once the observation follows it, tokenised on their own, so nothing the model produced
passes through the tokenizer again. The reply is stood in for by a marker while rendering: the
text around it is all that is needed, and templates that rewrite earlier turns once a new user
message arrives (Qwen3 drops the thinking of turns before the last query) cannot disturb it.

The reply handed to the environment is decoded from the sampled ids with special tokens kept
(``<tool_call>`` is one in Qwen-style vocabularies), less the end-of-turn token the model closed
with. When the first observation carries ``tools``, the template renders them itself, in the
model's own words for its tool section (or, where it drops them, clawrl's Hermes-style tool prompt:
``clawrl.engines.chat_template``).

An episode is bounded four ways: model turns (``max_turns``), tokens per turn (the sampling
params), tokens in all (``max_total_tokens``, the first prompt included) and wall time
(``timeout_s``). A limit that ends it records it as ``truncated`` with the limit as its
``reason``, and the environment still gives its verdict (``Env.finish``). An environment that
raises, answers with something that is not a StepOutcome (or a reward that is not a finite
number), or runs past the time limit inside ``reset``/``step``/``finish`` fails the episode instead
(``failed``, with ``error`` saying how): the caller leaves it out of training and goes on. The time
limit cancels what it waits on, so it cannot stop an environment that blocks the event loop
(synchronous code in an async method). An episode ends with the model's reply, never with an
observation nobody answered; one that ends before the model's first reply has nothing to train on
and counts as failed.

The episode becomes samples in one of two shapes (``clawrl.envs.source``): one trajectory (the
first prompt, then every sampled and in-between id as the response, the loss mask 1 exactly on
sampled ids, in-between ids carrying logprob 0 and the version of the turn before), or one sample
per turn with exactly the context that turn saw (``Episode.turn_contexts``). An optional step judge
(the PRM judge) scores each turn from the observation that followed it (``Episode.step_scores``),
concurrently with the next turn.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from clawrl.engines.base import ContextLengthExceeded, Engine, GenerateResult, SamplingParams
from clawrl.engines.chat_template import render_chat
from clawrl.engines.model_defaults import end_of_turn_ids
from clawrl.envs.base import Env, EnvError, Observation, StepOutcome, Task
from clawrl.judges.base import Judge, JudgeInput, message_text

log = logging.getLogger(__name__)

# Why an episode ended, when the rollout rather than the environment decided it.
MAX_TURNS = "max_turns"
MAX_TOTAL_TOKENS = "max_total_tokens"
EPISODE_TIMEOUT = "episode_timeout"
CONTEXT_LENGTH = "context_length"
FAILED = "failed"
# Stands in for a reply while the template renders what follows it; plain ASCII that no template
# rewrites (Qwen3 splits an assistant's content at </think>, so the marker has none).
_MARK = "CLAWRL7REPLY7MARK"


@dataclass
class Episode:
    """A finished episode: the token-exact trajectory and what the environment said."""

    task: Task
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    reward: float
    turns: int
    done: bool
    truncated: bool
    sampled: list[list[int]] = field(default_factory=list)  # each turn's sampled ids, as the engine gave them
    info: dict = field(default_factory=dict)
    transcript: list[dict] = field(default_factory=list)  # the conversation as text, for people to read
    failed: bool = False  # the environment failed (raised, timed out): nothing here trains
    error: Optional[str] = None  # how it failed, one line
    reason: str = ""  # why it ended: the environment's info["reason"], else done, or the limit that cut it
    malformed: int = 0  # replies the environment answered with info["malformed"]
    turn_starts: list[int] = field(default_factory=list)  # where each turn's sampled ids begin in response_ids
    step_scores: list[Optional[int]] = field(default_factory=list)  # per turn, the step judge's -1/0/+1 or None

    def turn_contexts(self) -> list[tuple[list[int], int, int]]:
        """Per model turn: the exact ids it was sampled from, and where its sampled ids lie in
        ``response_ids`` (start, end)."""
        return [(self.prompt_ids + self.response_ids[:start], start, start + len(ids))
                for start, ids in zip(self.turn_starts, self.sampled)]


def failed_episode(task: Task, error: str) -> Episode:
    """An episode that never started (its environment could not be made): failed, empty."""
    return Episode(task=task, prompt_ids=[], response_ids=[], loss_mask=[], logprobs=[], weight_versions=[],
                   reward=0.0, turns=0, done=False, truncated=False, failed=True, error=error, reason=FAILED)


class _EnvFailed(Exception):
    """The environment failed this episode; the message says how, in one line."""


class _OutOfTime(Exception):
    """The episode's wall-clock limit passed while waiting on ``what``."""


class _Clock:
    """A wall-clock limit: awaits bounded by what is left of it (None: no limit)."""

    def __init__(self, seconds: Optional[float]):
        self.seconds = seconds
        self.deadline = None if seconds is None else time.monotonic() + seconds

    async def run(self, make: Callable[[], Awaitable], what: str):
        if self.deadline is None:
            return await make()
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _OutOfTime(what)
        try:
            return await asyncio.wait_for(make(), left)
        except asyncio.TimeoutError:
            if time.monotonic() < self.deadline:  # the awaited code's own TimeoutError, not ours
                raise
            raise _OutOfTime(what) from None


def _outcome(outcome, what: str) -> StepOutcome:
    """``outcome`` when it is a well-formed StepOutcome (its reward None or a finite number, which
    group statistics can use); otherwise the environment failed."""
    if not isinstance(outcome, StepOutcome):
        raise _EnvFailed(f"env.{what} returned {type(outcome).__name__}, not a StepOutcome")
    if outcome.reward is not None:
        try:
            reward = float(outcome.reward)
        except (TypeError, ValueError):
            raise _EnvFailed(f"env.{what} gave the reward {outcome.reward!r}, not a number") from None
        if not math.isfinite(reward):
            raise _EnvFailed(f"env.{what} gave the reward {reward}, not a finite number")
    if not isinstance(outcome.info, dict):
        raise _EnvFailed(f"env.{what} gave info as a {type(outcome.info).__name__}, not a dict")
    if outcome.observation is not None and not isinstance(outcome.observation, Observation):
        raise _EnvFailed(f"env.{what} gave a {type(outcome.observation).__name__} observation, not an Observation")
    return outcome


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


async def run_episode(engine: Engine, tokenizer, env: Env, task: Task, params: SamplingParams, max_turns: int, *,
                      max_total_tokens: Optional[int] = None, timeout_s: Optional[float] = None,
                      step_judge: Optional[Judge] = None) -> Episode:
    """Roll out ``task`` in ``env`` with ``engine`` for at most ``max_turns`` model turns, at most
    ``params.max_new_tokens`` tokens a turn and ``max_total_tokens`` in all (None: the engine's
    context window), within ``timeout_s`` seconds (None: no limit). ``finish`` and ``close`` get a
    window of ``timeout_s`` of their own: judging the final state is not the agent's time.
    ``step_judge`` (a PRM judge) scores each turn from the observation that followed it
    (``Episode.step_scores``), while the next turn runs.

    The reward is the last one the environment gave (0 when it never gave one). An environment
    failure is recorded on the episode (``failed``, ``error``), never raised; engine errors are
    raised. The environment is closed whatever happens."""
    if max_turns < 1:
        raise EnvError(f"max_turns must be >= 1, got {max_turns}")
    if max_total_tokens is not None and max_total_tokens < 2:
        raise EnvError(f"max_total_tokens must be >= 2, got {max_total_tokens}")
    if timeout_s is not None and not timeout_s > 0:
        raise EnvError(f"timeout_s must be > 0, got {timeout_s}")
    loop = _Rollout(engine, tokenizer, env, task, params, max_turns, max_total_tokens, timeout_s, step_judge)
    try:
        await loop.run()
    finally:
        await loop.close()
    return loop.episode


class _Rollout:
    """The state of one episode while it runs (``run_episode``)."""

    def __init__(self, engine, tokenizer, env: Env, task: Task, params: SamplingParams, max_turns: int,
                 max_total_tokens: Optional[int], timeout_s: Optional[float], step_judge: Optional[Judge] = None):
        self.engine, self.tokenizer, self.env, self.task = engine, tokenizer, env, task
        self.params, self.max_turns = params, max_turns
        self.max_total_tokens, self.timeout_s = max_total_tokens, timeout_s
        self.clock = _Clock(timeout_s)
        self.episode = Episode(task=task, prompt_ids=[], response_ids=[], loss_mask=[], logprobs=[],
                               weight_versions=[], reward=0.0, turns=0, done=False, truncated=False)
        self.reward: Optional[float] = None
        self.messages: list[dict] = []  # the conversation so far, replies as decoded text
        self.tools: Optional[list[dict]] = None
        self.stop_ids: set[int] = set()
        self.step_judge = step_judge
        self.judging: list[asyncio.Task] = []  # one per judged turn, awaited when the episode ends

    async def run(self) -> None:
        ep = self.episode
        try:
            first = await self._env_call(lambda: self.env.reset(self.task), "reset", self.clock)
            if not isinstance(first, Observation):
                raise _EnvFailed(f"reset returned {type(first).__name__}, not an Observation")
            self.tools = first.tools or None
            self.messages = list(first.messages)
            ep.transcript = list(self.messages)
            ep.prompt_ids = self._ids(self._render(self.messages, True))
            self.stop_ids = self._stop_ids()
            await self._turns()
        except _EnvFailed as e:
            ep.failed, ep.error, ep.reason = True, str(e), FAILED
        ep.step_scores = await self._step_scores()
        if not ep.failed and ep.turns == 0:  # a limit ended it before the model said anything
            ep.failed, ep.error = True, f"{ep.reason} ended the episode before the model's first reply"
            ep.reason = FAILED
        ep.reward = 0.0 if self.reward is None else float(self.reward)

    async def _turns(self) -> None:
        ep = self.episode
        pending: list[int] = []  # the last observation's ids, waiting for a reply (dropped if none comes)
        for turn in range(self.max_turns):
            context = ep.prompt_ids + ep.response_ids + pending
            budget = self.params.max_new_tokens
            if self.max_total_tokens is not None:
                budget = min(budget, self.max_total_tokens - len(context))
                if budget < 1:
                    return await self._cut(MAX_TOTAL_TOKENS)
            try:
                result = await self._generate(context, budget)
            except _OutOfTime:
                return await self._cut(EPISODE_TIMEOUT)
            if result is None:
                return await self._cut(CONTEXT_LENGTH)
            if result.finish_reason == "abort":
                raise _EnvFailed("the engine aborted the turn's request")
            ids = list(result.token_ids)
            last_version = ep.weight_versions[-1] if ep.weight_versions else 0
            ep.turn_starts.append(len(ep.response_ids) + len(pending))
            ep.response_ids += pending + ids
            ep.loss_mask += [0] * len(pending) + [1] * len(ids)
            ep.logprobs += [0.0] * len(pending) + list(result.logprobs)
            ep.weight_versions += [last_version] * len(pending) + list(result.weight_versions)
            ep.sampled.append(ids)
            ep.turns = len(ep.sampled)
            reply = self._reply_text(ids)
            ep.transcript.append({"role": "assistant", "content": reply})
            outcome = _outcome(await self._env_call(lambda: self.env.step(reply), "step", self.clock), "step")
            info = dict(outcome.info)
            ep.info = info
            ep.malformed += bool(info.get("malformed"))
            if outcome.reward is not None:
                self.reward = outcome.reward
            if outcome.done or outcome.truncated or outcome.observation is None:
                ep.done, ep.truncated = outcome.done, outcome.truncated
                ep.reason = str(info.get("reason") or ("done" if outcome.done else "truncated" if outcome.truncated
                                                       else "ended"))
                return
            if self.step_judge is not None:  # the observation is the turn's next state, even one nobody answers
                self.judging.append(asyncio.ensure_future(self._judge_step(self._step_item(turn, reply, outcome))))
            if turn == self.max_turns - 1:  # out of turns: the unanswered observation is not part of the episode
                return await self._cut(MAX_TURNS)
            pending = self._between(ids, outcome.observation)
            self.messages += [{"role": "assistant", "content": reply}, *outcome.observation.messages]
            ep.transcript += outcome.observation.messages

    def _step_item(self, turn: int, reply: str, outcome: StepOutcome) -> JudgeInput:
        """What the step judge reads of a turn: the last user message before the reply (the
        request), the reply, and the observation after it (the next state)."""
        request = next((message_text(m) for m in reversed(self.messages) if m.get("role") == "user"), "")
        return JudgeInput(turn_id=turn, request=request, reply=reply, tool_calls=None,
                          next_state=list(outcome.observation.messages), messages=list(self.messages))

    async def _judge_step(self, item: JudgeInput) -> tuple[int, Optional[int]]:
        """(turn, the step judge's score of it); None when the judge had no verdict (garbage votes),
        failed or ran out of the episode's time: a step score is evidence, never a reason to fail."""
        turn = item.turn_id
        try:
            verdict = await self.clock.run(lambda: self.step_judge.judge(item), "step_judge")
        except _OutOfTime:
            return turn, None
        except Exception as e:
            log.warning("episode of task %s: the step judge failed on turn %d: %s", self.task.task_id, turn,
                        _one_line(e))
            return turn, None
        return turn, None if verdict.garbage else int(verdict.score)

    async def _step_scores(self) -> list[Optional[int]]:
        """One score per turn: the judged ones, None for the rest (the last turn has no next state)."""
        scores: list[Optional[int]] = [None] * self.episode.turns
        if self.judging:
            for turn, score in await asyncio.gather(*self.judging):
                scores[turn] = score
        return scores

    async def _generate(self, context: list[int], budget: int) -> Optional[GenerateResult]:
        """The engine's reply to ``context`` in at most ``budget`` tokens, fewer when the context
        window has less room; None when it has none."""
        params = dataclasses.replace(self.params, max_new_tokens=budget)
        try:
            return await self.clock.run(lambda: self.engine.generate(context, params), "generate")
        except ContextLengthExceeded as e:
            room = e.max_context - e.prompt_tokens
            if room < 1 or room >= budget:
                return None
            params = dataclasses.replace(params, max_new_tokens=room)
            return await self.clock.run(lambda: self.engine.generate(context, params), "generate")

    async def _cut(self, reason: str) -> None:
        """A limit ends the episode: truncated, and judged by the environment as it stands."""
        ep = self.episode
        ep.truncated, ep.done, ep.reason = True, False, reason
        if ep.turns == 0:
            return
        final = await self._env_call(self.env.finish, "finish", _Clock(self.timeout_s))
        if final is not None:
            final = _outcome(final, "finish")
            if final.reward is not None:
                self.reward = final.reward
            ep.info = dict(final.info)

    async def _env_call(self, make: Callable[[], Awaitable], what: str, clock: _Clock):
        """An environment call within ``clock``; whatever goes wrong in it fails the episode."""
        try:
            return await clock.run(make, what)
        except _OutOfTime:
            raise _EnvFailed(f"timeout: env.{what} ran past env.episode_timeout_s ({clock.seconds:g} s)") from None
        except Exception as e:
            raise _EnvFailed(f"env.{what} raised {_one_line(e)}") from e

    async def close(self) -> None:
        """Close the environment (bounded like ``finish``); a failure to close is logged and noted
        in ``info``, since the episode itself is whole. Step judgements still running (the engine
        failed mid-episode) are cancelled."""
        for judging in self.judging:
            judging.cancel()
        try:
            await _Clock(self.timeout_s).run(self.env.close, "close")
        except _OutOfTime:
            self._close_failed(f"timeout: env.close ran past {self.timeout_s:g} s")
        except Exception as e:
            self._close_failed(f"env.close raised {_one_line(e)}")

    def _close_failed(self, why: str) -> None:
        log.warning("episode of task %s: %s", self.task.task_id, why)
        self.episode.info = {**self.episode.info, "close_error": why}

    # ----- text and ids

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return render_chat(self.tokenizer, messages, self.tools, generation_prompt)
        except Exception as e:  # the environment's messages are what the template refuses
            raise _EnvFailed(f"the chat template cannot render the environment's messages: {_one_line(e)}") from e

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _after_reply(self, observation: Optional[Observation]) -> str:
        """What the template renders after an assistant reply: its closing alone (no observation),
        or the closing, the observation and the next assistant message's opening."""
        history = self.messages + [{"role": "assistant", "content": _MARK}]
        rendered = self._render(history + observation.messages, True) if observation else self._render(history, False)
        at = rendered.rfind(_MARK)
        if at < 0:
            raise _EnvFailed("the chat template does not render the assistant's reply; its tokens cannot be kept")
        return rendered[at + len(_MARK):]

    def _stop_ids(self) -> set[int]:
        """Ids that end a reply rather than belong to it: the model's end-of-turn tokens, and the
        special tokens the template closes an assistant message with (``<|im_end|>``)."""
        tok = self.tokenizer
        stops = set(end_of_turn_ids(tok))
        special = set(tok.all_special_ids)
        for i in self._ids(self._after_reply(None)):
            if i not in special:
                break
            stops.add(i)
        return stops

    def _reply_text(self, ids: list[int]) -> str:
        """The reply as the environment reads it: special tokens kept, the closing ones dropped."""
        end = len(ids)
        while end and ids[end - 1] in self.stop_ids:
            end -= 1
        return self.tokenizer.decode(ids[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _between(self, ids: list[int], observation: Observation) -> list[int]:
        """The ids that follow the sampled ``ids``: the template's closing of the reply (less the
        end-of-turn token the model sampled itself), the observation, the next assistant opening."""
        tail = self._after_reply(observation)
        if ids and ids[-1] in self.stop_ids:
            closing = self.tokenizer.convert_ids_to_tokens(ids[-1])
            if tail.startswith(closing):
                tail = tail[len(closing):]
        return self._ids(tail)
