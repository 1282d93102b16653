"""The generic path for architectures without a ragged forward: HF's own forward, one sequence
per step, each with its own HF cache object.

Slower than the ragged path (no batching across requests) but correct for any causal LM
transformers can run, so an unusual model still serves rather than being refused.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from clawrl.engines.ragged import Segment


class HFSeqKV:
    """A request's HF cache plus the number of positions it holds."""

    def __init__(self, config):
        self.cache = DynamicCache(config=config)
        self.length = 0


class HFForward:
    ragged = False  # one segment per step

    def __init__(self, model):
        self.model = model
        # transformers renamed past_key_values to cache (5.2x); pass whichever this version takes
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def sync(self) -> None:
        """Each request's HF cache is always complete."""

    def release(self) -> None:
        """Nothing is kept between steps."""

    def new_kv(self, capacity: int, max_tokens: int) -> HFSeqKV:
        return HFSeqKV(self.model.config)

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        (seg,) = segments
        dev = self.model.get_input_embeddings().weight.device
        n = len(seg.ids)
        ids = torch.tensor([seg.ids], dtype=torch.long, device=dev)
        pos = torch.arange(seg.kv.length, seg.kv.length + n, device=dev)[None]
        mask = torch.ones(1, seg.kv.length + n, dtype=torch.long, device=dev)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         **{self.cache_kwarg: seg.kv.cache})
        seg.kv.length += n
        rows = torch.tensor(seg.logit_rows, dtype=torch.long, device=dev)
        return out.logits[0, rows].float()
