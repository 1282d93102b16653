"""The rules judge: explicit feedback in the next state, the default when no judge model is set.

It only scores what a user or a tool says *unambiguously*; anything else is "no explicit
feedback" (score 0, ``signal=False``), which the buffer skips rather than trains on as neutral.
Each rule has a name, recorded as the vote's rationale, so every reward can be traced to a rule.

User messages of the next state (OpenClaw's timestamp prefix ``[Wed ...]``, its ``Runtime:``
line and its internal-context trailer removed; lower-cased, curly apostrophes straightened):

First, phrases whose words would otherwise fire the wrong rule are consumed:

- ``not_bad`` (+1): "not bad", "not too bad".
- ``nothing_wrong`` (+1): "nothing wrong", "not wrong", "isn't wrong".
- courtesy (no score, just consumed): "no problem", "no worries", "no rush", "no need",
  "no thanks" (declining an offer is not praise), "not a problem", "not an issue", "not a big deal".
- ``negated_praise`` (-1): "not right/correct/great/good/perfect/helpful/accurate/true",
  "isn't quite right", "not what I asked/wanted/meant/needed".

Then, on what is left:

- ``thumbs_up`` (+1): a thumbs-up emoji. ``positive_emoji`` (+1): ok-hand, check mark, heart,
  folded hands, party popper, smiling faces.
- ``thanks`` (+1): thanks, thank you, thx, cheers, appreciate it.
- ``praise`` (+1): great, perfect, excellent, awesome, amazing, brilliant, nice, well done,
  good job, spot on, exactly, love it, nailed it.
- ``correct`` (+1): correct, that's right, you're right, that works, it works, works now, that
  fixed it -- not inside a question ("is that correct?").
- ``thumbs_down`` (-1): a thumbs-down emoji. ``negative_emoji`` (-1): angry face, facepalm.
- ``wrong`` (-1): wrong, incorrect, inaccurate, mistaken -- not inside a question ("what's wrong
  with my code?" asks for help, it does not judge the reply).
- ``thats_not`` (-1): "that's not", "this is not", "it's not".
- ``no_correction`` (-1): a sentence opening with "no"/"nope"/"nah" followed by punctuation or
  by "that/it/this/you/I/the/wrong/not/actually" ("No, use the other file.", "No.").
- ``retry`` (-1): try again, retry, redo, do it again, start over, one more time.
- ``not_working`` (-1): doesn't/didn't/won't work, not working, still broken/failing/wrong.
- ``complaint`` (-1): too long/short/verbose/wordy/vague/complicated.

Tool messages of the next state:

- ``nonzero_exit`` (-1): an exit/return code other than 0 ("exit code 1", ``"exitCode": 2``).
- ``tool_error`` (-1): a Python traceback, a line starting with error/fatal/exception, an
  ``"error"`` field that is not empty/null, ``"status": "error"``, ``"isError": true``,
  "command not found", "no such file or directory", "permission denied".

Combining: any negative rule makes the score -1 (a correction outweighs courtesy: "thanks, but
that's wrong" is a correction); else any positive rule gives +1; else 0 without signal.
"""
from __future__ import annotations

import re

from clawrl.judges.base import Judge, JudgeInput, Verdict, Vote, message_text

NO_FEEDBACK = "no explicit feedback"

_OPENCLAW_NOISE = [
    re.compile(r"^\s*(?:\[[^\]\n]{3,60}\]\s*)+"),  # "[Wed 2026-12-02 13:12 UTC] "
    re.compile(r"^runtime: agent=.*$", re.M),  # OpenClaw's runtime line appended to user messages
]
_TRANSIENT = "<<<begin_openclaw_internal_context>>>"

_CONSUMED: list[tuple[str, int, re.Pattern]] = [
    ("not_bad", 1, re.compile(r"\bnot (?:too |so |that |half )?bad\b")),
    ("nothing_wrong", 1, re.compile(r"\b(?:nothing(?: is)?|not|isn't|wasn't) wrong\b")),
    ("courtesy", 0, re.compile(
        r"\bno,? (?:problem|problems|worries|worry|rush|hurry|need|pressure|biggie)\b"
        r"|\bno,? (?:thanks|thank you|thx)\b|\bnot (?:a|an) (?:problem|issue|big deal)\b")),
    ("negated_praise", -1, re.compile(
        r"(?:\bnot|n't) (?:quite |really |very |exactly |entirely |so |that |too )?"
        r"(?:right|correct|great|good|perfect|helpful|useful|accurate|true)\b"
        r"|\bnot what i (?:asked|wanted|meant|said|needed)\b")),
]

