"""Skips for a missing tool that CI turns into failures.

A test that needs an outside tool (``npm``, ``bwrap``, ``chromium``, ...) skips where the tool is
missing, so the suite runs on any machine. CI sets ``CLAWRL_REQUIRE`` to a comma-separated list of
tools it provides (``CLAWRL_REQUIRE=npm,bwrap``); a listed tool that is missing fails the test
instead, so a broken CI image cannot turn into a silently green run.
"""
from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "CLAWRL_REQUIRE"


def required_tools() -> set[str]:
    """The tool names ``CLAWRL_REQUIRE`` lists (lower-cased; empty when unset)."""
    return {t.strip().lower() for t in os.environ.get(REQUIRE_ENV, "").split(",") if t.strip()}


def skip_unless_available(tool: str, reason: str | None = None, available: bool | None = None) -> None:
    """Return when ``tool`` is available; otherwise skip the calling test with ``reason``, or fail it
    while ``CLAWRL_REQUIRE`` lists ``tool``. ``available`` defaults to ``tool`` being on PATH."""
    if available is None:
        available = shutil.which(tool) is not None
    if available:
        return
    reason = reason or f"{tool} is not installed"
    if tool.lower() in required_tools():
        pytest.fail(f"{reason} ({REQUIRE_ENV} lists {tool}, so its tests must run here)", pytrace=False)
    pytest.skip(reason)
