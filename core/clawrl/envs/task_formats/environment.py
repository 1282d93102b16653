"""Build a task's environment inside its sandbox, following the Dockerfile's plan.

``prepare_environment`` applies the plan of ``clawrl.envs.task_formats.dockerfile`` to an open
sandbox: directories and files copied from the build context are written through the sandbox
(owned by its uid, so the agent may change them), ``RUN`` lines execute in the sandbox, with its
limits and without network, and the Dockerfile's ``ENV`` and last ``WORKDIR`` become the
sandbox's environment and working directory for everything after (the agent, the oracle, the
tests). A failing line refuses the task (TaskRefused) naming the line, its exit code and its last
words; a line that fetches packages is said to need network, since that is why it failed.

The sandbox is a view of the host, so a RUN line that writes to a new top-level directory
(``mkdir -p /output``) gets it: top-level directories the line names are made writable first; and
a package install the host already satisfies is skipped (``clawrl.envs.task_formats.packages``),
so the usual ``apt-get update && apt-get install -y git`` does not refuse a task whose packages
are all here.
"""
from __future__ import annotations

import asyncio
import logging
import re
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath

from clawrl.envs.sandbox import SYSTEM_TOP, Sandbox, SandboxError
from clawrl.envs.task_formats.dockerfile import (CopyStep, EnvironmentPlan, RunStep, WorkdirStep,
                                                 plan_environment)
from clawrl.envs.task_formats.packages import drop_satisfied, missing_packages
from clawrl.envs.task_formats.spec import TaskRefused, TerminalTaskSpec

log = logging.getLogger(__name__)

# Commands that fetch from the network: a RUN line that uses one and fails is reported as needing it.
FETCHES = re.compile(r"\b(apt-get|apt|apk|yum|dnf|pip3?|pipx|uv|poetry|conda|npm|npx|yarn|pnpm|curl|wget|"
                      r"git\s+clone|cargo\s+(?:install|fetch|build)|go\s+(?:get|install|mod)|gem|rustup)\b")
# An absolute path in a shell line: "/" after whitespace, a quote, "=", ":" or "(" (not inside a URL).
_ABSOLUTE = re.compile(r"(?:^|(?<=[\s\"'=(:;&|>]))/([A-Za-z0-9_][A-Za-z0-9_.-]*)")
# Top-level names never made writable even though the sandbox would allow it: the host's are not
# shown, and an empty one would only hide that a task expected the host's content there.
_NOT_CREATED = {"nix", "snap", "mnt", "media", "lost+found"}


async def prepare_environment(spec: TerminalTaskSpec, sandbox: Sandbox) -> EnvironmentPlan:
    """Build ``spec``'s environment in ``sandbox`` and make its ENV and WORKDIR the sandbox's;
    TaskRefused (one line) when the host cannot. Returns the plan it followed."""
    if sandbox.backend == "subprocess":
        raise TaskRefused(f"{spec.task_id}: terminal tasks work in absolute paths (/app, /tests, /logs/verifier), "
                          f"which sandbox.backend=subprocess would read and write on the host itself; use bwrap or "
                          f"unshare")
    plan = plan_environment(spec, base_env=sandbox.env)
    deadline = time.monotonic() + spec.build_timeout_s  # the whole build's limit, as Harbor's build_timeout_sec
    for step in plan.steps:
        try:
            if isinstance(step, WorkdirStep):
                await make_dirs(sandbox, [step.path])
            elif isinstance(step, CopyStep):
                await _copy(sandbox, step)
            elif isinstance(step, RunStep):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TaskRefused(f"{step.at}: not reached within the build limit of {spec.build_timeout_s:g} s")
                await _run(sandbox, step, left, spec.build_timeout_s)
        except TaskRefused as e:
            raise TaskRefused(f"{spec.task_id}: {e}") from None
        except SandboxError as e:
            raise TaskRefused(f"{spec.task_id}: {step.at}: {e}") from None
    if sandbox.env.get("HOME") == sandbox.workdir:
        sandbox.env["HOME"] = plan.workdir
    sandbox.env.update(plan.env)
    sandbox.env.update(spec.task_env)  # a compose file's environment overrides the image's, as in Docker
    sandbox.workdir = plan.workdir
    return plan


