"""Reuse of KV across requests that share a token prefix.

OpenClaw resends the same ~16k-token system prompt (and the whole history) every turn, so the
longest common prefix with an earlier request is usually almost the entire prompt. Entries are
keyed by token ids (never text), bounded by a token budget and evicted least-recently-used.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    ids: torch.Tensor  # int64 on CPU, the tokens whose KV ``kv`` holds
    kv: object  # a SeqKV; only positions < len(ids) are read


class PrefixCache:
    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        self._entries: "OrderedDict[int, _Entry]" = OrderedDict()
        self._next_key = 0
        self.tokens = 0  # sum of entry lengths

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], limit: int) -> tuple[object | None, int]:
        """The entry KV sharing the longest prefix with ``ids`` and that length (at most ``limit``)."""
        if not self._entries or limit <= 0:
            return None, 0
        query = torch.tensor(ids[:limit], dtype=torch.long)
        best_key, best_n = None, 0
        for key, e in self._entries.items():
            m = min(len(query), len(e.ids))
            if m <= best_n:
                continue
            diff = (e.ids[:m] != query[:m]).nonzero()
            n = int(diff[0, 0]) if len(diff) else m
            if n > best_n:
                best_key, best_n = key, n
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        return self._entries[best_key].kv, best_n

    def insert(self, ids: list[int], kv) -> None:
        """Remember ``kv`` for ``ids[:kv.length]``; entries that are prefixes of it are dropped."""
        n = kv.length
        if n <= 0 or n > self.budget:
            return
        new = torch.tensor(ids[:n], dtype=torch.long)
        for key, e in list(self._entries.items()):
            m = len(e.ids)
            if m >= n and torch.equal(e.ids[:n], new):
                self._entries.move_to_end(key)  # already covered by a longer entry
                return
            if m < n and torch.equal(new[:m], e.ids):
                self._drop(key)
        self._entries[self._next_key] = _Entry(new, kv)
        self._next_key += 1
        self.tokens += n
        while self.tokens > self.budget:
            self._drop(next(iter(self._entries)))

    def flush(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def _drop(self, key: int) -> None:
        self.tokens -= len(self._entries.pop(key).ids)
