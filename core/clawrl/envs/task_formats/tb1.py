"""Terminal-Bench 1.0 task directories, the format OpenClaw-RL's terminal track runs.

A task directory holds ``task.yaml`` (``instruction``, or the older ``descriptions`` list whose
``base`` entry is the instruction; ``max_agent_timeout_sec``, ``max_test_timeout_sec``,
``parser_name``, optional ``split``), a ``Dockerfile`` built by ``docker-compose.yaml``,
``run-tests.sh``, ``tests/`` (``test_outputs.py``) and ``solution.sh``.

As in Terminal-Bench, ``tests/`` and ``run-tests.sh`` are copied to /tests after the agent stops
and ``bash /tests/run-tests.sh`` runs with ``TEST_DIR=/tests``; its pytest output is parsed and the
reward is the share of tests passed. The compose file is read for what matters here: one service
(several need their own network of containers: refused), its build context and Dockerfile, an
image of its own, and a network it asks for. A ``solution.yaml`` (keystrokes for tmux) is not an
oracle we can run: such a task has none.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from clawrl.envs.base import EnvError
from clawrl.envs.task_formats.spec import TB1, TESTS_DIR, UNSPLIT, TerminalTaskSpec, positive_number

TASK_FILE = "task.yaml"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml")
# Terminal-Bench 1.0's defaults when task.yaml leaves a limit out.
DEFAULT_AGENT_TIMEOUT_S = 180.0
DEFAULT_TEST_TIMEOUT_S = 30.0
PARSERS = ("pytest",)


def is_tb1_task(path: Path) -> bool:
    return (path / TASK_FILE).is_file()


def read_tb1(path: Path) -> tuple[TerminalTaskSpec, str]:
    """The spec and declared split of the Terminal-Bench 1.0 task directory ``path``."""
    task_file = path / TASK_FILE
    config = _yaml_mapping(task_file)
    instruction = _instruction(config, task_file)
    split = config.get("split", UNSPLIT)
    if not isinstance(split, str) or not split.strip():
        raise EnvError(f"{task_file}: split must be a non-empty string, not {split!r}")
    parser = config.get("parser_name", "pytest")
    if parser not in PARSERS:
        raise EnvError(f"{task_file}: parser_name {parser!r} is not one we read (known: {', '.join(PARSERS)})")

    context, dockerfile, image, network, refusal, task_env = _compose(path)
    tests_dir = path / "tests"
    run_tests = path / "run-tests.sh"
    solution = path / "solution.sh"
    # Without run-tests.sh, the tests are run as Terminal-Bench's own template does: pytest on /tests.
    test_command = "bash /tests/run-tests.sh" if run_tests.is_file() else f"python3 -m pytest -rA {TESTS_DIR}"
    metadata = {k: v for k, v in config.items() if k not in ("instruction", "descriptions")}
    if not solution.is_file() and (path / "solution.yaml").is_file():
        metadata["no_oracle_reason"] = "solution.yaml holds tmux keystrokes, not a script"
    spec = TerminalTaskSpec(
        task_id=path.name,
        format=TB1,
        path=path,
        instruction=instruction,
        agent_timeout_s=_seconds(config, "max_agent_timeout_sec", DEFAULT_AGENT_TIMEOUT_S, task_file),
        verifier_timeout_s=_seconds(config, "max_test_timeout_sec", DEFAULT_TEST_TIMEOUT_S, task_file),
        cpus=None,
        memory_mb=None,
        network=network,
        dockerfile=dockerfile if dockerfile.is_file() else None,
        build_context=context,
        tests_dir=tests_dir if tests_dir.is_dir() else None,
        test_command=test_command,
        solution=solution if solution.is_file() else None,
        parser=parser,
        extra_test_files=(run_tests,) if run_tests.is_file() else (),
        test_env={"TEST_DIR": TESTS_DIR},
        task_env=task_env,
        image=image,
        refusal=refusal,
        metadata=metadata,
    )
    return spec, split


def _yaml_mapping(file: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise EnvError(f"{file}: cannot read ({e})") from None
    except yaml.YAMLError as e:
        raise EnvError(f"{file}: not YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise EnvError(f"{file}: expected a mapping at the top")
    return data


def _instruction(config: dict, file: Path) -> str:
    text = config.get("instruction")
    if text is None:
        # Early Terminal-Bench 1.0 tasks: descriptions: [{key: base, description: ...}, ...]
        for entry in config.get("descriptions") or []:
            if isinstance(entry, dict) and entry.get("key", "base") == "base":
                text = entry.get("description")
                break
    if not isinstance(text, str) or not text.strip():
        raise EnvError(f"{file}: no instruction (an 'instruction' string, or a 'descriptions' entry keyed base)")
    return text


def _seconds(config: dict, key: str, default: float, file: Path) -> float:
    return positive_number(config.get(key, default), f"{file}: {key} must be a positive number of seconds")


def _compose(path: Path) -> tuple[Path, Path, Optional[str], bool, Optional[str], dict[str, str]]:
    """(build context, Dockerfile, own image or None, asks network, refusal or None, environment
    variables) from the task's docker-compose file; the task directory and its Dockerfile when
    there is none. Variables Terminal-Bench's harness fills in (${T_BENCH_...}) are left out."""
    context, dockerfile = path, path / "Dockerfile"
    file = next((path / n for n in COMPOSE_FILES if (path / n).is_file()), None)
    if file is None:
        return context, dockerfile, None, False, None, {}
    compose = _yaml_mapping(file)
    services = compose.get("services") or {}
    if not isinstance(services, dict) or not services:
        raise EnvError(f"{file}: no services")
    if len(services) > 1:
        names = ", ".join(sorted(map(str, services)))
        return context, dockerfile, None, True, (f"needs {len(services)} containers on a network of their own "
                                                 f"({names}), which the sandbox cannot provide"), {}
    service = next(iter(services.values())) or {}
    if not isinstance(service, dict):
        raise EnvError(f"{file}: a service must be a mapping")
    build = service.get("build")
    image = service.get("image")
    if isinstance(build, str):
        context = (path / build).resolve()
    elif isinstance(build, dict):
        context = (path / str(build.get("context", "."))).resolve()
        dockerfile = context / str(build.get("dockerfile", "Dockerfile"))
    if build is None and isinstance(image, str) and not image.startswith("${"):
        own_image = image  # no build: the service runs this image as it is
    else:
        own_image = None
    mode = str(service.get("network_mode", "")).strip().lower()
    network = mode not in ("", "none") or bool(service.get("ports")) or bool(service.get("extra_hosts"))
    return context, dockerfile, own_image, network, None, _service_env(service.get("environment"), file)


def _service_env(value: Any, file: Path) -> dict[str, str]:
    """A compose service's ``environment:`` (a list of NAME=value or a mapping), without the
    variables only Terminal-Bench's harness can fill in."""
    if value is None:
        return {}
    if isinstance(value, dict):
        pairs = [(str(k), "" if v is None else str(v)) for k, v in value.items()]
    elif isinstance(value, list):
        pairs = [tuple(str(item).partition("=")[::2]) for item in value]
    else:
        raise EnvError(f"{file}: a service's environment must be a list or a mapping")
    return {k: v for k, v in pairs if k and "${" not in v and k != "TEST_DIR"}
