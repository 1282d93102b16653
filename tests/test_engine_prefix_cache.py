"""PrefixCache bookkeeping: longest-prefix lookup, LRU eviction within the token budget, and
entries subsumed by a longer one being dropped instead of counted twice."""
from __future__ import annotations

from clawrl.engines.prefix_cache import PrefixCache


class FakeKV:
    def __init__(self, length: int):
        self.length = length


def test_lookup_returns_the_longest_common_prefix_capped_by_limit():
    pc = PrefixCache(1000)
    a, b = FakeKV(6), FakeKV(5)
    pc.insert([1, 2, 3, 4, 5, 6], a)
    pc.insert([1, 2, 9, 9, 9], b)
    assert pc.lookup([1, 2, 3, 4, 7], limit=10) == (a, 4)
    assert pc.lookup([1, 2, 9, 9, 9, 9], limit=10) == (b, 5)
    assert pc.lookup([1, 2, 3, 4, 5, 6, 7], limit=3) == (a, 3)
    assert pc.lookup([8, 8], limit=10) == (None, 0)


def test_budget_evicts_least_recently_used():
    pc = PrefixCache(10)
    first, second = FakeKV(4), FakeKV(4)
    pc.insert([1, 1, 1, 1], first)
    pc.insert([2, 2, 2, 2], second)
    assert pc.lookup([1, 1, 1, 1], limit=4)[0] is first  # touch: [2...] is now least recent
    pc.insert([3, 3, 3, 3], FakeKV(4))
    assert pc.tokens == 8 and len(pc) == 2
    assert pc.lookup([2, 2, 2, 2], limit=4) == (None, 0)
    assert pc.lookup([1, 1, 1, 1], limit=4)[0] is first
    pc.insert(list(range(11)), FakeKV(11))  # larger than the whole budget: not kept
    assert pc.tokens == 8


def test_longer_entry_replaces_its_prefixes_and_flush_empties():
    pc = PrefixCache(100)
    pc.insert([1, 2, 3], FakeKV(3))
    longer = FakeKV(5)
    pc.insert([1, 2, 3, 4, 5, 6], longer)  # kv holds 5 positions: the last token has no KV yet
    assert len(pc) == 1 and pc.tokens == 5
    pc.insert([1, 2], FakeKV(2))  # already covered
    assert len(pc) == 1 and pc.lookup([1, 2, 3, 4, 5, 6], limit=6) == (longer, 5)
    pc.flush()
    assert len(pc) == 0 and pc.tokens == 0
