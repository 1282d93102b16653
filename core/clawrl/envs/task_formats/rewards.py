"""Turning what a verifier left behind into a reward: Harbor's reward files and pytest's report.

Harbor's tests/test.sh writes a float to /logs/verifier/reward.txt, or JSON to reward.json (a
bare number, an object with a "reward" key, or an object holding exactly one number). Terminal-Bench
1.0 has no reward file: its parser reads pytest's output, and the reward is the share of tests
passed. We read pytest's ``-rA`` short test summary (one ``PASSED``/``FAILED``/... line per test,
as Terminal-Bench's parser does), else its final ``N passed, M failed in T s`` line. Skipped and
expected failures count as passed, as in Terminal-Bench.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Optional


class RewardFileError(ValueError):
    """A reward file that holds no usable reward; the message says what it holds."""


@dataclass(frozen=True)
class TestCounts:
    passed: int
    total: int


_PASSING = {"PASSED", "SKIPPED", "XFAIL", "XPASS"}  # XPASS: Terminal-Bench's parser counts it; strict xpass is FAILED
_FAILING = {"FAILED", "ERROR"}
_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+\s*$")
_RESULT_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(.+?)(?:\s+-\s.*)?$")
_SKIP_COUNT = re.compile(r"^\[(\d+)\]\s")  # SKIPPED [3] file.py:9: reason  (three tests on one line)
_FINAL_LINE = re.compile(r"^=+ (.*\b(?:passed|failed|error|errors|skipped|xfailed|xpassed)\b.*) in [\d.]+s.*=+\s*$")
_FINAL_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")


def parse_reward_txt(text: str) -> float:
    value = text.strip()
    try:
        reward = float(value)
    except ValueError:
        raise RewardFileError(f"reward.txt holds {value[:40]!r}, not a number") from None
    if not math.isfinite(reward):
        raise RewardFileError(f"reward.txt holds {value!r}, not a finite number")
    return reward


def parse_reward_json(text: str) -> float:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise RewardFileError(f"reward.json is not JSON ({e})") from None
    if isinstance(data, dict):
        if "reward" in data:
            value = data["reward"]
        else:
            numbers = [v for v in data.values() if _is_number(v)]
            if len(numbers) != 1:
                raise RewardFileError(f"reward.json has no \"reward\" key and {len(numbers)} numbers "
                                      f"({', '.join(map(str, data))}); which one is the reward?")
            value = numbers[0]
    else:
        value = data
    if not _is_number(value) or not math.isfinite(value):
        raise RewardFileError(f"reward.json's reward is {value!r}, not a finite number")
    return float(value)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_pytest(output: str) -> Optional[TestCounts]:
    """Passed and total tests from pytest's output; None when it shows no test report."""
    lines = output.splitlines()
    statuses: dict[str, bool] = {}
    in_summary = False
    for line in lines:
        if _SUMMARY_HEADER.match(line):
            in_summary = True
            continue
        if in_summary:
            m = _RESULT_LINE.match(line)
            if m:
                status, test = m.groups()
                skipped = _SKIP_COUNT.match(test) if status == "SKIPPED" else None
                for k in range(int(skipped.group(1)) if skipped else 1):
                    key = f"{test}#{k}" if skipped else test
                    # a test that failed in teardown after passing is reported twice: failing wins
                    statuses[key] = statuses.get(key, True) and status in _PASSING
            elif line.startswith("="):
                in_summary = False
    if statuses:
        return TestCounts(passed=sum(statuses.values()), total=len(statuses))
    for line in reversed(lines):
        m = _FINAL_LINE.match(line.strip())
        if m:
            counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in _FINAL_COUNT.findall(m.group(1))}
            passed = counts.get("passed", 0) + counts.get("skipped", 0) + counts.get("xfailed", 0) + counts.get("xpassed", 0)
            total = passed + counts.get("failed", 0) + counts.get("error", 0)
            return TestCounts(passed, total) if total else None
    return None
