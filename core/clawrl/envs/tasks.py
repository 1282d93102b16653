"""Task sets by name or path, with splits.

A task set on disk is a row dataset in rLLM's layout: ``dataset.toml`` (optional; ``name`` and
``description``) beside ``data/<split>.jsonl``, one JSON object per task. A row's ``task_id`` (or
``id``) names it; without one the task is named by its split and line number, so ids stay stable
as long as the file does. Everything else in the row is the task's data, handed to the
environment's ``reset``. An environment that generates its tasks (``Env.tasks``) needs no files.
"""
from __future__ import annotations

import json
from pathlib import Path

from clawrl.envs.base import Env, EnvError, Task


def load_tasks(source: str | None, split: str, env_cls: type[Env]) -> list[Task]:
    """The tasks of ``split`` from the dataset directory ``source``, or the environment's own."""
    if source is None:
        tasks = env_cls.tasks(split)
    else:
        tasks = _read_split(Path(source).expanduser(), split)
    if not tasks:
        raise EnvError(f"the {split} split has no tasks")
    seen: set[str] = set()
    for t in tasks:
        if t.task_id in seen:
            raise EnvError(f"task id {t.task_id!r} appears twice in the {split} split")
        seen.add(t.task_id)
    return tasks


def _read_split(root: Path, split: str) -> list[Task]:
    if not root.is_dir():
        raise EnvError(f"task set {root} is not a directory (expected dataset.toml and data/<split>.jsonl)")
    file = root / "data" / f"{split}.jsonl"
    if not file.is_file():
        have = sorted(p.stem for p in (root / "data").glob("*.jsonl")) if (root / "data").is_dir() else []
        raise EnvError(f"task set {root} has no {split} split ({file} is missing; splits: {', '.join(have) or 'none'})")
    tasks = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise EnvError(f"{file}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise EnvError(f"{file}:{n}: a task is a JSON object")
        task_id = str(row.pop("task_id", row.pop("id", f"{split}-{n}")))
        tasks.append(Task(task_id=task_id, data=row))
    return tasks
