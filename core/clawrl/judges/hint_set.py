"""A labelled set of feedback messages with known hints, for measuring hint judges.

Each case is one turn (a request, the assistant's reply) and the user's next message, in natural
phrasings: corrections that say what to do instead (one or two instructions, sometimes wrapped in
courtesy: "Thanks, but keep it shorter next time."), and messages with no hint -- thanks and
praise, new requests (some with trap words: "Write a one line poem about cats."), chit-chat, and
corrections that do not say what to do instead ("No, that's wrong.").

A case's known hint is a set of *instructions* (``one_line``, ``no_rhymes``, ``answer`` with the
value 12, ...). **Matching criterion** (``hint_matches``): a chosen hint matches a case when the
set of instructions found in the hint text by ``HINT_KEYS`` (case-insensitive key phrases, plus
the case's value for ``answer``/``language``/``start_with``/``end_with``/``use``) equals the case's
set -- nothing missing, nothing added; ``be_brief`` counts as implied by ``one_line``, ``one_word``
and ``just_answer`` (a one-line answer is brief), so it is neither missing nor extra beside them.
The keys are written here, independently of the rules extractor's patterns, so a paraphrase
("keep it to a single line") matches as well as the canonical wording.

``hint_cases(n, seed)`` is deterministic: the same seed gives the same cases.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from clawrl.embedded.corpus import CAPITALS, sample_pair

# Canonical hint text of each instruction ({v}: the case's value).
CANONICAL = {
    "one_line": "answer in one line", "one_word": "answer in one word", "just_answer": "answer with just the answer",
    "be_brief": "be brief", "no_rhymes": "without rhymes", "no_bold": "without bold text",
    "no_emoji": "without emojis", "uppercase": "reply in uppercase", "lowercase": "reply in lowercase",
    "show_working": "show the full sum, like 7 + 5 = 12", "more_detail": "give more detail",
    "language": "reply in {v}", "answer": "the answer is {v}", "start_with": "start your reply with '{v}'",
    "end_with": "end your reply with '{v}'", "use": "use {v}",
}

# How the instruction is recognised in a hint's text (lower-cased).
HINT_KEYS = {
    "one_line": r"\b(?:one|single|1)[ -]line\b|\bone-liner\b|\bon a line\b",
    "one_word": r"\b(?:one|single|1)[ -]word\b",
    "just_answer": r"\b(?:just|only|nothing but|solely) the (?:final )?(?:answer|number|result|sum)\b|\bbare (?:number|answer)\b"
                   r"|\bno (?:explanation|restating|extra words)\b",
    "be_brief": r"\bbrief\b|\bshort(?:er)?\b|\bconcise\b|\bterse\b|\bfewer words\b|\bless text\b|\bverbose\b|\bwordy\b",
    "no_rhymes": r"rhym",
    "no_bold": r"\bbold\b",
    "no_emoji": r"emoj",
    "uppercase": r"upper ?case|all caps|capital letters",
    "lowercase": r"lower ?case|small letters",
    "show_working": r"full sum|show (?:the|your) (?:work|working|steps|sum|calculation)|write (?:out )?the (?:sum|equation)"
                    r"|\bequation\b|= 12|how you got",
    "more_detail": r"more detail|elaborate|explain more|more explanation|longer",
    "language": r"\b{v}\b",
    "answer": r"(?<![\w-]){v}(?![\w])",
    "start_with": r"\b(?:start|begin|open)\w*\b.*{v}",
    "end_with": r"\b(?:end|finish|close)\w*\b.*{v}",
    "use": r"\b(?:use|using)\b.*\b{v}\b",
}
_IMPLIES_BRIEF = ("one_line", "one_word", "just_answer")

# Natural feedback phrasings per instruction ({v}: the value).
FEEDBACK = {
    "one_line": ("One line, please.", "Keep it to a single line.", "Just one line next time.", "Can you do that in one line?"),
    "one_word": ("One word answers please.", "A single word is enough.", "Answer in one word."),
    "just_answer": ("Just the number.", "Only the answer, please.", "I just need the number.", "Just give me the answer.",
                    "Skip the explanation."),
    "be_brief": ("Too long.", "Way too wordy.", "That's too verbose.", "Shorter, please.", "Get to the point.",
                 "Hmm, no -- too wordy."),
    "no_rhymes": ("No rhymes please.", "Stop rhyming.", "Please don't rhyme."),
    "no_bold": ("Don't use bold.", "No bold text, please.", "Lose the bold."),
    "no_emoji": ("No emojis.", "Please don't use emojis.", "Fewer emojis, please."),
    "uppercase": ("In all caps please.", "Write it in uppercase.", "Use capital letters."),
    "lowercase": ("All lowercase, please.", "Use lower case.", "No capitals please."),
    "show_working": ("Hmm, how did you get that?", "Show your working.", "Can you show the steps?", "Write the sum out."),
    "more_detail": ("Too short, can you elaborate?", "I need more detail.", "Explain more, please."),
    "language": ("In {v}, please.", "Answer in {v} next time.", "Say it in {v}."),
    "answer": ("No, it's {v}.", "Wrong, the answer is {v}.", "It should be {v}.", "Actually it's {v}."),
    "start_with": ("Start your reply with '{v}'", "Begin with '{v}' please."),
    "end_with": ("End your reply with '{v}'", "Finish with '{v}' please."),
    "use": ("Next time use {v} instead.", "You should have used {v}."),
}
_VALUES = {"language": ("French", "German", "Spanish", "Italian"), "start_with": ("Sure!", "Okay:"),
           "end_with": ("Done.", "Cheers."), "use": ("the calculator", "the weather tool", "the search tool")}
_SINGLE = ("one_line", "one_word", "just_answer", "be_brief", "no_rhymes", "no_bold", "no_emoji", "uppercase",
           "lowercase", "show_working", "more_detail", "language", "answer", "start_with", "end_with", "use")
_PAIRS = (("be_brief", "one_line"), ("one_line", "no_rhymes"), ("no_bold", "just_answer"), ("be_brief", "no_emoji"),
          ("lowercase", "one_line"), ("just_answer", "no_bold"), ("be_brief", "uppercase"), ("no_rhymes", "no_emoji"))
_COURTESY = ("Thanks, but {f}", "Great, but {f}", "Hmm. {f}", "Ugh. {f}", "{f}", "{f}", "{f}", "{f} Thanks.")

THANKS = ("Thanks!", "Great, thanks!", "Perfect, thank you.", "Cheers!", "That's exactly it, thanks.", "Nice \U0001F44D",
          "Thank you so much!", "Awesome.", "Brilliant, that's what I needed.")
NEW_REQUESTS = ("What about {a}+{b}?", "And what is the capital of {c}?", "Now add {a} and {b}.", "Next one: {a} plus {b}?",
                "Can you tell me a joke?", "What colour is a banana?", "Use the calculator to compute {a}*{b}.",
                "How do you say hello in French?", "Write a one line poem about cats.", "What's the weather in Oslo?")
CHIT_CHAT = ("ok", "lol", "hmm ok", "bye!", "brb", "Interesting.", "Good morning!", "no worries", "I see.")
NOT_ACTIONABLE = ("No, that's wrong.", "That's not right.", "Wrong.", "Nope.", "That's not what I wanted.",
                  "Hmm, that doesn't look right.")

_REPLIES = {
    "be_brief": "{s}. Adding numbers is one of the oldest skills, and there is a lot to say about it.",
    "one_line": "The answer:\n{a} + {b}\n= {s}",
    "show_working": "{s}",
    "more_detail": "{s}",
}


@dataclass(frozen=True)
class HintCase:
    case_id: int
    category: str  # correction | thanks | new_request | chit_chat | not_actionable
    request: str
    reply: str
    feedback: str  # the user's next message
    instructions: tuple  # ((instruction, value or ""), ...); () when the case has no hint

    @property
    def has_hint(self) -> bool:
        return bool(self.instructions)

    @property
    def expected_hint(self) -> str:
        """The known hint in canonical words ("" for none)."""
        text = ", ".join(CANONICAL[i].format(v=v) for i, v in self.instructions)
        return (text[:1].upper() + text[1:] + ("" if text[-1:] in ".!?'" else ".")) if text else ""


def instructions_in(hint: str, values: dict) -> set:
    """The instructions ``HINT_KEYS`` finds in ``hint`` (``values``: instruction -> the case's value)."""
    text = hint.lower()
    found = set()
    for name, key in HINT_KEYS.items():
        if "{v}" in key:
            if not values.get(name):
                continue
            key = key.format(v=re.escape(values[name].lower()))
        if re.search(key, text):
            found.add(name)
    if found & set(_IMPLIES_BRIEF):
        found.discard("be_brief")
    return found


def hint_matches(hint: str, case: HintCase) -> bool:
    """The documented matching criterion (module docstring)."""
    if not hint or not case.has_hint:
        return False
    want = {i for i, _ in case.instructions}
    if want & set(_IMPLIES_BRIEF):
        want.discard("be_brief")
    return instructions_in(hint, dict(case.instructions)) == want


def _value(rng: random.Random, name: str, a: int, b: int, country: str) -> str:
    if name == "answer":
        return str(a + b) if country is None else CAPITALS[country]
    return rng.choice(_VALUES[name]) if name in _VALUES else ""


def _correction(rng: random.Random, case_id: int) -> HintCase:
    names = rng.choice(_PAIRS) if rng.random() < 0.3 else (rng.choice(_SINGLE),)
    a, b = sample_pair(rng)
    country = rng.choice(sorted(CAPITALS)) if names == ("answer",) and rng.random() < 0.4 else None
    if country:
        request, reply = f"What is the capital of {country}?", rng.choice([c for c in CAPITALS.values()
                                                                          if c != CAPITALS[country]]) + "."
    else:
        request = f"What is {a}+{b}?"
        wrong = a + b + rng.choice((-10, -1, 1, 10))
        reply = (str(wrong) if "answer" in names else
                 _REPLIES.get(names[0], "{a} + {b} = {s}.").format(a=a, b=b, s=a + b))
    instructions = tuple((n, _value(rng, n, a, b, country)) for n in names)
    parts = [rng.choice(FEEDBACK[n]).format(v=v) for n, v in instructions]
    text = " ".join(parts)
    text = rng.choice(_COURTESY).format(f=text[:1].lower() + text[1:] if rng.random() < 0.5 else text)
    return HintCase(case_id, "correction", request, reply, text, instructions)


def _no_hint(rng: random.Random, case_id: int) -> HintCase:
    category = rng.choices(("thanks", "new_request", "chit_chat", "not_actionable"), weights=(3, 4, 2, 2))[0]
    a, b = sample_pair(rng)
    pool = {"thanks": THANKS, "new_request": NEW_REQUESTS, "chit_chat": CHIT_CHAT, "not_actionable": NOT_ACTIONABLE}
    text = rng.choice(pool[category]).format(a=rng.randint(1, 30), b=rng.randint(1, 30),
                                             c=rng.choice(sorted(CAPITALS)))
    return HintCase(case_id, category, f"What is {a}+{b}?", f"{a} + {b} = {a + b}.", text, ())


def hint_cases(n: int = 120, seed: int = 0, hint_fraction: float = 0.6) -> list[HintCase]:
    """``n`` labelled cases (at least 50), about ``hint_fraction`` of them corrections with a hint."""
    if n < 50:
        raise ValueError(f"a labelled hint set needs at least 50 cases, not {n}")
    if not 0 < hint_fraction < 1:
        raise ValueError(f"hint_fraction must be in (0, 1), not {hint_fraction}")
    rng = random.Random(seed)
    return [(_correction if rng.random() < hint_fraction else _no_hint)(rng, i) for i in range(n)]
