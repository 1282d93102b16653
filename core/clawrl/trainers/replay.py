"""The reference replay (``train.replay_coef``): the frozen starting policy's own replies to a step's prompts.

A user's feedback judges one thing about a reply (its length, its form); the update it drives moves
the rest of the reply too, and the model loses skills nobody judged (BENCHMARKS.md, "Learning users
can trust"). The KL to the frozen start acts only on the tokens the drifting policy sampled, so once
the policy stops writing a worked sum the KL no longer sees one. Replay trains on the *reference's*
tokens instead: before each step the frozen reference writes its own reply to each distinct prompt
of the step, and the objective adds ``train.replay_coef`` times the token NLL of those ids under the
same prompt (``clawrl.trainers.batching``: a sequence of its own after the samples',
``MicroBatch.replay_mask``). Token-in, token-out: the ids are the ones generated, never re-tokenised.

With ``train.replay_topk`` K > 0 the term is instead the forward KL from the reference's top-K
distribution at each replayed position (read off the logits the decode computes anyway): it is zero,
with zero gradient, while the policy still equals the reference, and pulls back only what moved. The
NLL of a greedy reply is not: it sharpens the policy toward the reference's argmax from the first
step, an update of its own.

A prompt repeated in the step (a GRPO group) gets one reply, so that a group of n does not weigh n
times. Sampling (``train.replay_temperature`` > 0) draws from a generator seeded by the run's seed
and the trainer's step, so a resumed run replays the same replies.
"""
from __future__ import annotations

import inspect

import torch

from clawrl.samples import ReferenceReply, Sample


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The KV cache's keyword, in and out: transformers renamed past_key_values to cache (5.2x); a peft
    wrapper's forward takes **kwargs, so ask the model inside it."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def reference_reply(model: torch.nn.Module, prompt_ids: list[int], eos_ids: frozenset[int], max_tokens: int,
                    temperature: float, generator: torch.Generator, topk: int = 0) -> ReferenceReply:
    """``model``'s reply to ``prompt_ids``, decoded token by token with its KV cache: greedy at
    ``temperature`` 0, else sampled; ends after an eos id (kept, as the engine keeps it) or at
    ``max_tokens``. With ``topk`` > 0 also its top-k ids and logprobs (temperature 1) at each position,
    read off the same logits."""
    device = next(model.parameters()).device
    cache_kwarg = _cache_kwarg(model)
    reply: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1)
        while True:
            logits = out.logits[0, -1].float()
            if topk > 0:
                lps, ids = torch.log_softmax(logits, dim=-1).topk(topk)
                top_ids.append(ids.tolist())
                top_lps.append(lps.tolist())
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            else:
                token = int(logits.argmax())
            reply.append(token)
            if token in eos_ids or len(reply) >= max_tokens:
                return ReferenceReply(reply, top_ids if topk > 0 else None, top_lps if topk > 0 else None)
            out = model(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                        **{cache_kwarg: getattr(out, cache_kwarg)})


def batched_greedy_replies(model: torch.nn.Module, prompts: list[list[int]], eos_ids: frozenset[int],
                           max_tokens: list[int], topk: int = 0) -> list[ReferenceReply]:
    """``reference_reply`` at temperature 0 for several prompts in one decode: the prompts left-padded
    into one batch under an explicit mask (a padded position is seen by no real token, and sees only
    itself so that its row stays finite), each row's positions counted from its own first token. One
    forward per decoded token for the whole step instead of one per token of each reply: the
    replay's decode is the step's largest cost on a CPU. Attention models only (a recurrent layer
    would carry the padding into its state)."""
    device = next(model.parameters()).device
    cache_kwarg = _cache_kwarg(model)
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(n, width, dtype=torch.long, device=device)
    real = torch.zeros(n, width, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        real[i, width - len(p):] = True
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=device)
    mask = ((causal[None] & real[:, None, :]) | eye[None])[:, None]
    replies: list[list[int]] = [[] for _ in prompts]
    tops: list[tuple[list, list]] = [([], []) for _ in prompts]
    done = [False] * n
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        nxt = pos[:, -1:] + 1
        while True:
            logits = out.logits[:, -1].float()
            if topk > 0:
                lps, top_ids = torch.log_softmax(logits, dim=-1).topk(topk)
            tokens = logits.argmax(-1)
            for i in range(n):
                if done[i]:
                    continue
                replies[i].append(int(tokens[i]))
                if topk > 0:
                    tops[i][0].append(top_ids[i].tolist())
                    tops[i][1].append(lps[i].tolist())
                done[i] = int(tokens[i]) in eos_ids or len(replies[i]) >= max_tokens[i]
            if all(done):
                break
            real = torch.cat([real, torch.ones(n, 1, dtype=torch.bool, device=device)], dim=1)
            out = model(input_ids=tokens[:, None], attention_mask=real[:, None, None, :], position_ids=nxt,
                        use_cache=True, **{cache_kwarg: getattr(out, cache_kwarg)})
            nxt = nxt + 1
    return [ReferenceReply(r, t[0] if topk > 0 else None, t[1] if topk > 0 else None)
            for r, t in zip(replies, tops)]


def attach_replays(model: torch.nn.Module, samples: list[Sample], eos_ids: frozenset[int], max_tokens: int,
                   max_context: int, temperature: float, generator: torch.Generator, topk: int = 0,
                   batched: bool = False) -> None:
    """Set ``Sample.replay`` to ``model``'s reply on the first sample of each distinct prompt (None on
    the repeats, and where the prompt leaves no room in ``max_context``). ``batched``: greedy replies
    decoded together (``batched_greedy_replies``)."""
    seen: set[tuple[int, ...]] = set()
    chosen: list[tuple[Sample, int]] = []
    for s in samples:
        key = tuple(s.prompt_ids)
        room = min(max_tokens, max_context - len(s.prompt_ids))
        s.replay = None
        if key in seen or room < 1:
            continue
        seen.add(key)
        chosen.append((s, room))
    if not chosen:
        return
    if batched and temperature == 0:
        replies = batched_greedy_replies(model, [list(s.prompt_ids) for s, _ in chosen], eos_ids,
                                         [room for _, room in chosen], topk)
    else:
        replies = [reference_reply(model, list(s.prompt_ids), eos_ids, room, temperature, generator, topk)
                   for s, room in chosen]
    for (s, _), reply in zip(chosen, replies):
        s.replay = reply
