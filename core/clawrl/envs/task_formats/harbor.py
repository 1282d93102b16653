"""Harbor (Terminal-Bench 2.0) task directories, the format SkyRL and rLLM read.

A task directory holds ``instruction.md`` and ``task.toml`` (``[agent] timeout_sec``,
``[verifier] timeout_sec`` and ``env``, ``[environment]`` resources, ``[metadata]``), optionally
``environment/Dockerfile`` with its build context ``environment/``, ``tests/test.sh`` (which
writes a reward to /logs/verifier/reward.txt or reward.json) and ``solution/solve.sh``.

Settings we read from ``[environment]``: ``cpus``, ``memory_mb`` (or the older ``memory`` as
"2G"/"512M"), ``build_timeout_sec``, ``workdir``, ``docker_image`` (a prebuilt image: only a
common base image runs here), and network: ``allow_internet = true`` or a ``network_mode`` other
than "no-network" (or Docker's "none") asks for network, which is refused when the task is run. The split is
``[metadata] split``. Unknown keys are ignored, as Harbor ignores them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from clawrl.envs.base import EnvError
from clawrl.envs.task_formats.spec import HARBOR, TESTS_DIR, UNSPLIT, TerminalTaskSpec, positive_number

# network_mode values that mean no network: Harbor's own "no-network" (its modes are public,
# no-network and allowlist) and Docker's "none".
NO_NETWORK_MODES = ("no-network", "none", "")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the optional tomli package, if installed
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

TASK_FILE = "task.toml"
INSTRUCTION_FILE = "instruction.md"
DEFAULT_TIMEOUT_S = 600.0  # Harbor's own default for agent and verifier


def is_harbor_task(path: Path) -> bool:
    return (path / TASK_FILE).is_file()


def read_harbor(path: Path) -> tuple[TerminalTaskSpec, str]:
    """The spec and declared split of the Harbor task directory ``path``; EnvError naming the file
    and key for anything malformed."""
    toml_file = path / TASK_FILE
    if tomllib is None:
        raise EnvError(f"{toml_file}: reading Harbor tasks needs Python 3.11+ or the tomli package (pip install tomli)")
    try:
        config = tomllib.loads(toml_file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise EnvError(f"{toml_file}: cannot read ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise EnvError(f"{toml_file}: not TOML ({e})") from None
    instruction_file = path / INSTRUCTION_FILE
    if not instruction_file.is_file():
        raise EnvError(f"{path}: a Harbor task needs {INSTRUCTION_FILE} beside {TASK_FILE}")
    agent = _table(config, "agent", toml_file)
    verifier = _table(config, "verifier", toml_file)
    environment = _table(config, "environment", toml_file)
    metadata = _table(config, "metadata", toml_file)
    split = metadata.get("split", UNSPLIT)
    if not isinstance(split, str) or not split.strip():
        raise EnvError(f"{toml_file}: [metadata] split must be a non-empty string, not {split!r}")

    env_dir = path / "environment"
    dockerfile = env_dir / "Dockerfile"
    tests_dir = path / "tests"
    solve = path / "solution" / "solve.sh"
    verifier_env = verifier.get("env", {})
    if not isinstance(verifier_env, dict):
        raise EnvError(f"{toml_file}: [verifier] env must be a table of strings")
    refusal = None if (tests_dir / "test.sh").is_file() else f"{path.name} has no tests/test.sh to verify it"
    spec = TerminalTaskSpec(
        task_id=path.name,
        format=HARBOR,
        path=path,
        instruction=instruction_file.read_text(),
        agent_timeout_s=_seconds(agent, "timeout_sec", "agent", toml_file),
        verifier_timeout_s=_seconds(verifier, "timeout_sec", "verifier", toml_file),
        cpus=_positive(environment, "cpus", toml_file),
        memory_mb=_memory_mb(environment, toml_file),
        network=_asks_network(environment, toml_file),
        dockerfile=dockerfile if dockerfile.is_file() else None,
        build_context=env_dir if env_dir.is_dir() else None,
        tests_dir=tests_dir if tests_dir.is_dir() else None,
        test_command="bash /tests/test.sh",
        solution=solve if solve.is_file() else None,
        parser=None,
        # TEST_DIR as Terminal-Bench 1.0 sets it: tasks converted from it still read it
        test_env={"TEST_DIR": TESTS_DIR, **{str(k): str(v) for k, v in verifier_env.items()}},
        build_timeout_s=_seconds(environment, "build_timeout_sec", "environment", toml_file),
        image=_optional_str(environment, "docker_image", toml_file),
        refusal=refusal,
        workdir=_optional_str(environment, "workdir", toml_file),
        metadata=dict(metadata),
    )
    return spec, split


def _table(config: dict, name: str, file: Path) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise EnvError(f"{file}: [{name}] must be a table")
    return table


def _seconds(table: dict, key: str, section: str, file: Path) -> float:
    return positive_number(table.get(key, DEFAULT_TIMEOUT_S),
                           f"{file}: [{section}] {key} must be a positive number of seconds")


def _positive(table: dict, key: str, file: Path) -> Optional[float]:
    value = table.get(key)
    return None if value is None else positive_number(value, f"{file}: [environment] {key} must be a positive number")


def _optional_str(table: dict, key: str, file: Path) -> Optional[str]:
    value = table.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise EnvError(f"{file}: [environment] {key} must be a non-empty string, not {value!r}")
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_MB_PER_UNIT = {"": 1 / 1024**2, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024**2}


def _memory_mb(table: dict, file: Path) -> Optional[int]:
    """``memory_mb`` (a number), or the older ``memory`` ("2G", "512M", a number of MB)."""
    value = table.get("memory_mb")
    key = "memory_mb"
    if value is None and "memory" in table:
        value, key = table["memory"], "memory"
        if isinstance(value, str):
            m = _SIZE.match(value)
            if not m:
                raise EnvError(f"{file}: [environment] memory must look like 2G or 512M, not {value!r}")
            value = float(m.group(1)) * _MB_PER_UNIT[m.group(2).lower()]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise EnvError(f"{file}: [environment] {key} must be a positive number of MB, not {value!r}")
    return int(value)


def _asks_network(table: dict, file: Path) -> bool:
    allow = table.get("allow_internet", False)
    if not isinstance(allow, bool):
        raise EnvError(f"{file}: [environment] allow_internet must be true or false, not {allow!r}")
    mode = table.get("network_mode", "none")
    return allow or (isinstance(mode, str) and mode.strip().lower() not in NO_NETWORK_MODES)
