"""Resolved, as SWE-bench's harness means it: the patch on a fresh copy, then the tests.

A fresh sandbox gets the instance's buggy working copy (``testbed.materialise``); the patch is
applied (git apply, else patch --fuzz; one that applies neither way resolves nothing); the test
paths, and any test-harness file the patch touched (``HARNESS_FILES``: conftest.py, pytest's ini
files, sitecustomize.py, ``.pth`` files), are put back as the instance has them, and its
``test_patch`` applied on top, so a patch cannot pass the tests by changing them or how they are
run; then the suite runs once, and the instance is resolved when every
FAIL_TO_PASS and every PASS_TO_PASS test passes.
"""
from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

from clawrl.envs.base import EnvError
from clawrl.envs.swe.instances import Instance, refusal
from clawrl.envs.swe.testbed import apply_patch, materialise, open_testbed, run, run_tests

# Files that change how tests run or what they report rather than what the library does: a
# conftest.py hook can turn every failure into a pass, an ini file can deselect tests, and a
# sitecustomize.py on PYTHONPATH runs before pytest does. A patch's changes to them are undone.
HARNESS_FILES = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
                 "usercustomize.py"}


@dataclass
class Verdict:
    resolved: bool
    applied: bool
    f2p_passed: int
    f2p_total: int
    p2p_failed: int
    p2p_total: int
    detail: str

    @property
    def f2p_share(self) -> float:
        return self.f2p_passed / self.f2p_total if self.f2p_total else 0.0

    def as_info(self) -> dict:
        return {"resolved": self.resolved, "patch_applied": self.applied, "f2p_passed": self.f2p_passed,
                "f2p_total": self.f2p_total, "p2p_failed": self.p2p_failed, "p2p_total": self.p2p_total,
                "verdict": self.detail}


async def evaluate(sandbox_cfg, inst: Instance, patch: str) -> Verdict:
    """Judge ``patch`` (a unified diff; "" for none) on ``inst`` in a sandbox of its own."""
    reason = refusal(inst)
    if reason is not None:
        raise EnvError(reason)
    f2p, p2p = len(inst.fail_to_pass), len(inst.pass_to_pass)
    sandbox = open_testbed(sandbox_cfg)
    try:
        await materialise(sandbox, inst.source, inst.patch, inst.base_commit)
        if patch.strip() and not await apply_patch(sandbox, patch, "model"):
            return Verdict(False, False, 0, f2p, p2p, p2p, "the patch does not apply")
        harness = await restore_test_harness(sandbox, inst.source.tests)
        if inst.test_patch.strip() and not await apply_patch(sandbox, inst.test_patch, "tests"):
            raise EnvError(f"instance {inst.instance_id}: its test_patch does not apply")
        tests = await run_tests(sandbox, inst.source, inst.source.test_timeout_s)
    finally:
        await sandbox.close()
    f2p_passed = sum(tests.passing(t) for t in inst.fail_to_pass)
    p2p_failed = sum(not tests.passing(t) for t in inst.pass_to_pass)
    resolved = f2p_passed == f2p and p2p_failed == 0
    if tests.timed_out:
        detail = f"the tests ran past {inst.source.test_timeout_s:.0f} s"
    else:
        detail = f"FAIL_TO_PASS {f2p_passed}/{f2p} pass, PASS_TO_PASS {p2p - p2p_failed}/{p2p} pass"
    if harness:
        detail += f"; the patch's changes to {', '.join(harness)} were undone before the tests ran"
    return Verdict(resolved, True, f2p_passed, f2p, p2p_failed, p2p, detail)


async def restore_test_harness(sandbox, test_paths) -> list[str]:
    """Undo the patch's changes to the test paths and to test-harness files anywhere; the
    harness files it had touched."""
    paths = " ".join(shlex.quote(t) for t in test_paths)
    await run(sandbox, f"git checkout HEAD -- {paths} && git clean -fdq -- {paths}", "restoring the tests")
    changed = (await run(sandbox, "git add -A && git diff --cached --name-only --no-renames HEAD",
                         "listing the changed files")).stdout.split("\n")
    harness = [p for p in changed if p and (posixpath.basename(p) in HARNESS_FILES or p.endswith(".pth"))]
    for path in harness:
        quoted = shlex.quote(path)
        await run(sandbox, f"if git cat-file -e HEAD:{quoted} 2>/dev/null; then git checkout HEAD -- {quoted}; "
                           f"else git rm -q --cached -- {quoted} && rm -f -- {quoted}; fi", "restoring " + path)
    return harness