async def make_dirs(sandbox: Sandbox, paths: list[str]) -> None:
    """mkdir -p each in-sandbox path, as the sandbox's user (so the agent owns them)."""
    if not paths:
        return
    for top in {p.strip("/").split("/")[0] for p in paths}:
        sandbox.add_writable("/" + top)
    result = await sandbox.exec(["mkdir", "-p", "--", *paths], cwd="/")
    if result.returncode != 0:
        raise SandboxError(f"mkdir -p failed: {_last_words(result.stderr or result.stdout)}")


async def copy_into(sandbox: Sandbox, source: Path, dest: str) -> None:
    """Copy host file or directory ``source`` to in-sandbox ``dest`` (a directory's contents go
    into ``dest``), keeping file modes; used for tests and solutions as well as COPY."""
    if source.is_dir():
        dirs = [dest] + [f"{dest}/{p.relative_to(source).as_posix()}" for p in sorted(source.rglob("*")) if p.is_dir()]
        await make_dirs(sandbox, dirs)
        for p in sorted(source.rglob("*")):
            if p.is_file():
                await sandbox.write_file(f"{dest}/{p.relative_to(source).as_posix()}", p.read_bytes(),
                                         p.stat().st_mode & 0o777)
    else:
        await sandbox.write_file(dest, source.read_bytes(), source.stat().st_mode & 0o777)


async def _copy(sandbox: Sandbox, step: CopyStep) -> None:
    await make_dirs(sandbox, list(step.dirs))
    if step.content is not None:
        path, text = step.content
        await sandbox.write_file(path, text, step.chmod if step.chmod is not None else 0o644)
    for source, dest in step.files:
        if len(step.files) == 1 and not step.dirs and sandbox.host_path(dest).is_dir():
            dest = f"{dest}/{source.name}"  # COPY file /existing/dir: into it, as in Docker
        mode = step.chmod if step.chmod is not None else source.stat().st_mode & 0o777
        await sandbox.write_file(dest, source.read_bytes(), mode)
    for archive, dest in step.archives:
        await _unpack(sandbox, archive, dest, step.chmod)


async def _unpack(sandbox: Sandbox, archive: Path, dest: str, chmod: int | None) -> None:
    """ADD of a local tar archive: its members, unpacked into ``dest`` through the sandbox (links
    and devices are not recreated; a member may not leave ``dest``)."""
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        for m in members:
            name = PurePosixPath(m.name)
            if name.is_absolute() or ".." in name.parts:
                raise SandboxError(f"{archive.name}: member {m.name} would land outside {dest}")
        try:
            tar.extractall(tmp, members=members, filter="data")
        except TypeError:  # Python before 3.10.12/3.11.4 has no filter; the members were checked above
            tar.extractall(tmp, members=members)
        await copy_into(sandbox, Path(tmp), dest)
        if chmod is not None:
            await sandbox.exec(["chmod", "-R", format(chmod, "o"), dest])


async def _run(sandbox: Sandbox, step: RunStep, timeout_s: float, limit_s: float) -> None:
    command = step.command
    if isinstance(command, str):
        command, dropped = await asyncio.to_thread(drop_satisfied, command)  # asks dpkg: off the event loop
        for d in dropped:
            log.info("%s: skipped %r (already satisfied on the host)", step.at, d)
        if dropped and not command.replace("true", "").strip(" \n;&"):
            return  # every command of the line was a satisfied install
    text = command if isinstance(command, str) else " ".join(command)
    tops = {m.group(1) for m in _ABSOLUTE.finditer(text)} - SYSTEM_TOP - _NOT_CREATED
    for top in sorted(tops):
        sandbox.add_writable("/" + top)
    result = await sandbox.exec(command, cwd=step.cwd, env=step.env, timeout_s=timeout_s)
    if result.timed_out:
        raise TaskRefused(f"{step.at}: ran past the build limit of {limit_s:g} s")
    if result.returncode != 0:
        lacking = await asyncio.to_thread(missing_packages, text)
        if lacking:
            why = f" (it installs {', '.join(lacking)}, which the host lacks, and the sandbox has no network to fetch them)"
        elif FETCHES.search(text):
            why = " (it fetches from the network, and the sandbox has none)"
        else:
            why = ""
        raise TaskRefused(f"{step.at}: failed with exit code {result.returncode}{why}: "
                          f"{_last_words(result.stderr or result.stdout)}")


def _last_words(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1][:200] if lines else "no output")
