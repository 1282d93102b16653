"""The model judge (PRM): a language model reads the turn and its next state and votes.

The idea (from OpenClaw-RL's process reward model): what happens right after a reply -- the
user's next message, the tool's output -- is evidence of whether the reply was good, and a judge
model can read that evidence in plain language where keyword rules cannot. The judge is shown the
user's request, the assistant's reply (text and tool calls) and the full next state, and asked to
reason briefly and end with ``Score: +1``, ``Score: -1`` or ``Score: 0``.

``votes`` samples are drawn (temperature ~0.8, a distinct seed each, concurrently so the engine
batches them); each is parsed on its own. A vote without a final score line is garbage (kept,
with its raw text). The majority of the parseable votes decides; a tie gives 0; when no vote
parses the verdict is garbage and the buffer skips the turn (``judge_garbage``).

The engine is the orchestrator's choice: one serving ``judge.model.path``, or a frozen copy of
the base policy whose weights are never updated. The prompt is rendered with that engine's own
chat template, so any chat model can judge.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Optional

from clawrl.engines.base import Engine, SamplingParams
from clawrl.judges.base import Judge, JudgeError, JudgeInput, Verdict, Vote, majority, message_text

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a strict reward judge for an AI assistant. You see a user's request, the assistant's reply, "
    "and what happened next (the next state): tool results and/or the user's next message. Judge the reply "
    "only by the evidence in the next state. +1: the next state shows the reply helped (the user is satisfied "
    "or moves on, the tool call succeeded). -1: the next state shows the reply was wrong or unhelpful (the user "
    "corrects, complains or repeats the request; the tool call failed). 0: the next state says nothing about "
    "the reply's quality."
)
INSTRUCTION = "Think in at most three sentences, then end with one line exactly like `Score: +1`, `Score: -1` or `Score: 0`."

_SCORE_LINE = re.compile(r"score\s*[:=]\s*\**\s*([+-]?)\s*([01])(?![\d.])", re.I)
_BOXED = re.compile(r"\\boxed\{\s*([+-]?)\s*([01])\s*\}")


def parse_score(text: str) -> Optional[int]:
    """The last ``Score: +1|-1|0`` (or ``\\boxed{..}``) in ``text``; None if there is none."""
    matches = [(m.start(), m) for m in _SCORE_LINE.finditer(text)] + [(m.start(), m) for m in _BOXED.finditer(text)]
    if not matches:
        return None
    m = max(matches, key=lambda x: x[0])[1]
    value = int(m.group(2))
    if value == 0:
        return 0
    return -1 if m.group(1) == "-" else 1


def _render_reply(item: JudgeInput, limit: int) -> str:
    parts = [item.reply] if item.reply else []
    for call in item.tool_calls or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        parts.append(f"[tool call] {fn.get('name')}({args if isinstance(args, str) else json.dumps(args)})")
    return _clip("\n".join(parts) or "(empty reply)", limit)


def _render_next_state(item: JudgeInput, limit: int) -> str:
    lines = [f"[{m.get('role', '?')}] {message_text(m)}" for m in item.next_state]
    return _clip("\n".join(lines) or "(nothing)", limit)


def _clip(text: str, limit: int) -> str:
    """Keep the head and the tail of an over-long section: both usually matter (a command and its exit)."""
    if len(text) <= limit:
        return text
    half = max(limit // 2, 1)
    return text[:half] + f"\n... [{len(text) - 2 * half} characters cut] ...\n" + text[-half:]


class PRMJudge(Judge):
    """Majority vote of ``votes`` sampled judgements from ``engine`` (see the module docstring)."""

    kind = "prm"

    def __init__(self, engine: Engine, tokenizer=None, votes: int = 3, temperature: float = 0.8,
                 max_new_tokens: int = 256, seed: int = 0, section_chars: int = 6000):
        tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise JudgeError("the PRM judge needs its engine's tokenizer with a chat template")
        if votes < 1:
            raise JudgeError(f"judge.votes must be at least 1, not {votes}")
        self.engine, self.tokenizer = engine, tokenizer
        self.votes, self.temperature, self.max_new_tokens = votes, temperature, max_new_tokens
        self.seed, self.section_chars = seed, section_chars
        self.attempts = 0  # distinct seeds for a retried turn

    def messages(self, item: JudgeInput, limit: Optional[int] = None) -> list[dict]:
        limit = limit or self.section_chars
        body = (
            f"## User request\n{_clip(item.request or '(no user message)', limit)}\n\n"
            f"## Assistant reply\n{_render_reply(item, limit)}\n\n"
            f"## Next state\n{_render_next_state(item, limit)}\n\n{INSTRUCTION}"
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": body}]

    def prompt_ids(self, item: JudgeInput) -> list[int]:
        """The rendered judge prompt, sections shortened until it fits the judge's context."""
        budget = self.engine.model_info().max_context - self.max_new_tokens
        limit = self.section_chars
        while True:
            text = self.tokenizer.apply_chat_template(self.messages(item, limit), add_generation_prompt=True,
                                                      tokenize=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= budget:
                return ids
            if limit <= 64:
                raise JudgeError(f"the judge prompt needs {len(ids)} tokens even with sections cut to {limit} "
                                 f"characters; the judge's context leaves {budget}")
            limit //= 2

    async def judge(self, item: JudgeInput) -> Verdict:
        ids = self.prompt_ids(item)
        self.attempts += 1
        base = self.seed + 1_000_003 * item.turn_id + 10_007 * self.attempts
        results = await asyncio.gather(*(
            self.engine.generate(ids, SamplingParams(max_new_tokens=self.max_new_tokens,
                                                     temperature=self.temperature, seed=base + i))
            for i in range(self.votes)
        ))
        votes = []
        for r in results:
            text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            score = parse_score(text)
            rationale = text.strip() if score is not None else "garbage: no final 'Score: +1|-1|0' line"
            votes.append(Vote(score, rationale[:1000], text))
        return Verdict(majority([v.score for v in votes]), votes, self.kind)
