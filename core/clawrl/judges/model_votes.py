"""Sampling several judgements of one turn from a judge model: shared by the PRM judge (a score
per vote) and the model hint judge (accept/reject and a hint per vote).

Both show the model the same three sections (the user's request, the assistant's reply with its
tool calls, and the full next state) and differ only in their instructions and in how a vote is
parsed. Over-long sections are cut (head and tail kept) until the prompt fits the judge's context.
"""
from __future__ import annotations

import asyncio
import json

from clawrl.engines.base import Engine, SamplingParams
from clawrl.engines.chat_template import render_chat
from clawrl.judges.base import JudgeError, JudgeInput, message_text


def clip(text: str, limit: int) -> str:
    """Keep the head and the tail of an over-long section: both usually matter (a command and its exit)."""
    if len(text) <= limit:
        return text
    half = max(limit // 2, 1)
    return text[:half] + f"\n... [{len(text) - 2 * half} characters cut] ...\n" + text[-half:]


def render_reply(item: JudgeInput, limit: int) -> str:
    parts = [item.reply] if item.reply else []
    for call in item.tool_calls or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        parts.append(f"[tool call] {fn.get('name')}({args if isinstance(args, str) else json.dumps(args)})")
    return clip("\n".join(parts) or "(empty reply)", limit)


def render_next_state(item: JudgeInput, limit: int) -> str:
    lines = [f"[{m.get('role', '?')}] {message_text(m)}" for m in item.next_state]
    return clip("\n".join(lines) or "(nothing)", limit)


class ModelVoter:
    """``votes`` sampled judgements of a turn from ``engine``; subclasses set the prompt texts."""

    system_prompt = ""
    instruction = ""
    votes_key = "votes"  # the config key that sets ``votes``, for error messages
    role = "judge"  # how errors name this judge

    def __init__(self, engine: Engine, tokenizer, votes: int, temperature: float, max_new_tokens: int,
                 seed: int, section_chars: int):
        tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise JudgeError(f"the {self.role} needs its engine's tokenizer with a chat template")
        if votes < 1:
            raise JudgeError(f"{self.votes_key} must be at least 1, not {votes}")
        self.engine, self.tokenizer = engine, tokenizer
        self.votes, self.temperature, self.max_new_tokens = votes, temperature, max_new_tokens
        self.seed, self.section_chars = seed, section_chars
        self.attempts = 0  # distinct seeds for a retried turn

    def messages(self, item: JudgeInput, limit: int | None = None) -> list[dict]:
        limit = limit or self.section_chars
        body = (f"## User request\n{clip(item.request or '(no user message)', limit)}\n\n"
                f"## Assistant reply\n{render_reply(item, limit)}\n\n"
                f"## Next state\n{render_next_state(item, limit)}\n\n{self.instruction}")
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": body}]

    def prompt_ids(self, item: JudgeInput) -> list[int]:
        """The rendered prompt, sections halved until it fits the judge's context."""
        budget = self.engine.model_info().max_context - self.max_new_tokens
        limit = self.section_chars
        while True:
            text = render_chat(self.tokenizer, self.messages(item, limit))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= budget:
                return ids
            if limit <= 64:
                raise JudgeError(f"the {self.role} prompt needs {len(ids)} tokens even with sections cut to "
                                 f"{limit} characters; the judge's context leaves {budget}")
            limit //= 2

    async def sample_votes(self, item: JudgeInput) -> list[str]:
        """The decoded text of each vote, sampled concurrently with distinct seeds."""
        ids = self.prompt_ids(item)
        self.attempts += 1
        base = self.seed + 1_000_003 * item.turn_id + 10_007 * self.attempts
        results = await asyncio.gather(*(
            self.engine.generate(ids, SamplingParams(max_new_tokens=self.max_new_tokens,
                                                     temperature=self.temperature, seed=base + i))
            for i in range(self.votes)))
        return [self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
