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


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), with no intermediate above 2**63 (torch's
    int64 overflow is not something to rely on)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash, elementwise on int64 holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[R, vocab]`` that depends only on each row's (seed, counter).

    Counter-based rather than a generator per request: one set of elementwise kernels draws for
    every row of the batch at once, and a request's draws are the same whether it is decoded
    alone or beside others (its seed plus how many tokens it has drawn pick them)."""
    key = _hash32(_hash32(seeds & _M32) ^ (counters & _M32))  # [R]
    j = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _hash32(_hash32(j[None, :] ^ key[:, None]) ^ (key[:, None] >> 7))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), 24 bits
    return -torch.log(-torch.log(u))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                counters: list[int]) -> list[Sampled]:
    """Draw one token per row of fp32 ``logits`` ``[R, V]`` under each row's params.

    Every row is drawn in the same few batched kernels (temperature, top-k and top-p masks, then
    the Gumbel-max trick with ``gumbel_noise``), so the cost does not grow with the number of rows
    in kernel launches, and the results come to the host in one transfer."""
    dev = logits.device
    rows, vocab = logits.shape
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         dtype=torch.float32, device=dev)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    if hot:
        sub = [params[i] for i in hot]
        idx = torch.tensor(hot, device=dev) if len(hot) < rows else None
        x = scaled if idx is None else scaled[idx]
        if any(p.top_k and p.top_k < vocab for p in sub):
            ks = torch.tensor([p.top_k if p.top_k and p.top_k < vocab else vocab for p in sub], device=dev)
            kmax = int(ks.max())
            top = x.topk(kmax, dim=-1).values
            kth = top.gather(1, (ks - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in sub):
            top_p = torch.tensor([p.top_p for p in sub], dtype=torch.float32, device=dev)
            probs = torch.softmax(x, dim=-1)
            sp, si = probs.sort(dim=-1, descending=True)
            drop = (sp.cumsum(-1) - sp) >= top_p[:, None]  # keep the smallest head whose mass reaches top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter_(1, si, drop), float("-inf"))
        noise = gumbel_noise(torch.tensor([seeds[i] for i in hot], device=dev),
                             torch.tensor([counters[i] for i in hot], device=dev), vocab)
        drawn = (x + noise).argmax(dim=-1)
        if idx is None:
            tokens = drawn
        else:
            tokens[idx] = drawn
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = max((p.top_logprobs for p in params), default=0)
    top_v = top_i = None
    if k:
        top_v, top_i = logprobs.topk(k, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    packed = torch.stack((tokens.to(torch.float64), chosen.to(torch.float64))).tolist()  # one transfer
    out = []
    for i, (t, lp) in enumerate(zip(*packed)):
        n = params[i].top_logprobs
        out.append(Sampled(int(t), lp, list(zip(top_i[i][:n], top_v[i][:n])) if n else None))
    return out


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
