"""The judge interface: a turn plus what happened next in, a score in {-1, 0, +1} out.

A judge sees what the user asked (the last user message of the turn's request), what the
assistant answered (text and tool calls) and the turn's *next state*: the tool results and/or the
next user message that followed the reply. The next state is evidence of how good the reply was
(a correction, a thank-you, a failed command), which is the signal clawrl learns from.

Every vote a judge casts is kept (score, rationale, raw text) so a reward can always be traced
back to why it was given. A vote whose text could not be parsed has ``score=None`` (garbage).
"""
from __future__ import annotations

import abc
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

SCORES = (-1, 0, 1)


class JudgeError(RuntimeError):
    """A judge cannot be built or cannot run (e.g. no engine for a model judge); one line."""


def message_text(message: dict) -> str:
    """The text of a (normalised or OpenAI-form) message: a string, or its text parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return str(content)


@dataclass(frozen=True)
class JudgeInput:
    """One turn to judge. ``next_state`` is the list of messages that followed the reply."""

    turn_id: int
    request: str  # the last user message of the turn's request ("" if the request had none)
    reply: str  # the assistant's reply text, as the client received it
    tool_calls: Optional[list]  # the reply's tool calls (OpenAI form) or None
    next_state: list  # tool results and/or the next user message
    messages: list = field(default_factory=list)  # the turn's full request messages, for judges that want context

    @classmethod
    def from_turn(cls, turn: dict) -> "JudgeInput":
        """Build from a stored turn (``TurnStore.get_turn``). The request is looked for in the
        history only: a trailer the client does not keep (OpenClaw's internal context) is no request."""
        messages = turn.get("messages") or []
        history = messages[: turn.get("history_len", len(messages))]
        request = next((message_text(m) for m in reversed(history) if m.get("role") == "user"), "")
        return cls(turn_id=turn["turn_id"], request=request, reply=turn.get("response_text") or "",
                   tool_calls=turn.get("tool_calls"), next_state=turn.get("next_state") or [], messages=messages)


@dataclass(frozen=True)
class Vote:
    score: Optional[int]  # -1, 0, +1; None: the vote could not be parsed (garbage)
    rationale: str  # why: a rule name, or the judge model's reasoning
    raw: str = ""  # the judge's raw output (model text, matched phrase)


@dataclass(frozen=True)
class Verdict:
    """The outcome of judging one turn.

    ``signal`` is False when the judge found no evidence either way (the rules judge saw no
    explicit feedback, no environment verdict applied): the 0 then means "unknown", not "neutral".
    ``garbage`` is True when no vote could be parsed; ``score`` is then 0 and meaningless.
    """

    score: int
    votes: list
    kind: str
    signal: bool = True

    @property
    def garbage(self) -> bool:
        return not any(v.score is not None for v in self.votes)

    @property
    def rationale(self) -> str:
        return "; ".join(v.rationale for v in self.votes if v.score == self.score) or "no valid vote"


def majority(scores: Sequence[Optional[int]]) -> int:
    """The most common valid score; a tie between the top scores (or no valid score) gives 0."""
    counts = Counter(s for s in scores if s is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


class Judge(abc.ABC):
    """Scores turns. Implementations must be safe to call concurrently from one event loop."""

    kind: str = "judge"

    @abc.abstractmethod
    async def judge(self, item: JudgeInput) -> Verdict:
        """Judge one turn. Unparseable output is a garbage vote, not an exception."""
