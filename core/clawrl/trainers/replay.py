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


def reference_reply(model: torch.nn.Module, prompt_ids: list[int], eos_ids: frozenset[int], max_tokens: int,
                    temperature: float, generator: torch.Generator, topk: int = 0) -> ReferenceReply:
    """``model``'s reply to ``prompt_ids``, decoded token by token with its KV cache: greedy at
    ``temperature`` 0, else sampled; ends after an eos id (kept, as the engine keeps it) or at
    ``max_tokens``. With ``topk`` > 0 also its top-k ids and logprobs (temperature 1) at each position,
    read off the same logits."""
    device = next(model.parameters()).device
    # transformers renamed past_key_values to cache (5.2x); pass whichever this version takes (a peft wrapper's
    # forward takes **kwargs: ask the model inside it)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    cache_kwarg = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
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
                        **{cache_kwarg: out.past_key_values})


def attach_replays(model: torch.nn.Module, samples: list[Sample], eos_ids: frozenset[int], max_tokens: int,
                   max_context: int, temperature: float, generator: torch.Generator, topk: int = 0) -> int:
    """Set ``Sample.replay`` to ``model``'s reply on the first sample of each distinct prompt (None on
    the repeats, and where the prompt leaves no room in ``max_context``); returns the number of
    replayed tokens."""
    seen: set[tuple[int, ...]] = set()
    tokens = 0
    for s in samples:
        key = tuple(s.prompt_ids)
        room = min(max_tokens, max_context - len(s.prompt_ids))
        if key in seen or room < 1:
            s.replay = None
            continue
        seen.add(key)
        s.replay = reference_reply(model, list(s.prompt_ids), eos_ids, room, temperature, generator, topk)
        tokens += len(s.replay.ids)
    return tokens