_SENTENCE_RULES: list[tuple[str, int, re.Pattern, bool]] = [
    # (name, score, pattern, applies inside a question)
    ("thumbs_up", 1, re.compile("\U0001F44D"), True),
    ("positive_emoji", 1, re.compile("[\U0001F44C\u2705\u2764\U0001F64F\U0001F389\U0001F60A\U0001F642\U0001F600\U0001F604]"), True),
    ("thanks", 1, re.compile(r"\b(?:thanks|thank you|thank u|thx|cheers|appreciate it)\b"), True),
    ("praise", 1, re.compile(
        r"\b(?:great|perfect|excellent|awesome|amazing|fantastic|brilliant|nice|well done|good job|spot on"
        r"|exactly|love it|nailed it)\b"), True),
    ("correct", 1, re.compile(
        r"\b(?:correct|that's right|that is right|you're right|you are right|that works|it works|works now"
        r"|that fixed it|that did it)\b"), False),
    ("thumbs_down", -1, re.compile("\U0001F44E"), True),
    ("negative_emoji", -1, re.compile("[\U0001F620\U0001F621\U0001F926]"), True),
    ("wrong", -1, re.compile(r"\b(?:wrong|incorrect|inaccurate|mistaken)\b"), False),
    ("thats_not", -1, re.compile(r"\b(?:that|this|it)(?:'s| is|s) not\b"), True),
    ("no_correction", -1, re.compile(
        r"^(?:no|nope|nah)(?:\s*[,.!;:\u2014-]|\s*$|\s+(?:that|it|this|you|i|the|wrong|not|actually)\b)"), True),
    ("retry", -1, re.compile(r"\b(?:try again|retry|redo|re-do|do it again|start over|one more time)\b"), True),
    ("not_working", -1, re.compile(
        r"\b(?:doesn't|does not|didn't|did not|won't|will not|isn't|is not) work(?:ing|s)?\b|\bnot working\b"
        r"|\bstill (?:broken|failing|wrong)\b"), True),
    ("complaint", -1, re.compile(r"\btoo (?:long|short|verbose|wordy|vague|complicated)\b"), True),
]

_TOOL_RULES: list[tuple[str, re.Pattern]] = [
    ("tool_error", re.compile(
        r"traceback \(most recent call last\)|^\s*(?:error|fatal|exception)\b"
        r"|\"error\"\s*:(?!\s*(?:null|false|\"\"|\{\s*\}|\[\s*\]))|\"status\"\s*:\s*\"(?:error|failed|failure)\""
        r"|\"iserror\"\s*:\s*true|command not found|no such file or directory|permission denied", re.M)),
]
_EXIT_CODE = re.compile(
    r"(?:exit(?:ed)?[ _]?(?:with[ _])?(?:status|code)|exitcode|return[ _]?code|returncode)\"?\s*[:=]?\s*(-?\d+)")


def _clean_user_text(text: str) -> str:
    text = text.replace("\u2019", "'").replace("\u2018", "'").lower()
    if text.lstrip().startswith(_TRANSIENT):
        return ""
    for pattern in _OPENCLAW_NOISE:
        text = pattern.sub(" ", text)
    return text


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?\n])", text) if s.strip()]


def user_feedback(text: str) -> list[tuple[str, int, str]]:
    """(rule, score, matched text) for every rule that fires on one user message."""
    text = _clean_user_text(text)
    hits = []
    for name, score, pattern in _CONSUMED:
        for m in pattern.finditer(text):
            if score:
                hits.append((name, score, m.group(0)))
        text = pattern.sub(" \u00b7 ", text)  # a separator, so consumed words cannot join their neighbours
    for sentence in _sentences(text):
        question = sentence.endswith("?")
        for name, score, pattern, in_question in _SENTENCE_RULES:
            if question and not in_question:
                continue
            m = pattern.search(sentence)
            if m:
                hits.append((name, score, m.group(0)))
    return hits


def tool_feedback(text: str) -> list[tuple[str, int, str]]:
    """(rule, -1, matched text) for every failure sign in one tool result."""
    text = text.lower()
    hits = [(name, -1, m.group(0)) for name, pattern in _TOOL_RULES if (m := pattern.search(text))]
    for m in _EXIT_CODE.finditer(text):
        if int(m.group(1)) != 0:
            hits.append(("nonzero_exit", -1, m.group(0)))
            break
    return hits


class RulesJudge(Judge):
    """Scores explicit feedback in the next state; see the module docstring for the rules."""

    kind = "rules"

    def score(self, item: JudgeInput) -> Verdict:
        hits = []
        for message in item.next_state:
            role = message.get("role")
            if role == "user":
                hits += user_feedback(message_text(message))
            elif role == "tool":
                hits += tool_feedback(message_text(message))
        negative = [h for h in hits if h[1] < 0]
        positive = [h for h in hits if h[1] > 0]
        fired = negative or positive
        if not fired:
            return Verdict(0, [Vote(0, NO_FEEDBACK, "")], self.kind, signal=False)
        score = -1 if negative else 1
        rationale = ", ".join(dict.fromkeys(name for name, _, _ in fired))
        if negative and positive:
            rationale += " (over " + ", ".join(dict.fromkeys(name for name, _, _ in positive)) + ")"
        raw = " | ".join(match for _, _, match in fired)
        return Verdict(score, [Vote(score, rationale, raw)], self.kind)

    async def judge(self, item: JudgeInput) -> Verdict:
        return self.score(item)
