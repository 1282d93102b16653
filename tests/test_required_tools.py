"""CLAWRL_REQUIRE: a test skips for a missing tool unless CI lists that tool, then it fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.required_tools import required_tools, skip_unless_available

ROOT = Path(__file__).resolve().parents[1]
MISSING = "clawrl-no-such-tool"


def test_a_missing_tool_skips_with_the_reason_when_clawrl_require_is_unset(monkeypatch):
    monkeypatch.delenv("CLAWRL_REQUIRE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs the no-such-tool"):
        skip_unless_available(MISSING, "needs the no-such-tool")


def test_a_missing_tool_fails_while_clawrl_require_lists_it(monkeypatch):
    monkeypatch.setenv("CLAWRL_REQUIRE", f"npm, {MISSING.upper()} ,bwrap")
    assert required_tools() == {"npm", MISSING, "bwrap"}
    with pytest.raises(pytest.fail.Exception, match=f"needs the no-such-tool.*CLAWRL_REQUIRE lists {MISSING}"):
        skip_unless_available(MISSING, "needs the no-such-tool")


def test_a_missing_tool_that_clawrl_require_does_not_list_still_skips(monkeypatch):
    monkeypatch.setenv("CLAWRL_REQUIRE", "npm,bwrap")
    with pytest.raises(pytest.skip.Exception, match=f"{MISSING} is not installed"):
        skip_unless_available(MISSING)


def test_an_available_tool_returns_and_an_explicit_answer_overrides_path(monkeypatch):
    monkeypatch.setenv("CLAWRL_REQUIRE", "sh")
    skip_unless_available("sh")  # on PATH: nothing happens
    skip_unless_available(MISSING, available=True)
    with pytest.raises(pytest.fail.Exception):
        skip_unless_available("sh", "sh cannot run here", available=False)


@pytest.mark.parametrize("require, outcome", [(None, "1 skipped"), (MISSING, "1 failed"), ("npm", "1 skipped")])
def test_pytest_reports_the_test_skipped_or_failed(tmp_path, require, outcome):
    """What a run reports, end to end: a test needing a missing tool, under each CLAWRL_REQUIRE."""
    (tmp_path / "test_needs_tool.py").write_text(
        "from tests.required_tools import skip_unless_available\n\n"
        "def test_needs_tool():\n"
        f"    skip_unless_available({MISSING!r}, 'the tool is missing')\n")
    env = {k: v for k, v in os.environ.items() if k != "CLAWRL_REQUIRE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if require is not None:
        env["CLAWRL_REQUIRE"] = require
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider",
                           "test_needs_tool.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert outcome in proc.stdout, proc.stdout + proc.stderr
    assert "the tool is missing" in proc.stdout, proc.stdout
