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

import logging
import re
from typing import Optional

from clawrl.engines.base import Engine
from clawrl.judges.base import Judge, JudgeInput, Verdict, Vote, majority
from clawrl.judges.model_votes import ModelVoter

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


class PRMJudge(ModelVoter, Judge):
    """Majority vote of ``votes`` sampled judgements from ``engine`` (see the module docstring)."""

    kind = "prm"

    system_prompt, instruction = SYSTEM_PROMPT, INSTRUCTION
    votes_key, role = "judge.votes", "PRM judge"

    def __init__(self, engine: Engine, tokenizer=None, votes: int = 3, temperature: float = 0.8,
                 max_new_tokens: int = 256, seed: int = 0, section_chars: int = 6000):
        super().__init__(engine, tokenizer, votes, temperature, max_new_tokens, seed, section_chars)

    async def judge(self, item: JudgeInput) -> Verdict:
        votes = []
        for text in await self.sample_votes(item):
            score = parse_score(text)
            rationale = text.strip() if score is not None else "garbage: no final 'Score: +1|-1|0' line"
            votes.append(Vote(score, rationale[:1000], text))
        return Verdict(majority([v.score for v in votes]), votes, self.kind)
