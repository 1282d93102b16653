"""The demo's measure: how often the served model satisfies the user's hidden preference on
held-out questions, asked through the live gateway at the serving temperature.

Evaluation requests are sent as side turns that end their session at once (``X-Turn-Type: side``,
``X-Session-Done: 1``), so they never get a next state and are never trained on: measuring the
model does not teach it. Each held-out question keeps its sampling seed across evaluations, so two
points of the curve differ by the weights, not by the dice.
"""
from __future__ import annotations

import asyncio
import random

from clawrl.demo.general import skill_correct, skill_questions
from clawrl.demo.users import Question, ask

EVAL_HEADERS = {"X-Turn-Type": "side", "X-Session-Done": "1"}
SERVING_TEMPERATURE = 1.0  # the OpenAI default, what a client that sets nothing samples at


def held_out_questions(n: int, seed: int, asker=ask) -> list[Question]:
    rng = random.Random(f"demo-eval-{seed}")
    return [asker(rng, held_out=True) for _ in range(n)]


def sampling(temperature: float | None) -> dict:
    """The request's temperature, or none at all (null: the server's default applies, as for a client
    that sets nothing)."""
    return {} if temperature is None else {"temperature": temperature}


async def _replies(client, model: str, questions, temperature: float | None, max_tokens: int,
                   seed: int) -> list[str]:
    async def reply(i: int, q) -> str:
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q.text}], **sampling(temperature),
            max_tokens=max_tokens, seed=seed * 100_003 + i, extra_headers=EVAL_HEADERS)
        return r.choices[0].message.content or ""

    return list(await asyncio.gather(*(reply(i, q) for i, q in enumerate(questions))))


async def preference_rate(client, model: str, user, questions: list[Question], temperature: float | None,
                          max_tokens: int, seed: int) -> tuple[float, list[str]]:
    """(fraction of replies the user is satisfied with, the replies)."""
    replies = await _replies(client, model, questions, temperature, max_tokens, seed)
    return sum(user.satisfied(q, r) for q, r in zip(questions, replies)) / len(questions), replies


async def skill_rate(client, model: str, max_tokens: int) -> float:
    """Greedy correctness on the held-out skill probe (``clawrl.demo.general.CAPITALS``)."""
    replies = await _replies(client, model, skill_questions(), 0.0, max_tokens, 0)
    return sum(skill_correct(i, r) for i, r in enumerate(replies)) / len(replies)
