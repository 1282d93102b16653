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

from clawrl.demo.users import Question, ask

EVAL_HEADERS = {"X-Turn-Type": "side", "X-Session-Done": "1"}
SERVING_TEMPERATURE = 1.0  # the OpenAI default, what a client that sets nothing samples at


def held_out_questions(n: int, seed: int) -> list[Question]:
    rng = random.Random(f"demo-eval-{seed}")
    return [ask(rng, held_out=True) for _ in range(n)]


async def preference_rate(client, model: str, user, questions: list[Question], temperature: float,
                          max_tokens: int, seed: int) -> tuple[float, list[str]]:
    """(fraction of replies the user is satisfied with, the replies)."""

    async def reply(i: int, q: Question) -> str:
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q.text}], temperature=temperature,
            max_tokens=max_tokens, seed=seed * 100_003 + i, extra_headers=EVAL_HEADERS)
        return r.choices[0].message.content or ""

    replies = await asyncio.gather(*(reply(i, q) for i, q in enumerate(questions)))
    return sum(user.satisfied(q, r) for q, r in zip(questions, replies)) / len(questions), list(replies)
