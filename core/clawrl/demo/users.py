"""Simulated users: each has a hidden preference it only ever shows through natural feedback.

A real user never says "please answer with a bare number from now on"; they say "Thanks!" when a
reply suits them and grumble when it does not. The demo's users do the same, so the only signal
clawrl gets is the one a live deployment gets: the next message after a reply (the next state),
which the judge turns into +1 / -1.

The preferences are chosen inside what the embedded model already says sometimes (see
``clawrl.embedded.corpus``: an addition is answered as a bare number, as "7 + 5 = 12", or as a
sentence), so learning can only shift probability between replies the model can produce.

A preference is about the *form* of a reply: these users do not re-check the sum. Sampled at
temperature 1 the tiny model gets most held-out sums wrong, so a user who also demanded the right
number would be satisfied too rarely to teach anything within a few hundred interactions; the
demo reports correctness on its own, so any cost of the preference to arithmetic stays visible.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from clawrl.config import ConfigError
from clawrl.demo.general import ConciseUser, OpenerUser
from clawrl.embedded.corpus import ADDITION_QUESTIONS, sample_pair


@dataclass(frozen=True)
class Question:
    text: str
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b


def ask(rng: random.Random, held_out: bool) -> Question:
    """An addition question in one of the phrasings the model knows; ``held_out`` pairs never
    appear in the model's pretraining corpus nor in the user's training interactions."""
    a, b = sample_pair(rng, held_out=held_out)
    return Question(rng.choice(ADDITION_QUESTIONS).format(a=a, b=b), a, b)


_THANKS = ("Thanks!", "Great, thanks!", "Perfect, thank you.", "Thanks, that's what I needed.")


class BareAnswerUser:
    """Wants a bare number ("12"), not "7 + 5 = 12" or "The answer is 12."."""

    name = "bare"
    domain = "additions"
    ask = staticmethod(ask)
    _OTHER = ("Hmm, no -- too wordy.", "That's not what I wanted.", "Too long.")

    def satisfied(self, q: Question, reply: str) -> bool:
        return re.fullmatch(r"\s*-?\d+\.?\s*", reply) is not None

    def feedback(self, q: Question, reply: str, rng: random.Random) -> str:
        return rng.choice(_THANKS if self.satisfied(q, reply) else self._OTHER)


class WorkedAnswerUser:
    """Wants the working shown with the question's operands ("7 + 5 = 12"), not a bare number or
    a sentence."""

    name = "worked"
    domain = "additions"
    ask = staticmethod(ask)
    _OTHER = ("No, that's not it.", "That's not what I wanted.")

    def satisfied(self, q: Question, reply: str) -> bool:
        return re.fullmatch(rf"\s*{q.a}\s*\+\s*{q.b}\s*=\s*-?\d+\.?\s*", reply) is not None

    def feedback(self, q: Question, reply: str, rng: random.Random) -> str:
        return rng.choice(_THANKS if self.satisfied(q, reply) else self._OTHER)


def correct(q: Question, reply: str) -> bool:
    """The reply's last number is the sum (the demo also reports it on its own)."""
    numbers = re.findall(r"-?\d+", reply)
    return bool(numbers) and int(numbers[-1]) == q.answer


class StudentUser:
    """A student who wants answers that do not sound machine-written -- in the tiny model's domain,
    the bare number a person would jot down ("12"), not "7 + 5 = 12" or "The sum of 7 and 5 is 12.".

    Corrections are natural and say what to do instead; some carry a complaint the rules reward
    judge reads as -1, some only the instruction (no reward signal, but a hint for OPD)."""

    name = "student"
    domain = "additions"
    ask = staticmethod(ask)
    _ROBOTIC = ("That's not what I wanted. Just the number, please.",
                "No, that sounds like a robot. Just the answer, please.",
                "Hmm, no -- that sounds machine-written. Just the number, please.",
                "Too robotic -- just give me the number.")

    def satisfied(self, q: Question, reply: str) -> bool:
        return re.fullmatch(r"\s*-?\d+\.?\s*", reply) is not None

    def feedback(self, q: Question, reply: str, rng: random.Random) -> str:
        return rng.choice(_THANKS if self.satisfied(q, reply) else self._ROBOTIC)


class TeacherUser:
    """A teacher who wants specific, friendly comments -- in the tiny model's domain, a friendly
    opener and the sum worked out with the question's own numbers: "Sure! 7 + 5 = 12.".

    The model almost never opens with "Sure!" by itself (it does when a prompt says
    ``[Instruction: start your reply with 'Sure!']``), so a +1 is rare and Binary RL has little to
    reinforce; the corrections name what is missing, which the hint judge turns into a hint."""

    name = "teacher"
    domain = "additions"
    ask = staticmethod(ask)
    _COLD = ("That's not what I wanted. Be friendlier: start your reply with 'Sure!'.",
             "Hmm, no -- too cold. Start your reply with 'Sure!' next time.")
    _VAGUE_COLD = ("That's not what I wanted: write out the whole sum, and start your reply with 'Sure!'.",
                   "That's not what I wanted. Show the whole sum, and start with 'Sure!'.")
    _VAGUE = ("That's not what I wanted: write out the whole sum.", "That's not what I wanted.")

    @staticmethod
    def _worked(q: Question, reply: str) -> bool:
        return re.search(rf"(?<!\d){q.a}\s*\+\s*{q.b}\s*=\s*-?\d+", reply) is not None

    def satisfied(self, q: Question, reply: str) -> bool:
        return re.match(rf"\s*Sure!\s*{q.a}\s*\+\s*{q.b}\s*=\s*-?\d+", reply) is not None

    def feedback(self, q: Question, reply: str, rng: random.Random) -> str:
        if self.satisfied(q, reply):
            return rng.choice(_THANKS)
        if self._worked(q, reply):
            return rng.choice(self._COLD)
        return rng.choice(self._VAGUE if reply.lstrip().startswith("Sure!") else self._VAGUE_COLD)


USERS = {u.name: u for u in (BareAnswerUser(), WorkedAnswerUser(), StudentUser(), TeacherUser(), ConciseUser(),
                              OpenerUser())}


def make_user(name: str):
    if name not in USERS:
        raise ConfigError(f"unknown demo.user '{name}'; choose one of {', '.join(USERS)}")
    return USERS[name]
