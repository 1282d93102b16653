"""Task sets by name or path, with splits, for environments that take rows.

A task set on disk is a row dataset in rLLM's layout (``clawrl.envs.task_formats.rows``):
``dataset.toml`` beside ``data/<split>.jsonl``; any other path is read by
``clawrl.envs.task_formats.discover`` (Harbor and Terminal-Bench 1.0 task directories, each with its
declared split). An environment that generates its tasks (``Env.tasks``) needs no files.
"""
from __future__ import annotations

from pathlib import Path

from clawrl.envs.base import Env, EnvError, Task
from clawrl.envs.task_formats.discover import discover
from clawrl.envs.task_formats.rows import is_row_dataset, read_split


def load_tasks(source: str | None, split: str, env_cls: type[Env]) -> list[Task]:
    """The tasks of ``split`` from ``source`` (a row dataset directory, or any task path
    ``discover`` reads: task directories of any format, a .jsonl file), or the environment's own."""
    if source is None:
        tasks = env_cls.tasks(split)
    elif is_row_dataset(root := Path(source).expanduser()):
        tasks = read_split(root, split)
    else:
        records = discover(root)
        tasks = [r.task for r in records if r.split == split]
        if not tasks:
            have = sorted({r.split for r in records})
            raise EnvError(f"task set {root} has no {split} split (splits: {', '.join(have)})")
    if not tasks:
        raise EnvError(f"the {split} split has no tasks")
    seen: set[str] = set()
    for t in tasks:
        if t.task_id in seen:
            raise EnvError(f"task id {t.task_id!r} appears twice in the {split} split")
        seen.add(t.task_id)
    return tasks
