"""Hint judges: does turn t's next state hold hindsight that would have improved turn t, and what?

On-policy distillation (OPD) needs more than a score: "Too long. One line, and no rhymes please."
says what the reply should have been. A hint judge reads the turn and its next state and either
*accepts* with a short, actionable hint ("Answer in one line, without rhymes.") or *rejects*
(a thank-you, a new question, chit-chat: nothing says how turn t could have been better). The
teacher then scores turn t's sampled tokens under the prompt with the hint appended
(``clawrl.methods.opd.teacher``).

Two judges:

- ``RulesHintJudge``: a clause extractor for natural corrections in the tiny model's domain and
  common formatting complaints (length, one line/word, just the answer, rhymes, bold, markdown,
  emoji, upper/lower case, start/end with, show the working, more detail, a language, a stated
  correct answer, "use X instead", "don't X"). One deterministic vote.
- ``ModelHintJudge``: ``votes`` sampled judgements from an ``Engine`` (like the PRM judge), each
  ending ``Decision: accept`` + ``Hint: ...`` or ``Decision: reject``.

**Choosing among the votes** (``choose_hint``, the same for both):

1. A vote is an *accept* (decision accept and a usable hint: 2-200 characters, words not only
   punctuation, no prompt-format debris), a *reject*, a *garbage hint* (accept whose hint is
   missing or unusable) or *garbage* (no decision could be parsed).
2. Accept only if accepts are a strict majority of **all** votes cast (garbage counts against
   acceptance: a judge that cannot answer is not evidence). Otherwise reject with the reason:
   ``no_hindsight`` (rejects are a majority), ``hint_garbage`` (accept decisions are a majority but
   too few came with a usable hint), ``judge_garbage`` (no vote parsed), else ``vote_split``.
   The rules judge adds ``not_actionable``: the user corrected the reply (the rules reward judge
   scores it -1) but nothing says what to do instead ("No, that's wrong.").
3. Among the accepted hints, pick the one **most supported by the others**: its consensus is the
   mean token-overlap (Dice coefficient of content-word sets) with every other accepted hint.
   Highest consensus wins; ties (within 1e-9) go to the shortest hint, then the earliest vote.
   A hallucinated extra instruction makes a hint longer and *less* like the others, so this rule
   resists exactly the failure that "take the longest" rewards (``benchmarks/bench_hints.py``
   measures both over the same votes).
"""
from __future__ import annotations

import abc
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from clawrl.engines.base import Engine
from clawrl.judges.base import JudgeError, JudgeInput, message_text
from clawrl.judges.model_votes import ModelVoter
from clawrl.judges.rules import _OPENCLAW_NOISE, _TRANSIENT, user_feedback

if TYPE_CHECKING:
    from clawrl.config import OpdConfig

log = logging.getLogger(__name__)

HINT_KINDS = ("rules", "model")
REJECT_REASONS = ("no_hindsight", "not_actionable", "vote_split", "hint_garbage", "judge_garbage")
MAX_HINT_CHARS = 200
_TIE = 1e-9


# --- votes, verdicts and the selection rule --------------------------------------------------------


@dataclass(frozen=True)
class HintVote:
    accept: Optional[bool]  # True: accept, False: reject, None: no decision could be parsed (garbage)
    hint: str  # the usable hint of an accept vote; "" otherwise
    rationale: str  # why: the rules that fired, or the judge's text / what made it garbage
    raw: str = ""  # the judge's raw output (model text or the feedback message)

    @property
    def garbage_hint(self) -> bool:
        """An accept decision without a usable hint."""
        return self.accept is True and not self.hint

    def to_json(self) -> dict:
        return {"accept": self.accept, "hint": self.hint, "rationale": self.rationale, "raw": self.raw}


@dataclass(frozen=True)
class HintVerdict:
    """The outcome for one turn: ``accepted`` with ``hint``, or rejected with ``reason``."""

    accepted: bool
    hint: str  # "" when rejected
    reason: str  # "accepted", or one of REJECT_REASONS
    votes: list = field(default_factory=list)
    kind: str = ""
    support: float = 0.0  # consensus of the chosen hint with the other accepted hints (1.0 with one vote)


_STOPWORDS = frozenset(
    "a an the and or but to of in on at for with your you it its it's is are be please just your "
    "that this so as by from like me my i".split())


