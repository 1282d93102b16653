"""Judges: score a turn from its next state (rules, a judge model, or an environment verdict).

``make_judge(cfg.judge, engine)`` builds the configured one; the ``JudgeWorker``
(``clawrl.orchestration.judging``) runs it with bounded concurrency, timeouts and retries.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from clawrl.judges.base import Judge, JudgeError, JudgeInput, Verdict, Vote, majority

if TYPE_CHECKING:
    from clawrl.config import JudgeConfig
    from clawrl.engines.base import Engine

KINDS = ("rules", "prm", "env")


def make_judge(judge_cfg: "JudgeConfig", engine: Optional["Engine"] = None) -> Judge:
    """The judge ``judge_cfg.kind`` names. ``prm`` needs ``engine``: one serving ``judge.model.path``, or a
    frozen copy of the base policy (the orchestrator decides which)."""
    if judge_cfg.kind == "rules":
        from clawrl.judges.rules import RulesJudge

        return RulesJudge()
    if judge_cfg.kind == "prm":
        from clawrl.judges.prm import PRMJudge

        if engine is None:
            raise JudgeError("judge.kind=prm needs a judge engine (judge.model.path, or the frozen base policy)")
        return PRMJudge(engine, votes=judge_cfg.votes)
    if judge_cfg.kind == "env":
        from clawrl.judges.env import EnvJudge

        return EnvJudge()
    raise JudgeError(f"unknown judge.kind '{judge_cfg.kind}'; choose one of {', '.join(KINDS)}")


__all__ = ["Judge", "JudgeError", "JudgeInput", "KINDS", "Verdict", "Vote", "majority", "make_judge"]
