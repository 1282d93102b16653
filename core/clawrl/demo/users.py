"""Simulated users: each has a hidden preference it only ever shows through natural feedback.

A real user never says "please answer with a bare number from now on"; they say "Thanks!" when a
reply suits them and grumble when it does not. The demo's users do the same, so the only signal
clawrl gets is the one a live deployment gets: the next message after a reply (the next state),
which the judge turns into +1 / -1.

The preferences are chosen inside what the embedded model already says sometimes (see
``clawrl.embedded.corpus``: an addition is answered as a bare number, as "7 + 5 = 12", or as a
sentence), so learning can only shift probability between replies the model can produce.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

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
    """Wants the sum and nothing else ("12", not "7 + 5 = 12" or "The answer is 12.")."""

    name = "bare"
    _WORDY = ("Hmm, no -- too wordy.", "That's not what I wanted.", "Too long.")
    _WRONG = ("No, that's wrong.", "That's not right.")

    def satisfied(self, q: Question, reply: str) -> bool:
        return re.fullmatch(r"\s*(-?\d+)\.?\s*", reply) is not None and int(reply.strip().rstrip(".")) == q.answer

    def feedback(self, q: Question, reply: str, rng: random.Random) -> str:
        if self.satisfied(q, reply):
            return rng.choice(_THANKS)
        numbers = re.findall(r"-?\d+", reply)
        return rng.choice(self._WRONG if not numbers or int(numbers[-1]) != q.answer else self._WORDY)


class WorkedAnswerUser:
    """Wants to see the sum worked out ("7 + 5 = 12"), not just a number or a sentence."""

    name = "worked"
    _BARE = ("No, that's not it.", "That's not what I wanted.")
    _WRONG = ("No, that's wrong.", "That's not right.")

    def satisfied(self, q: Question, reply: str) -> bool:
        return re.fullmatch(rf"\s*{q.a}\s*\+\s*{q.b}\s*=\s*{q.answer}\.?\s*", reply) is not None

    def feedback(self, q: Question, reply: str, rng: random.Random) -> str:
        if self.satisfied(q, reply):
            return rng.choice(_THANKS)
        numbers = re.findall(r"-?\d+", reply)
        return rng.choice(self._WRONG if not numbers or int(numbers[-1]) != q.answer else self._BARE)


USERS = {u.name: u for u in (BareAnswerUser(), WorkedAnswerUser())}


def make_user(name: str):
    from clawrl.config import ConfigError

    if name not in USERS:
        raise ConfigError(f"unknown demo.user '{name}'; choose one of {', '.join(USERS)}")
    return USERS[name]