def hint_tokens(text: str) -> frozenset:
    """Content words of a hint, lower-cased, for the overlap measure (stopwords kept out, so
    'Answer in one line' and 'answer on one line, please' are near-identical)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    return frozenset(w for w in words if w not in _STOPWORDS) or frozenset(words)


def overlap(a: str, b: str) -> float:
    """Dice coefficient of the content-word sets of two hints (1.0 identical, 0.0 disjoint)."""
    ta, tb = hint_tokens(a), hint_tokens(b)
    if not ta and not tb:
        return 1.0
    return 2 * len(ta & tb) / (len(ta) + len(tb))


def _unwrap(text: str) -> str:
    """Strip whitespace and one level of wrapping quotes, backticks or brackets."""
    text = text.strip()
    while len(text) >= 2 and (text[0], text[-1]) in (('"', '"'), ("'", "'"), ("`", "`"), ("[", "]"), ("(", ")")):
        text = text[1:-1].strip()
    return text


def usable_hint(text: str) -> str:
    """The hint cleaned for use (whitespace collapsed, wrapping quotes/brackets removed), or ""
    when it cannot be one: empty, too short or long, no words, or prompt-format debris."""
    hint = _unwrap(" ".join((text or "").split()))
    if hint.lower().startswith("hint:"):
        hint = _unwrap(hint[5:])
    if not 2 <= len(hint) <= MAX_HINT_CHARS:
        return ""
    if not re.search(r"[A-Za-z]{2,}", hint):
        return ""
    if re.search(r"<\||\|>|decision\s*:|hint_start|hint_end|\bhint\s*:", hint, re.I):
        return ""
    return hint


def choose_hint(votes: Sequence[HintVote], kind: str = "") -> HintVerdict:
    """Apply the documented rule (module docstring) to ``votes``."""
    votes = list(votes)
    n = len(votes)
    accepts = [(i, v.hint) for i, v in enumerate(votes) if v.accept is True and v.hint]
    rejects = sum(v.accept is False for v in votes)
    bad_hints = sum(v.garbage_hint for v in votes)
    if n and len(accepts) * 2 > n:
        best, support = _most_supported(accepts)
        return HintVerdict(True, best, "accepted", votes, kind, support)
    if n and rejects * 2 > n:
        reason = "no_hindsight"
    elif n and (len(accepts) + bad_hints) * 2 > n:
        reason = "hint_garbage"
    elif not accepts and not rejects and not bad_hints:
        reason = "judge_garbage"
    else:
        reason = "vote_split"
    return HintVerdict(False, "", reason, votes, kind)


def _most_supported(accepts: list[tuple[int, str]]) -> tuple[str, float]:
    if len(accepts) == 1:
        return accepts[0][1], 1.0
    scored = []
    for i, hint in accepts:
        others = [overlap(hint, h) for j, h in accepts if j != i]
        scored.append((sum(others) / len(others), hint, i))
    top = max(s for s, _, _ in scored)
    tied = [(len(h), i, h, s) for s, h, i in scored if s >= top - _TIE]
    _, _, hint, support = min(tied)
    return hint, support


class HintJudge(abc.ABC):
    """Extracts hints. Implementations must be safe to call concurrently from one event loop."""

    kind: str = "hint"

    @abc.abstractmethod
    async def extract(self, item: JudgeInput) -> HintVerdict:
        """Judge one turn. Unparseable output is a garbage vote, not an exception."""


# --- the rules extractor ---------------------------------------------------------------------------

# (clause id, canonical hint text, pattern). Canonical texts reuse the embedded model's own hint
# phrasings where it has one ("answer in one word", "be brief", "answer with just the answer",
# "reply in uppercase"...) so the tiny teacher actually follows them.
_LANGS = ("english|french|german|spanish|italian|portuguese|dutch|chinese|japanese|korean|russian|arabic|"
          "hindi|polish|swedish|greek|turkish")
_CLAUSES: list[tuple[str, str, re.Pattern]] = [
    ("one_word", "answer in one word", re.compile(r"\b(?:one|single|1)[ -]word\b")),
    ("one_line", "answer in one line", re.compile(r"\b(?:one|single|1|a)[ -]line\b|\bone-liner\b")),
    ("just_answer", "answer with just the answer", re.compile(
        r"\b(?:just|only|simply)(?: give me| tell me| say| write)?(?: the)? (?:final )?(?:answer|number|result|sum|digits?)\b"
        r"|\b(?:bare|plain) (?:answer|number|result)\b|\bno (?:need to|need for) (?:explain|restate|repeat|the sentence)\w*"
        r"|\bskip the (?:explanation|sentence|equation|restating|working)\b"
        r"|\b(?:without|no) (?:the )?(?:explanation|equation|restating)\b")),
    ("be_brief", "be brief", re.compile(
        r"\btoo (?:long|wordy|verbose|much text|chatty)\b|\bshorter\b|\bkeep it (?:short|brief)\b|\bbe (?:brief|concise)\b"
        r"|\bmore concise\b|\bget to the point\b|\btl;?dr\b|\brambl\w*|\bless (?:text|words)\b|\bfewer words\b"
        r"|\bwordy\b|\bverbose\b")),
    ("no_rhymes", "without rhymes", re.compile(
        r"\b(?:no|without|stop|don't|do not|quit)(?: \w+){0,2} rhym\w*|\brhym\w* (?:is|are) (?:annoying|not)\b")),
    ("no_bold", "without bold text", re.compile(r"\b(?:no|without|don't use|do not use|stop using|lose the|drop the) bold\b"
                                               r"|\bbold(?:ing)? (?:is|isn't|was) (?:annoying|not|unnecessary)")),
    ("no_markdown", "without markdown", re.compile(
        r"\b(?:no|without|don't use|do not use|stop using|skip the) (?:markdown|formatting|bullet points|bullets|headers|headings)\b"
        r"|\bplain text\b")),
    ("no_emoji", "without emojis", re.compile(r"\b(?:no|without|don't use|do not use|stop using|fewer|less) emoj\w*")),
    ("uppercase", "reply in uppercase", re.compile(r"\b(?:upper ?case|all caps|in caps|capital letters|block letters)\b")),
    ("lowercase", "reply in lowercase", re.compile(r"\b(?:lower ?case|no capitals|no caps|small letters)\b")),
    ("show_working", "show the full sum, like 7 + 5 = 12", re.compile(
        r"\bhow did you get (?:that|this|it)\b|\bshow (?:me )?(?:your|the) (?:work|working|steps|calculation|sum|math)\b"
        r"|\bwrite (?:it|the sum|the whole thing|the equation) out\b|\bstep by step\b|\bwalk me through\b"
        r"|\bshow how you got\b|\bwith the (?:full )?(?:sum|equation)\b|\bwhere does (?:that|this) come from\b")),
    ("more_detail", "give more detail", re.compile(
        r"\btoo (?:short|brief|terse|vague)\b|\bmore (?:detail|details|context|explanation)\b|\belaborate\b"
        r"|\bexplain (?:more|further|why)\b")),
]
_START = re.compile(r"\b(?:start|begin|open)(?: your (?:reply|answer|response)| it| replies| answers)? with "
                    r"['\"]?([^'\".,;!?]{1,30}[.!?]?)['\"]?")
_END = re.compile(r"\b(?:end|finish|close)(?: your (?:reply|answer|response)| it| replies| answers)? with "
                  r"['\"]?([^'\".,;!?]{1,30}[.!?]?)['\"]?|\bsign off with ['\"]?([^'\".,;!?]{1,30}[.!?]?)['\"]?")
_LANGUAGE = re.compile(rf"\b(?:in|into) ({_LANGS})\b")
_ANSWER = re.compile(
    r"(?:\b(?i:it's|it is|the answer is|the answer's|answer is|that's|should be|should've been|it was|the sum is|"
    r"the result is|the capital is|equals)\s+(-?\d+|[A-Z][a-z]+(?: [A-Z][a-z]+)?)\b)"
    r"|(?:\b\d+\s*(?:\+|plus)\s*\d+\s*(?:is|=|equals|makes)\s*(-?\d+)\b)")
_NOT_ANSWERS = frozenset("Fine Great Good Okay Ok OK Perfect Right Wrong Correct Nice Better Not No Yes Too Just "
                         "Clear Better Close Shorter Longer Almost".split())
_USE = re.compile(r"\b(?:please use|use|try using|you should have used|you should use|should've used|could have used)"
                  r" ((?:the |a |an )?[\w.\-]+(?: [\w.\-]+){0,3}?)(?= instead\b| next time\b|[.,;!?]|$)")
_USE_CUE = re.compile(r"\binstead\b|\bnext time\b|\bshould(?:'ve| have)? used?\b|\bcould have used\b|\btry using\b")
_DONT = re.compile(r"(?:^|[,;:.!]\s*|\b(?:please|and|but|just|also|so)\s+)(don't|do not|never|stop|quit|no more)"
                   r" ((?:\w+)(?: [\w']+){0,4}?)(?=[.,;!?]|$| and\b| but\b| please\b)")
_NOT_DIRECTIVES = re.compile(r"^(?:worry|mind|bother|know|understand|care|think|get it|worry about it|apologi[sz]e"
                             r"|be sorry|thank me)\b")
_NEW_REQUEST = re.compile(r"\?\s*$|^(?:and |now |next |also |what about |how about |can you |could you |please )")
_SUBSUMED = {"be_brief": ("one_word", "one_line", "just_answer")}


def _strip_client_noise(text: str) -> str:
    """Remove OpenClaw's timestamp prefix and runtime line (the rules judge's patterns, any case)."""
    if text.lstrip().lower().startswith(_TRANSIENT):
        return ""
    for pattern in _OPENCLAW_NOISE:
        text = re.sub(pattern.pattern, " ", text, flags=pattern.flags | re.I)
    return text.replace("\u2019", "'").replace("\u2018", "'")


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?\n])\s+", text) if s.strip()]


def extract_clauses(text: str) -> list[tuple[int, str, str]]:
    """(position, clause id, hint text) for every actionable instruction in one user message."""
    text = _strip_client_noise(text)
    lower = text.lower()
    found: list[tuple[int, str, str]] = []
    consumed = list(lower)

    def take(start: int, end: int) -> None:
        consumed[start:end] = " " * (end - start)

    for cid, hint, pattern in _CLAUSES:
        m = pattern.search(lower)
        if m:
            found.append((m.start(), cid, hint))
            take(m.start(), m.end())
    for cid, pattern, template in (("start_with", _START, "start your reply with '{}'"),
                                   ("end_with", _END, "end your reply with '{}'")):
        m = pattern.search(lower)
        if m:
            span = next(i for i in range(1, pattern.groups + 1) if m.group(i) is not None)
            phrase = text[m.start(span):m.end(span)].strip()
            found.append((m.start(), cid, template.format(phrase)))
            take(m.start(), m.end())
    rest = "".join(consumed)
    offset = 0
    for sentence in _sentences(rest):
        offset = rest.find(sentence, offset)
        original = text[offset:offset + len(sentence)]
        question = sentence.endswith("?")
        if not question:
            m = _LANGUAGE.search(sentence)
            if m:
                found.append((offset + m.start(), "language", f"reply in {m.group(1).capitalize()}"))
            for m in _ANSWER.finditer(original):
                value = m.group(1) or m.group(2)
                if value and value.split()[0] not in _NOT_ANSWERS:
                    found.append((offset + m.start(), "answer", f"the answer is {value}"))
                    break
            m = _DONT.search(sentence)
            if m and not _NOT_DIRECTIVES.match(m.group(2)):
                verb = {"stop": "avoid", "quit": "avoid", "no more": "no more"}.get(m.group(1), "do not")
                found.append((offset + m.start(1), "dont", f"{verb} {m.group(2).strip()}"))
            m = _USE.search(sentence)
            if m and (_USE_CUE.search(sentence) or _is_correction(sentence)):
                found.append((offset + m.start(), "use", f"use {m.group(1).strip()}"))
        offset += len(sentence)
    return sorted(found)


def _is_correction(text: str) -> bool:
    return any(score < 0 for _, score, _ in user_feedback(text))


def compose_hint(clauses: Sequence[tuple[int, str, str]]) -> str:
    """One hint from the clauses in the order they were said: 'Answer in one line, without rhymes.'"""
    ids = {cid for _, cid, _ in clauses}
    parts: list[str] = []
    for _, cid, text in clauses:
        if any(other in ids for other in _SUBSUMED.get(cid, ())) or text in parts:
            continue
        parts.append(text)
    if not parts:
        return ""
    hint = ", ".join(parts)
    hint = hint[0].upper() + hint[1:]
    return hint if hint[-1] in ".!?'" else hint + "."


def rules_hint_vote(item: JudgeInput) -> HintVote:
    """The rules extractor's vote on one turn (see ``RulesHintJudge``)."""
    clauses: list[tuple[int, str, str]] = []
    said = []
    corrected = False
    for k, message in enumerate(item.next_state):
        if message.get("role") != "user":
            continue
        text = message_text(message)
        said.append(text)
        clauses += [(k * 100_000 + pos, cid, hint) for pos, cid, hint in extract_clauses(text)]
        corrected = corrected or _is_correction(text)
    raw = " | ".join(said)
    if clauses:
        hint = compose_hint(clauses)
        return HintVote(True, usable_hint(hint), "rules: " + ", ".join(dict.fromkeys(c for _, c, _ in clauses)), raw)
    if corrected:
        return HintVote(False, "", "not_actionable: a correction that does not say what to do instead", raw)
    if not said:
        return HintVote(False, "", "no_hindsight: no user message in the next state", raw)
    cleaned = _strip_client_noise(said[-1]).strip().lower()
    why = "a new request" if _NEW_REQUEST.search(cleaned) else "no correction (thanks, chit-chat)"
    return HintVote(False, "", f"no_hindsight: {why}", raw)


