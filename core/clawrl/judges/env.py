"""Environment verdicts: a judge whose scores come from registered functions of the next state.

Terminal and SWE environments know whether a reply worked (the tests passed, the command exited
0) better than any reading of the conversation. They register a verdict function::

    register_env_verdict("my_tests", lambda item: +1 if "ALL TESTS PASSED" in last_tool_text(item) else None)

A verdict function takes a :class:`JudgeInput` and returns -1, 0 or +1, or ``None`` when it has
nothing to say about this turn; it may be a coroutine function. :class:`EnvJudge` asks the
functions in registration order (or the order of ``names``) and the first that answers decides,
recorded as the vote's rationale. When none answers the verdict is 0 without signal. A function
that returns anything else, or raises, casts a garbage vote (recorded with the reason) and the
next function is asked.

Built in: ``pytest_summary``, a tool result ending in a pytest summary line ("=== 3 passed in
0.12s ===" gives +1; any "failed" or "error" count gives -1).
"""
from __future__ import annotations

import inspect
import logging
import re
from typing import Awaitable, Callable, Optional, Sequence, Union

from clawrl.judges.base import SCORES, Judge, JudgeError, JudgeInput, Verdict, Vote, message_text

log = logging.getLogger(__name__)

VerdictFn = Callable[[JudgeInput], Union[Optional[int], Awaitable[Optional[int]]]]
_REGISTRY: dict[str, VerdictFn] = {}


def register_env_verdict(name: str, fn: VerdictFn) -> None:
    """Register (or replace) the verdict function ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError("a verdict function needs a non-empty name")
    if not callable(fn):
        raise TypeError(f"verdict {name!r} must be callable")
    _REGISTRY[name] = fn


def unregister_env_verdict(name: str) -> None:
    _REGISTRY.pop(name, None)


def env_verdicts() -> list[str]:
    return list(_REGISTRY)


def last_tool_text(item: JudgeInput) -> str:
    """The text of the last tool result in the next state ("" if there is none)."""
    return next((message_text(m) for m in reversed(item.next_state) if m.get("role") == "tool"), "")


_PYTEST_SUMMARY = re.compile(r"^=+ (.*\b(?:passed|failed|error|errors)\b.*) in [\d.]+s.*=+\s*$", re.M)


def pytest_summary(item: JudgeInput) -> Optional[int]:
    m = None
    for m in _PYTEST_SUMMARY.finditer(last_tool_text(item)):
        pass
    if m is None:
        return None
    summary = m.group(1)
    return -1 if re.search(r"\d+ (?:failed|errors?)\b", summary) else 1


register_env_verdict("pytest_summary", pytest_summary)


class EnvJudge(Judge):
    """Scores a turn with the first registered verdict function that answers."""

    kind = "env"

    def __init__(self, names: Optional[Sequence[str]] = None):
        unknown = [n for n in names or () if n not in _REGISTRY]
        if unknown:
            raise JudgeError(f"no environment verdict named {', '.join(unknown)}; registered: "
                             f"{', '.join(_REGISTRY) or 'none'}")
        self.names = list(names) if names is not None else None

    async def judge(self, item: JudgeInput) -> Verdict:
        votes = []
        for name in self.names if self.names is not None else list(_REGISTRY):
            fn = _REGISTRY.get(name)
            if fn is None:  # unregistered since this judge was built
                continue
            try:
                result = fn(item)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as e:
                log.warning("environment verdict %s failed on turn %d: %s", name, item.turn_id, e)
                votes.append(Vote(None, f"{name}: raised {type(e).__name__}", str(e)))
                continue
            if result is None:
                continue
            if isinstance(result, bool) or result not in SCORES:
                votes.append(Vote(None, f"{name}: returned {result!r}", repr(result)))
                continue
            votes.append(Vote(int(result), name, repr(result)))
            return Verdict(int(result), votes, self.kind)
        if votes:  # only broken functions answered
            return Verdict(0, votes, self.kind)
        return Verdict(0, [Vote(0, "no environment verdict", "")], self.kind, signal=False)
