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


def uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row, a function of the row's (seed, counter) alone.

    Counter-based rather than a torch.Generator per request: a request's draws are the same whether
    it is decoded alone or beside others, on the ragged path or in the static decoder, and drawing
    for a whole batch is a few kernels over ``[rows]`` that need no host round trip."""
    h1 = _hash32(_hash32(seeds & _M32) ^ (counters & _M32))
    h2 = _hash32(h1 ^ 0x9E3779B9)
    return ((h1 >> 8).to(torch.float64) * float(1 << 24) + (h2 >> 8).to(torch.float64) + 0.5) / float(1 << 48)


def draw(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         seeds: torch.Tensor, counters: torch.Tensor, *, hot: bool, kmax: int, use_top_p: bool, top_n: int):
    """Tokens, their logprobs and the ``top_n`` best (values, ids) for fp32 ``logits`` ``[R, V]``,
    all on the logits' device; per-row ``temps`` (0: greedy), ``top_k`` (0: none), ``top_p``,
    ``seeds`` and ``counters``. The keyword arguments, known on the host, pick which kernels run:
    ``hot`` (some row samples), ``kmax`` (the largest top-k, 0: none), ``use_top_p``.

    Sampling is inverse-CDF with one uniform per row: exact for the (truncated) distribution, and
    one scan over the vocabulary instead of a random number per vocabulary entry."""
    vocab = logits.shape[-1]
    t = torch.where(temps > 0, temps, torch.ones_like(temps))
    scaled = logits / t[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    if hot:
        x = scaled
        if kmax:
            kth = x.topk(min(kmax, vocab), dim=-1).values.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])
            kth = torch.where((top_k > 0)[:, None], kth, torch.full_like(kth, float("-inf")))
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if use_top_p:
            sp, si = probs.sort(dim=-1, descending=True)
            drop = ((sp.cumsum(-1) - sp) >= top_p[:, None]) & (top_p < 1)[:, None]  # keep the head reaching top_p
            probs = probs.masked_fill(torch.zeros_like(drop).scatter_(1, si, drop), 0.0)
        cdf = probs.to(torch.float64).cumsum(-1)
        target = uniform(seeds, counters) * cdf[:, -1]
        drawn = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
        tokens = torch.where(temps > 0, drawn, tokens)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top_v = top_i = None
    if top_n:
        top_v, top_i = logprobs.topk(top_n, dim=-1)
    return tokens, chosen, top_v, top_i


def pack(tokens, chosen, top_v, top_i) -> torch.Tensor:
    """``draw``'s results as one float64 ``[R, 2 + 2 * top_n]`` tensor: one transfer to the host
    (token ids are exact in float64)."""
    cols = [tokens.to(torch.float64)[:, None], chosen.to(torch.float64)[:, None]]
    if top_v is not None:
        cols += [top_i.to(torch.float64), top_v.to(torch.float64)]
    return torch.cat(cols, dim=1)


def unpack(rows: list[list[float]], top_ns: list[int]) -> list[Sampled]:
    out = []
    for row, n in zip(rows, top_ns):
        k = (len(row) - 2) // 2
        top = [(int(row[2 + j]), row[2 + k + j]) for j in range(n)] if n else None
        out.append(Sampled(int(row[0]), row[1], top))
    return out


def draw_options(params: list[SamplingParams], vocab: int) -> dict:
    """``draw``'s host-side switches for rows sampled under ``params``."""
    hot = [p for p in params if p.temperature > 0]
    return {"hot": bool(hot), "kmax": max((p.top_k for p in hot if 0 < p.top_k < vocab), default=0),
            "use_top_p": any(p.top_p < 1.0 for p in hot), "top_n": max((p.top_logprobs for p in params), default=0)}


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                counters: list[int]) -> list[Sampled]:
    """Draw one token per row of fp32 ``logits`` ``[R, V]`` under each row's params (``draw``), with
    one transfer of the results to the host."""
    dev = logits.device
    vocab = logits.shape[-1]
    temps = torch.tensor([max(p.temperature, 0.0) for p in params], dtype=torch.float32)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    ints = torch.tensor([[p.top_k if p.top_k and p.top_k < vocab else 0 for p in params], seeds, counters],
                        dtype=torch.int64)
    if dev.type != "cpu":
        temps, top_p, ints = temps.to(dev), top_p.to(dev), ints.to(dev)
    res = draw(logits, temps, ints[0], top_p, ints[1], ints[2], **draw_options(params, vocab))
    return unpack(pack(*res).tolist(), [p.top_logprobs for p in params])


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