class RulesHintJudge(HintJudge):
    """One deterministic vote from ``extract_clauses`` over the next state's user messages."""

    kind = "rules"

    def score(self, item: JudgeInput) -> HintVerdict:
        vote = rules_hint_vote(item)
        verdict = choose_hint([vote], self.kind)
        if not verdict.accepted and vote.rationale.startswith("not_actionable"):
            return HintVerdict(False, "", "not_actionable", [vote], self.kind)
        return verdict

    async def extract(self, item: JudgeInput) -> HintVerdict:
        return self.score(item)


# --- the model judge ---------------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You extract hindsight hints for an AI assistant. You see the user's request, the assistant's reply, and "
    "what happened next (the next state): the user's next message and/or tool results. Decide whether the next "
    "state shows how the reply should have been different (a correction, a complaint, a stated preference, a "
    "failed tool call). Thanks, praise, a new unrelated question or chit-chat are no hindsight: reject. If you "
    "accept, write one short imperative hint that would have made the reply right, e.g. "
    "`Hint: Answer in one line, without rhymes.`"
)
INSTRUCTION = ("End with `Decision: accept` followed by a line `Hint: <one short imperative sentence>`, "
               "or with `Decision: reject`.")

_DECISION = re.compile(r"decision\s*[:=]\s*\**\s*(accept|reject|yes|no)\b", re.I)
_HINT_LINE = re.compile(r"^[\s*>-]*hint\s*[:=]\s*(.+?)\s*$", re.I | re.M)


