"""Simulated users for a real pretrained model: everyday questions, a hidden preference, and a
held-out skill the user never judges.

The embedded model only knows additions, so its users ask sums (``clawrl.demo.users``). A real
model such as SmolLM2-135M-Instruct answers anything, so these users ask short everyday questions
(definitions, one-line tips, "name a ..."), drawn from templates with a fixed held-out split: the
demo measures the preference on questions no interaction ever asked.

The skill probe is what learning must not break: capitals of well-known countries, asked greedily
as side turns (never trained on). SmolLM2-135M-Instruct names most of them correctly before any
training, so a fall is visible.
"""
from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

_TEMPLATES = (
    ("What is {}?", ("gravity", "photosynthesis", "an atom", "democracy", "a volcano", "a noun", "inflation",
                     "a comet", "a glacier", "an island", "a verb", "electricity", "a rainbow", "a planet",
                     "an earthquake", "friction", "a fossil", "a desert", "a mammal", "oxygen", "a virus",
                     "a poem", "a library", "a bridge")),
    ("Give me one tip for {}.", ("sleeping better", "saving money", "learning a language", "running", "cooking rice",
                                 "studying", "writing an essay", "gardening", "public speaking", "staying focused",
                                 "drinking more water", "packing a suitcase", "keeping a plant alive", "drawing")),
    ("Name a {}.", ("fruit", "color", "planet", "musical instrument", "bird", "vegetable", "country in Europe",
                    "sport", "ocean", "flower", "tree", "metal", "board game", "breed of dog")),
    ("What does a {} do?", ("doctor", "teacher", "baker", "pilot", "firefighter", "farmer", "librarian", "carpenter",
                            "chef", "gardener", "mechanic", "nurse")),
)

# (country, capital): SmolLM2-135M-Instruct names most of these greedily before any training.
CAPITALS = (
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("England", "London"), ("Russia", "Moscow"), ("China", "Beijing"), ("Egypt", "Cairo"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Hungary", "Budapest"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Thailand", "Bangkok"), ("South Korea", "Seoul"), ("Kenya", "Nairobi"),
    ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Mexico", "Mexico City"), ("Cuba", "Havana"),
    ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"), ("Iran", "Tehran"), ("Czechia", "Prague"),
    ("Indonesia", "Jakarta"), ("the Philippines", "Manila"),
)


@dataclass(frozen=True)
class GeneralQuestion:
    text: str


def _held_out(text: str) -> bool:
    """A fixed quarter of the questions (by a hash of the text) is only ever used to measure."""
    return zlib.crc32(text.encode()) % 4 == 0


def all_questions(held_out: bool) -> list[str]:
    return [t.format(x) for t, xs in _TEMPLATES for x in xs if _held_out(t.format(x)) == held_out]


def ask_general(rng: random.Random, held_out: bool) -> GeneralQuestion:
    return GeneralQuestion(rng.choice(all_questions(held_out)))


def skill_questions() -> list[GeneralQuestion]:
    return [GeneralQuestion(f"What is the capital of {country}?") for country, _ in CAPITALS]


def skill_correct(index: int, reply: str) -> bool:
    """The reply names the capital (word-bounded, any case)."""
    return re.search(rf"\b{re.escape(CAPITALS[index][1])}\b", reply, re.IGNORECASE) is not None


THUMBS_UP, THUMBS_DOWN = "\U0001F44D", "\U0001F44E"
CONCISE_WORDS = 20


class ConciseUser:
    """Likes short answers (at most ``CONCISE_WORDS`` words) and says so only with a thumbs-up or a
    thumbs-down: a black box, no hint of why. SmolLM2 answers some questions in a line ("Name a
    fruit." -> "Apple.") and rambles on others, so both signs come up from the start."""

    name = "concise"
    domain = "general"
    ask = staticmethod(ask_general)

    def satisfied(self, q, reply: str) -> bool:
        return 0 < len(reply.split()) <= CONCISE_WORDS

    def feedback(self, q, reply: str, rng: random.Random) -> str:
        return THUMBS_UP if self.satisfied(q, reply) else THUMBS_DOWN


class OpenerUser:
    """Wants every reply to open with "Sure!", which a real model never does unprompted, and says so
    in words the hint judge reads as an instruction (OPD's hint); a reply that does is thanked."""

    name = "opener"
    domain = "general"
    ask = staticmethod(ask_general)
    _ASK = ("Please start your reply with 'Sure!'", "Begin with 'Sure!' please.", "Start your reply with 'Sure!'")
    _THANKS = ("Thanks!", "Great, thanks!", "Perfect, thank you.")

    def satisfied(self, q, reply: str) -> bool:
        return reply.lstrip().startswith("Sure!")

    def feedback(self, q, reply: str, rng: random.Random) -> str:
        return rng.choice(self._THANKS if self.satisfied(q, reply) else self._ASK)
