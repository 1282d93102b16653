"""What a terminal task is once its directory has been read, whatever its format.

Harbor (Terminal-Bench 2.0) and Terminal-Bench 1.0 task directories both become a
``TerminalTaskSpec``: the instruction, the limits, where the environment's Dockerfile and build
context are, the tests (copied into the sandbox only after the agent stops, so the agent cannot
read them), the command that runs them and the oracle solution. A spec is data only: reading a
task never refuses it, so ``clawrl env list`` shows every task; whether the host can run it is
decided when its environment is planned (``clawrl.envs.task_formats.dockerfile``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from clawrl.envs.base import EnvError, Task

HARBOR = "harbor"
TB1 = "tb1"
ROWS = "rows"
FORMATS = (HARBOR, TB1, ROWS)
UNSPLIT = "unsplit"  # the split of a task that declares none
TESTS_DIR = "/tests"  # where tests are copied when the agent has stopped
SOLUTION_DIR = "/solution"  # where the oracle's files are copied
VERIFIER_LOGS = "/logs/verifier"  # reward.txt / reward.json land here
DEFAULT_WORKDIR = "/app"


class TaskRefused(EnvError):
    """A task this host cannot run as written (its own image, network, a failing Dockerfile line);
    the one-line message says which and why."""


@dataclass(frozen=True)
class TerminalTaskSpec:
    """One terminal task, read from a Harbor or Terminal-Bench 1.0 directory."""

    task_id: str
    format: str  # "harbor" | "tb1"
    path: Path  # the task directory
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    cpus: Optional[float]
    memory_mb: Optional[int]
    network: bool  # the task asks for network (refused: no backend of ours has any)
    dockerfile: Optional[Path]
    build_context: Optional[Path]  # COPY/ADD sources are relative to this directory
    tests_dir: Optional[Path]  # its files are copied to /tests after the agent stops
    test_command: str  # run from the working directory, within verifier_timeout_s
    solution: Optional[Path]  # the oracle script (solve.sh / solution.sh); None: no oracle
    parser: Optional[str]  # tb1 parser_name ("pytest"); None: the reward file decides
    extra_test_files: tuple[Path, ...] = ()  # copied to /tests beside tests_dir (tb1: run-tests.sh)
    test_env: dict[str, str] = field(default_factory=dict)  # the verifier's extra environment
    task_env: dict[str, str] = field(default_factory=dict)  # the environment's (tb1 compose "environment:")
    build_timeout_s: float = 600.0  # each Dockerfile RUN line gets this long
    image: Optional[str] = None  # a prebuilt image named by the task instead of a Dockerfile
    refusal: Optional[str] = None  # known unrunnable when read (e.g. several compose services)
    workdir: Optional[str] = None  # the task's declared working directory (else the Dockerfile's)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskRecord:
    """One line of ``clawrl env list``: ``ID<TAB>SPLIT<TAB>FORMAT``. For harbor and tb1 tasks
    ``task.data["spec"]`` holds the TerminalTaskSpec; for rows it is the row itself."""

    task: Task
    split: str
    format: str


def positive_number(value: Any, what: str) -> float:
    """``value`` as a float when it is a positive number (not a bool); otherwise EnvError saying
    ``what`` must be one (``what`` names the file and key, and the unit if any)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise EnvError(f"{what}, not {value!r}")
    return float(value)


def spec_of(task: Task) -> TerminalTaskSpec:
    """The TerminalTaskSpec a discovered terminal task carries; EnvError for a row task."""
    spec = task.data.get("spec")
    if not isinstance(spec, TerminalTaskSpec):
        raise EnvError(f"task {task.task_id!r} is not a terminal task (no Harbor or Terminal-Bench spec)")
    return spec
