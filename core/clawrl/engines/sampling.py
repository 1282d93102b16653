"""Token sampling and stop-string detection for the torch engine.

Logprobs are always ``log_softmax(logits / T)`` in fp32 (T = 1 when greedy), taken before
top-p/top-k truncation: that is the distribution a trainer recomputes from the same logits, so
the recorded logprob and the trainer's agree. Truncation only decides which token is drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from clawrl.engines.base import SamplingParams


@dataclass
class Sampled:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[Sampled]:
    """Draw one token per row of fp32 ``logits`` ``[R, V]`` under each row's params."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         dtype=torch.float32, device=logits.device)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature > 0:
            tokens[i] = _draw(scaled[i], p, generators[i])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = max((p.top_logprobs for p in params), default=0)
    top_v = top_i = None
    if k:
        top_v, top_i = logprobs.topk(k, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for i, (t, lp) in enumerate(zip(tokens.tolist(), chosen.tolist())):
        n = params[i].top_logprobs
        out.append(Sampled(t, lp, list(zip(top_i[i][:n], top_v[i][:n])) if n else None))
    return out


def _draw(scaled: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    x = scaled
    if p.top_k and p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        drop = (sp.cumsum(0) - sp) >= p.top_p  # keep the smallest head whose mass reaches top_p
        probs = probs.clone()
        probs[si[drop]] = 0.0
    return torch.multinomial(probs, 1, generator=gen)[0]


class StopStringMatcher:
    """Decodes a response incrementally and reports the first stop string that appears in it.

    Decoding a token alone can lose a leading space (SentencePiece) or split a UTF-8 character
    (byte-level BPE), so new text is the decode of a short window minus the decode of its head,
    emitted only once it is no longer a partial character.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def feed(self, token: int) -> str | None:
        self.ids.append(token)
        dec = self.tokenizer.decode
        head = dec(self.ids[self._prefix: self._read], skip_special_tokens=False)
        full = dec(self.ids[self._prefix:], skip_special_tokens=False)
        if len(full) <= len(head) or full.endswith("\ufffd"):
            return None
        checked_from = max(0, len(self.text) - self.longest + 1)
        self.text += full[len(head):]
        self._prefix, self._read = self._read, len(self.ids)
        window = self.text[checked_from:]
        hits = [(window.find(s), s) for s in self.stops if s in window]
        return min(hits)[1] if hits else None
