"""A task's git working copy in a sandbox, and its test suite run there.

Every episode, evaluation and build step starts from the cached sdist: it is unpacked into
``/testbed`` (SWE-bench's path), the instance's bug is put in (the gold patch applied in reverse),
and the tree is committed once with a fixed author and date, so the commit's hash is the same on
every machine and is checked against the instance's ``base_commit``. The repository has that one
commit and no history: there is no earlier, bug-free commit for the agent to diff against.

Tests run with ``python -m pytest -rA -o addopts= -p no:cacheprovider`` (the package's own addopts
and plugins cannot change how results read: ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), and each test's
outcome is read from the ``-rA`` summary, the way SWE-bench's log parsers read pytest's.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from clawrl.envs.base import EnvError
from clawrl.envs.sandbox import ExecResult, Sandbox, open_sandbox
from clawrl.envs.swe.sdists import Package, sdist_path

WORKDIR = "/testbed"
GIT_ENV = {"GIT_AUTHOR_NAME": "swe-rl", "GIT_AUTHOR_EMAIL": "swe-rl@clawrl.invalid",
           "GIT_COMMITTER_NAME": "swe-rl", "GIT_COMMITTER_EMAIL": "swe-rl@clawrl.invalid",
           "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
COMMIT_MESSAGE = "swe-rl task"
# Never part of the tree: what running Python and pytest leave behind.
EXCLUDES = "__pycache__/\n*.pyc\n.pytest_cache/\n"
# COLUMNS: the -rA summary cuts messages at the terminal width, and the build quotes them.
# PYTHONHASHSEED: suites that parametrize over a set (isodate's) name their tests by position, so
# with hash randomisation the same test has another id on every run.
TEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "320",
            "PYTHONHASHSEED": "0"}
PASSING = ("PASSED", "XFAIL")
# a node id is one word, or a word with a [parameter id] that may hold spaces and " - "
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S*?\[.*?\](?= - |$)|\S+)(?: - (.*))?$")


@dataclass
class TestRun:
    """One run of the suite: each test's outcome (PASSED, FAILED, ERROR, ...), and the first line
    of each failure's message (the ``-rA`` summary's text after `` - ``)."""

    outcomes: dict[str, str]
    messages: dict[str, str]
    timed_out: bool
    duration_s: float
    tail: str  # the last lines of the run's output, for reasons

    def passing(self, test: str) -> bool:
        return self.outcomes.get(test) in PASSING


def open_testbed(sandbox_cfg) -> Sandbox:
    return open_sandbox(sandbox_cfg, workdir=WORKDIR, writable=(WORKDIR, "/tmp"), env=dict(TEST_ENV))


async def run(sandbox: Sandbox, command: str, what: str, timeout_s: float = 120.0) -> ExecResult:
    """``command`` in the testbed; EnvError naming ``what`` failed when it exits non-zero."""
    result = await sandbox.exec(command, timeout_s=timeout_s, env=GIT_ENV)
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise EnvError(f"{what} failed (exit {result.returncode}): {last[0][:300]}")
    return result


async def unpack(sandbox: Sandbox, pkg: Package) -> None:
    """The package's pristine sdist into ``/testbed``."""
    archive = sdist_path(pkg).read_bytes()
    result = await sandbox.exec(["tar", "-xz", "--strip-components=1", "--no-same-owner", "-C", WORKDIR],
                                stdin=archive, timeout_s=120)
    if result.returncode != 0:
        raise EnvError(f"cannot unpack {pkg.name} {pkg.version}: {result.stderr.strip()[:300]}")


async def commit_tree(sandbox: Sandbox) -> str:
    """Commit the working tree as the repository's only commit; its hash."""
    await run(sandbox, f"git init -q && printf {shlex.quote(EXCLUDES)} > .git/info/exclude && git add -A && "
                       f"git commit -q --no-verify -m {shlex.quote(COMMIT_MESSAGE)}", "git commit")
    return (await run(sandbox, "git rev-parse HEAD", "git rev-parse")).stdout.strip()


async def apply_patch(sandbox: Sandbox, patch: str, name: str, reverse: bool = False) -> bool:
    """Apply ``patch`` in the testbed (git apply, then patch --fuzz as SWE-bench's harness does);
    False when neither applies it."""
    path = f"/tmp/{name}.diff"
    await sandbox.write_file(path, patch if patch.endswith("\n") else patch + "\n")
    flag = " -R" if reverse else ""
    result = await sandbox.exec(f"git apply --whitespace=nowarn{flag} {path} || "
                                f"patch --batch --fuzz=5 -p1{flag} -i {path}", timeout_s=60, env=GIT_ENV)
    await sandbox.exec(["rm", "-f", path], timeout_s=30)
    return result.returncode == 0


async def materialise(sandbox: Sandbox, pkg: Package, bug_fix: str, base_commit: str | None) -> str:
    """The task's buggy working copy in ``/testbed``: the sdist with ``bug_fix`` undone, committed.
    EnvError when the commit is not ``base_commit`` (the cache or the instance file changed)."""
    await unpack(sandbox, pkg)
    if bug_fix and not await apply_patch(sandbox, bug_fix, "bug", reverse=True):
        raise EnvError(f"the instance's patch does not reverse-apply to {pkg.name} {pkg.version}")
    head = await commit_tree(sandbox)
    if base_commit is not None and head != base_commit:
        raise EnvError(f"the rebuilt working copy is commit {head[:12]}, the instance says {base_commit[:12]}")
    return head


def test_command(pkg: Package) -> str:
    pythonpath = ":".join(WORKDIR if p in (".", "") else f"{WORKDIR}/{p.strip('/')}" for p in pkg.pythonpath)
    tests = " ".join(shlex.quote(t) for t in pkg.tests)
    return (f"PYTHONPATH={shlex.quote(pythonpath)} python3 -m pytest -rA -q --color=no -o addopts= "
            f"-p no:cacheprovider --rootdir {WORKDIR} {tests}")


async def run_tests(sandbox: Sandbox, pkg: Package, timeout_s: float) -> TestRun:
    """The package's tests in the testbed, each test's outcome parsed from the -rA summary."""
    result = await sandbox.exec(test_command(pkg), timeout_s=timeout_s)
    outcomes, messages = parse_summary(result.stdout)
    tail = "\n".join((result.stdout + "\n" + result.stderr).strip().splitlines()[-5:])
    return TestRun(outcomes, messages, result.timed_out, result.duration_s, tail)


def parse_summary(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Outcome and message per node id from pytest's ``-rA`` short summary."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for line in text.splitlines():
        m = _SUMMARY.match(line)
        if m is None:
            continue
        status, test, message = m.groups()
        outcomes[test] = status
        if message:
            messages[test] = message.strip()
    return outcomes, messages


async def diff(sandbox: Sandbox) -> str:
    """The working copy's change from its commit, new files included (``git add -A; git diff --cached``)."""
    return (await run(sandbox, "git add -A && git diff --cached --no-color --no-ext-diff HEAD", "git diff")).stdout
