"""Row datasets in rLLM's layout: ``dataset.toml`` (optional; ``name``, ``description``) beside
``data/<split>.jsonl``, one JSON object per task, or a bare ``.jsonl`` instance file.

A row's ``task_id`` (or ``id``, or a SWE-bench ``instance_id``) names it; without one the task is named by its split and line
number, so ids stay stable as long as the file does. Everything else in the row is the task's
data, handed to the environment's ``reset``. A file's split is its stem (``data/test.jsonl``:
test).
"""
from __future__ import annotations

import json
from pathlib import Path

from clawrl.envs.base import EnvError, Task

DATASET_FILE = "dataset.toml"
DATA_DIR = "data"


def is_row_dataset(path: Path) -> bool:
    return (path / DATASET_FILE).is_file() or any((path / DATA_DIR).glob("*.jsonl"))


def split_files(root: Path) -> list[Path]:
    """The ``data/<split>.jsonl`` files of the dataset directory ``root``, by split name."""
    return sorted((root / DATA_DIR).glob("*.jsonl"))


def read_rows(file: Path, split: str) -> list[Task]:
    """The tasks of one .jsonl file; blank lines are skipped, line numbers count them."""
    tasks = []
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise EnvError(f"{file}: cannot read ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise EnvError(f"{file}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise EnvError(f"{file}:{n}: a task is a JSON object")
        # SWE-bench instance files name their rows by instance_id, which the row keeps
        task_id = str(row.pop("task_id", row.pop("id", row.get("instance_id", f"{split}-{n}"))))
        tasks.append(Task(task_id=task_id, data=row))
    return tasks


def read_split(root: Path, split: str) -> list[Task]:
    """The tasks of ``split`` in the dataset directory ``root``."""
    if not root.is_dir():
        raise EnvError(f"task set {root} is not a directory (expected dataset.toml and data/<split>.jsonl)")
    file = root / DATA_DIR / f"{split}.jsonl"
    if not file.is_file():
        have = [p.stem for p in split_files(root)]
        raise EnvError(f"task set {root} has no {split} split ({file} is missing; splits: {', '.join(have) or 'none'})")
    return read_rows(file, split)
