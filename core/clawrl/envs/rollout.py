"""One episode of an environment, token-in and token-out.

The model's sampled ids are the training data, so they are never re-tokenised. Turn k's prompt is
turn k-1's prompt, plus the ids sampled at turn k-1, plus the ids of what came between: the chat
template's closing of the assistant message and the rendered observation, ending in the opening of
the next assistant message. Those in-between ids come from rendering the conversation as text
twice -- without and with the observation -- and tokenising only the new suffix, so nothing the
model produced passes through the tokenizer again.

The episode becomes one sample (``trajectory``): the first prompt, then every sampled and
in-between id as the response, with the loss mask 1 exactly on sampled ids and the engine's
logprob and weight version for each of them (in-between tokens carry logprob 0 and the version
of the turn before; they never train).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from clawrl.engines.base import Engine, SamplingParams
from clawrl.envs.base import Env, EnvError, Task


@dataclass
class Episode:
    """A finished episode: the token-exact trajectory and what the environment said."""

    task: Task
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    reward: float
    turns: int
    done: bool
    truncated: bool
    sampled: list[list[int]] = field(default_factory=list)  # each turn's sampled ids, as the engine gave them
    info: dict = field(default_factory=dict)
    transcript: list[dict] = field(default_factory=list)  # the conversation as text, for people to read


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def run_episode(engine: Engine, tokenizer, env: Env, task: Task, params: SamplingParams,
                      max_turns: int) -> Episode:
    """Roll out ``task`` in ``env`` with ``engine`` for at most ``max_turns`` model turns.

    The reward is the last one the environment gave (0 when it never gave one). An episode that
    runs out of turns is ``truncated`` and ends with the model's last reply. The environment is
    closed whatever happens."""
    if max_turns < 1:
        raise EnvError(f"max_turns must be >= 1, got {max_turns}")
    try:
        first = await env.reset(task)
        messages = list(first.messages)
        prompt = _ids(tokenizer, _render(tokenizer, messages, True))
        context = list(prompt)
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        sampled: list[list[int]] = []
        reward: Optional[float] = None
        done = truncated = False
        info: dict = {}
        for turn in range(max_turns):
            result = await engine.generate(context, params)
            ids = list(result.token_ids)
            sampled.append(ids)
            response += ids
            mask += [1] * len(ids)
            logprobs += list(result.logprobs)
            versions += list(result.weight_versions)
            reply = tokenizer.decode(ids, skip_special_tokens=True)
            outcome = await env.step(reply)
            info = outcome.info
            if outcome.reward is not None:
                reward = outcome.reward
            if outcome.done or outcome.truncated or outcome.observation is None:
                done, truncated = outcome.done, outcome.truncated
                break
            if turn == max_turns - 1:  # out of turns: the unanswered observation is not part of the episode
                truncated = True
                final = await env.finish()
                if final is not None:
                    reward, info = final.reward if final.reward is not None else reward, final.info
                break
            # what the template puts between the sampled reply and the next assistant reply
            before = _render(tokenizer, messages + [{"role": "assistant", "content": reply}], False)
            messages += [{"role": "assistant", "content": reply}, *outcome.observation.messages]
            after = _render(tokenizer, messages, True)
            if not after.startswith(before):
                raise EnvError("the chat template renders an earlier turn differently once an observation follows; "
                               "the observation's tokens cannot be appended exactly")
            between = _connector(tokenizer, ids, before) + _ids(tokenizer, after[len(before):])
            context += ids + between
            response += between
            mask += [0] * len(between)
            logprobs += [0.0] * len(between)
            versions += [versions[-1] if versions else 0] * len(between)
        return Episode(task=task, prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=logprobs,
                       weight_versions=versions, reward=0.0 if reward is None else float(reward),
                       turns=len(sampled), done=done, truncated=truncated, sampled=sampled, info=info,
                       transcript=messages + [{"role": "assistant", "content": reply}])
    finally:
        await env.close()


def _connector(tokenizer, sampled: list[int], rendered: str) -> list[int]:
    """Ids the template puts after the assistant's content that the model did not sample. The
    rendered turn ends with ``eos`` and a connector (a newline for ChatML); the model sampled the
    ``eos`` itself unless a length limit cut it off, in which case the ``eos`` is added here too."""
    eos = tokenizer.eos_token
    if not eos or eos not in rendered:
        return []
    tail = rendered[rendered.rfind(eos) + len(eos):]
    closed = bool(sampled) and sampled[-1] == tokenizer.eos_token_id
    return _ids(tokenizer, tail if closed else eos + tail)
