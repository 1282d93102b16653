"""Task sets by name or path, with splits, for environments that take rows.

A task set on disk is a row dataset in rLLM's layout (``clawrl.envs.task_formats.rows``):
``dataset.toml`` beside ``data/<split>.jsonl``. An environment that generates its tasks
(``Env.tasks``) needs no files. Terminal task directories (Harbor, Terminal-Bench 1.0) are found
by ``clawrl.envs.task_formats.discover``.
"""
from __future__ import annotations

from pathlib import Path

from clawrl.envs.base import Env, EnvError, Task
from clawrl.envs.task_formats.rows import read_split


def load_tasks(source: str | None, split: str, env_cls: type[Env]) -> list[Task]:
    """The tasks of ``split`` from the dataset directory ``source``, or the environment's own."""
    if source is None:
        tasks = env_cls.tasks(split)
    else:
        tasks = read_split(Path(source).expanduser(), split)
    if not tasks:
        raise EnvError(f"the {split} split has no tasks")
    seen: set[str] = set()
    for t in tasks:
        if t.task_id in seen:
            raise EnvError(f"task id {t.task_id!r} appears twice in the {split} split")
        seen.add(t.task_id)
    return tasks
