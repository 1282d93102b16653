"""SWE-bench instances: the JSONL rows swe-rl builds, and official SWE-bench, SWE-Gym and
SWE-smith files, read into one shape.

The schema is SWE-bench's: ``instance_id``, ``repo``, ``base_commit``, ``patch`` (the gold fix),
``test_patch``, ``problem_statement``, ``FAIL_TO_PASS``, ``PASS_TO_PASS`` (lists, or the JSON
strings of lists the official files hold). swe-rl's own rows add ``clawrl_source``, the local
source reference: the pinned sdist the working copy is rebuilt from, its test paths and their time
limit (``clawrl.envs.swe.sdists``). A row without it is an official instance whose environment is a
Docker image; clawrl has no container backend, so such an instance is refused with that reason
(``refusal``) instead of being run against the host's Python.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from clawrl.envs.base import EnvError, Task
from clawrl.envs.swe.sdists import Package, package_of

REQUIRED = ("repo", "base_commit", "patch", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")


@dataclass(frozen=True)
class Instance:
    instance_id: str
    repo: str
    base_commit: str
    patch: str
    test_patch: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    source: Optional[Package]  # None: an official instance, which needs its Docker image
    image: Optional[str]  # the image an official instance names, when it names one


def instance_of(task: Task) -> Instance:
    """The instance in a task's row; EnvError (one line) naming the first missing or malformed field."""
    row = task.data
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise EnvError(f"instance {task.task_id} is not a SWE-bench instance: it lacks {', '.join(missing)}")
    ref = row.get("clawrl_source")
    if ref is not None and not isinstance(ref, dict):
        raise EnvError(f"instance {task.task_id}: clawrl_source must be an object")
    return Instance(instance_id=str(row.get("instance_id", task.task_id)), repo=str(row["repo"]),
                    base_commit=str(row["base_commit"]), patch=str(row["patch"] or ""),
                    test_patch=str(row.get("test_patch") or ""), problem_statement=str(row["problem_statement"]),
                    fail_to_pass=_tests(row["FAIL_TO_PASS"], "FAIL_TO_PASS", task.task_id),
                    pass_to_pass=_tests(row["PASS_TO_PASS"], "PASS_TO_PASS", task.task_id),
                    source=package_of(ref) if ref is not None else None,
                    image=row.get("image_name") or row.get("docker_image"))


def refusal(inst: Instance) -> Optional[str]:
    """Why this host cannot run ``inst``, or None when it can."""
    if inst.source is not None:
        return None
    image = inst.image or f"the SWE-bench image of {inst.instance_id}"
    return (f"instance {inst.instance_id} ({inst.repo}) needs its Docker image ({image}); clawrl has no "
            f"container backend, so it is not run on the host")


def _tests(value, field: str, task_id: str) -> tuple[str, ...]:
    if isinstance(value, str):  # the official files hold JSON strings
        try:
            value = json.loads(value)
        except ValueError:
            raise EnvError(f"instance {task_id}: {field} is neither a list nor a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise EnvError(f"instance {task_id}: {field} must be a list of test ids")
    return tuple(value)
