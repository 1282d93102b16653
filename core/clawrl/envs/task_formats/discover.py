"""Find the tasks under a path, detecting the format of each task on its own.

A path is one of: a task directory (``task.toml``: Harbor; ``task.yaml``: Terminal-Bench 1.0), a
directory of task directories (formats may be mixed), a row dataset directory (``dataset.toml``
and/or ``data/<split>.jsonl``) or a ``.jsonl`` instance file. Ids are stable: a task directory's
name, or a row's ``task_id``/``id`` (else split-lineno). Splits are declared by the task (Harbor
``[metadata] split``, task.yaml ``split``) or by the row file's name; undeclared is "unsplit".
"""
from __future__ import annotations

from pathlib import Path

from clawrl.envs.base import EnvError, Task
from clawrl.envs.task_formats.harbor import TASK_FILE as HARBOR_FILE
from clawrl.envs.task_formats.harbor import is_harbor_task, read_harbor
from clawrl.envs.task_formats.rows import is_row_dataset, read_rows, split_files
from clawrl.envs.task_formats.spec import HARBOR, ROWS, TB1, TaskRecord
from clawrl.envs.task_formats.tb1 import TASK_FILE as TB1_FILE
from clawrl.envs.task_formats.tb1 import is_tb1_task, read_tb1

_SKIPPED_DIRS = {"__pycache__", "node_modules"}


def detect_format(path: Path) -> str | None:
    """"harbor", "tb1" or "rows" for a directory that is one task (or one row dataset); None for
    anything else. EnvError when a directory is both a Harbor and a Terminal-Bench task."""
    if not path.is_dir():
        return None
    harbor, tb1 = is_harbor_task(path), is_tb1_task(path)
    if harbor and tb1:
        raise EnvError(f"{path} holds both {HARBOR_FILE} (Harbor) and {TB1_FILE} (Terminal-Bench 1.0); keep one")
    if harbor:
        return HARBOR
    if tb1:
        return TB1
    return ROWS if is_row_dataset(path) else None


def discover(path: Path | str) -> list[TaskRecord]:
    """Every task under ``path`` (see the module docstring); EnvError, one line, when the path
    holds none or two tasks share an id."""
    path = Path(path).expanduser()
    if not path.exists():
        raise EnvError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix == ".jsonl":
            records = _rows_of_file(path)
        elif path.name in (HARBOR_FILE, TB1_FILE):
            records = _records_of(path.parent, detect_format(path.parent))
        else:
            raise EnvError(f"{path} is not a task: expected a task directory, a dataset directory or a .jsonl file")
    else:
        fmt = detect_format(path)
        if fmt is not None:
            records = _records_of(path, fmt)
        else:
            records = []
            for child in sorted(path.iterdir()):
                if child.name.startswith(".") or child.name in _SKIPPED_DIRS:
                    continue
                if child.is_file() and child.suffix == ".jsonl":
                    records += _rows_of_file(child)
                elif child.is_dir():
                    records += _records_of(child, detect_format(child))
    if not records:
        raise EnvError(f"{path} holds no task (expected {HARBOR_FILE} (Harbor), {TB1_FILE} (Terminal-Bench 1.0), "
                       f"dataset.toml or data/<split>.jsonl, a .jsonl file, or a directory of these)")
    _check_unique(records, path)
    return records


def _records_of(path: Path, fmt: str | None) -> list[TaskRecord]:
    if fmt == HARBOR:
        spec, split = read_harbor(path)
    elif fmt == TB1:
        spec, split = read_tb1(path)
    elif fmt == ROWS:
        return [r for file in split_files(path) for r in _rows_of_file(file)]
    else:
        return []
    return [TaskRecord(task=Task(task_id=spec.task_id, data={"spec": spec}), split=split, format=fmt)]


def _rows_of_file(file: Path) -> list[TaskRecord]:
    split = file.stem
    return [TaskRecord(task=t, split=split, format=ROWS) for t in read_rows(file, split)]


def _check_unique(records: list[TaskRecord], path: Path) -> None:
    seen: dict[str, TaskRecord] = {}
    for r in records:
        other = seen.get(r.task.task_id)
        if other is not None:
            raise EnvError(f"{path}: task id {r.task.task_id!r} appears twice ({other.format} {other.split}, "
                           f"{r.format} {r.split}); ids must be unique")
        seen[r.task.task_id] = r
