"""Resolved, as SWE-bench's harness means it: the patch on a fresh copy, then the tests.

A fresh sandbox gets the instance's buggy working copy (``testbed.materialise``); the patch is
applied (git apply, else patch --fuzz; one that applies neither way resolves nothing); the test
paths are put back as the instance has them, and its ``test_patch`` applied on top, so a patch that
edits the tests cannot pass them; then the suite runs once, and the instance is resolved when every
FAIL_TO_PASS and every PASS_TO_PASS test passes.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from clawrl.envs.base import EnvError
from clawrl.envs.swe.instances import Instance, refusal
from clawrl.envs.swe.testbed import apply_patch, materialise, open_testbed, run, run_tests


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
        paths = " ".join(shlex.quote(t) for t in inst.source.tests)
        await run(sandbox, f"git checkout HEAD -- {paths} && git clean -fdq -- {paths}", "restoring the tests")
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
    return Verdict(resolved, True, f2p_passed, f2p, p2p_failed, p2p, detail)
