"""How far apart two weight versions are, in optimizer updates, along the run's lineage.

Versions only move forward (``clawrl.checkpoints``), so they form a tree rather than a line. A
train step makes version ``v`` from ``v - 1`` with one update. A restart that resumes older weights
(a crash between checkpoints, a corrupt newest checkpoint, a rollback) serves them under a new
number: version ``v`` is then an *alias* of version ``source``, the same weights, zero updates
apart. Anything before the restart that ran past ``source`` is an abandoned branch.

Staleness must count updates, not version numbers: after a crash at version 6 with no checkpoint,
the base weights come back as version 7, and a token sampled from version 0 is exactly on-policy
for them (lag 0), though ``7 - 0`` would call it 7 versions stale and drop it. The lag of a token
is the tree distance between the version that sampled it and the current one: the updates from
the token's version back to the common ancestor plus those from there to the current version.
"""
from __future__ import annotations

from typing import Callable, Mapping


def lag_counter(aliases: Mapping[int, int], current: int) -> Callable[[int], int]:
    """A function giving, for a token's weight version, its distance in updates from ``current``.

    ``aliases`` maps each re-served version to the version whose weights it serves again. Versions
    that never appear on the current line (an abandoned branch) count their own updates back to
    where they left it. A version below 0 cannot occur; it is treated as its own root.
    """
    def parent(v: int) -> tuple[int, int]:
        return (aliases[v], 0) if v in aliases else (v - 1, 1)

    on_line: dict[int, int] = {}  # each ancestor of `current` -> updates from it to `current`
    v, d = current, 0
    while v >= 0 and v not in on_line:
        on_line[v] = d
        v, cost = parent(v)
        d += cost
    memo: dict[int, int] = {}

    def lag(version: int) -> int:
        if version not in memo:
            v, d = version, 0
            while v not in on_line and v >= 0:
                v, cost = parent(v)
                d += cost
            memo[version] = d + on_line.get(v, 0)
        return memo[version]

    return lag
