"""Task formats the field uses, read per task: Harbor (Terminal-Bench 2.0) and Terminal-Bench 1.0
task directories, and rLLM-style row datasets.

- ``discover(path)``: every task under a path, as ``TaskRecord(task, split, format)``
  (``discover.py``; the formats in ``harbor.py``, ``tb1.py``, ``rows.py``);
- ``plan_environment(spec)``: a terminal task's Dockerfile read as a plan for the host, or
  TaskRefused with the reason (``dockerfile.py``; its words in ``dockerfile_words.py``, the
  build context's ``.dockerignore`` in ``dockerignore.py``);
- ``prepare_environment(spec, sandbox)``: that plan applied in a sandbox (``environment.py``;
  package installs the host already satisfies are skipped, ``packages.py``);
- ``verify(spec, sandbox)`` and ``run_oracle(spec, sandbox)``: the task's tests after the agent
  stops, and its reference solution (``verifier.py``; reward files and pytest reports in
  ``rewards.py``).
"""
from clawrl.envs.task_formats.discover import detect_format, discover
from clawrl.envs.task_formats.dockerfile import EnvironmentPlan, plan_environment
from clawrl.envs.task_formats.environment import prepare_environment
from clawrl.envs.task_formats.spec import (FORMATS, HARBOR, ROWS, TB1, UNSPLIT, TaskRecord, TaskRefused,
                                           TerminalTaskSpec, spec_of)
from clawrl.envs.task_formats.verifier import Verdict, copy_solution, run_oracle, verify

__all__ = ["FORMATS", "HARBOR", "ROWS", "TB1", "UNSPLIT", "EnvironmentPlan", "TaskRecord", "TaskRefused",
           "TerminalTaskSpec", "Verdict", "copy_solution", "detect_format", "discover", "plan_environment",
           "prepare_environment", "run_oracle", "spec_of", "verify"]