def parse_hint_vote(text: str) -> HintVote:
    """A vote from a judge's text: the last ``Decision:`` line, and for accept the last ``Hint:`` line."""
    decisions = _DECISION.findall(text)
    if not decisions:
        return HintVote(None, "", "garbage: no 'Decision: accept|reject' line", text)
    accept = decisions[-1].lower() in ("accept", "yes")
    if not accept:
        return HintVote(False, "", text.strip()[:1000], text)
    hints = _HINT_LINE.findall(text)
    hint = usable_hint(hints[-1]) if hints else ""
    if not hint:
        why = "garbage hint: accept without a hint" if not hints else f"garbage hint: {hints[-1][:200]!r}"
        return HintVote(True, "", why, text)
    return HintVote(True, hint, text.strip()[:1000], text)


class ModelHintJudge(ModelVoter, HintJudge):
    """``votes`` sampled judgements from ``engine``, combined by ``choose_hint``."""

    kind = "model"

    system_prompt, instruction = SYSTEM_PROMPT, INSTRUCTION
    votes_key, role = "opd.votes", "model hint judge"

    def __init__(self, engine: Engine, tokenizer=None, votes: int = 3, temperature: float = 0.8,
                 max_new_tokens: int = 160, seed: int = 0, section_chars: int = 4000):
        super().__init__(engine, tokenizer, votes, temperature, max_new_tokens, seed, section_chars)

    async def extract(self, item: JudgeInput) -> HintVerdict:
        votes = [parse_hint_vote(text) for text in await self.sample_votes(item)]
        return choose_hint(votes, self.kind)


def make_hint_judge(opd_cfg: "OpdConfig", engine: Optional[Engine] = None) -> HintJudge:
    """The hint judge ``opd.hint_judge`` names; ``model`` needs ``engine`` (the orchestrator's
    choice: a judge model, or a frozen copy of the base policy)."""
    if opd_cfg.hint_judge == "rules":
        return RulesHintJudge()
    if opd_cfg.hint_judge == "model":
        if engine is None:
            raise JudgeError("opd.hint_judge=model needs a judge engine")
        return ModelHintJudge(engine, votes=opd_cfg.votes)
    raise JudgeError(f"unknown opd.hint_judge '{opd_cfg.hint_judge}'; choose one of {', '.join(HINT_KINDS)}")
