"""``clawrl env build swe-rl``: SWE-bench instances made from real packages' own test suites.

For each pinned package (``packages.toml``, ``clawrl.envs.swe.sdists``), in one sandbox:

1. the sdist is unpacked into a git working copy and its tests run twice; the tests that pass are
   the baseline (the ones that already fail are left out of every instance), and a package whose
   two runs disagree (flaky tests, or test ids that change from run to run) is refused;
2. mutation sites are listed over the package's source files (``clawrl.envs.swe.mutations``) and
   visited in an order the seed fixes: shuffled per kind, then dealt round-robin across kinds so
   that every kind of bug gets its turn;
3. each mutation is kept only when at least one baseline test now fails (its FAIL_TO_PASS), every
   other one still passes (PASS_TO_PASS), the run ends within the time limit, and it breaks at most
   ``MAX_BROKEN_SHARE`` of the suite (a bug that breaks everything is an import error, not a task);
4. the kept bug becomes an instance: the gold patch is the fix (``git diff -R`` of the bug), the
   base commit is the buggy tree committed as ``testbed.commit_tree`` would, and the problem
   statement is written from the failing tests and their messages, never from the changed line.

The same seed and the same pins give byte-identical files. Each package's ``split`` (train or test)
goes into ``data/<split>.jsonl``, so the held-out split is a package that training never sees.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import shlex
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clawrl.envs.base import EnvError
from clawrl.envs.swe import mutations
from clawrl.envs.swe.sdists import Package, read_packages
from clawrl.envs.swe.testbed import COMMIT_MESSAGE, WORKDIR, commit_tree, open_testbed, run, run_tests, unpack

MAX_BROKEN_SHARE = 0.5
STATEMENT_TESTS_SHOWN = 3
MESSAGE_CHARS = 240


@dataclass
class PackagePlan:
    """What to build from one package: how many instances, into which split, at most how many tries."""

    package: Package
    split: str
    instances: int
    max_tries: int


SPLITS = ("train", "test")


def read_plans(path: Path, only: list[str] | None = None) -> list[PackagePlan]:
    """The build plans of a ``packages.toml`` (each package's split, instances and max_tries), all
    of them or the packages ``only`` names; EnvError for an unknown name or a bad field."""
    packages = read_packages(path)
    rows = {row["name"]: row for row in tomllib.loads(path.read_text())["package"]}
    if only:
        unknown = sorted(set(only) - {p.name for p in packages})
        if unknown:
            raise EnvError(f"{path} has no package {', '.join(unknown)} (it has {', '.join(p.name for p in packages)})")
        packages = [p for p in packages if p.name in only]
    plans = []
    for pkg in packages:
        row = rows[pkg.name]
        split, instances, tries = row.get("split", "train"), row.get("instances", 16), row.get("max_tries", 60)
        if split not in SPLITS or not isinstance(instances, int) or not isinstance(tries, int) or \
                instances < 1 or tries < instances:
            raise EnvError(f"{path}: package {pkg.name} needs split train|test and 1 <= instances <= max_tries")
        plans.append(PackagePlan(pkg, split, instances, tries))
    return plans


@dataclass
class PackageReport:
    name: str
    split: str
    baseline_passing: int
    baseline_s: float
    sites: int
    tries: int = 0
    kept: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


async def build_package(sandbox_cfg, plan: PackagePlan, seed: int,
                        log: Callable[[str], None]) -> tuple[list[dict], PackageReport]:
    """The instances of one package, in the order they were found."""
    pkg = plan.package
    sandbox = open_testbed(sandbox_cfg)
    try:
        await unpack(sandbox, pkg)
        await commit_tree(sandbox)
        baseline = await run_tests(sandbox, pkg, timeout_s=600)
        passing = sorted(t for t in baseline.outcomes if baseline.passing(t))
        if baseline.timed_out or not passing:
            raise EnvError(f"{pkg.name} {pkg.version}: its tests do not pass here ({baseline.tail[-300:]})")
        again = await run_tests(sandbox, pkg, timeout_s=600)
        if sorted(t for t in again.outcomes if again.passing(t)) != passing:
            raise EnvError(f"{pkg.name} {pkg.version}: two runs of its tests disagree on which tests pass (ids "
                           f"that change between runs, or flaky tests); instances would not replay")
        limit = pkg.test_timeout_s
        sources = {path: (await sandbox.read_file(f"{WORKDIR}/{path}")).decode() for path in pkg.source}
        order = _visit_order(sources, seed, pkg.name)
        report = PackageReport(pkg.name, plan.split, len(passing), baseline.duration_s, len(order))
        log(f"{pkg.name} {pkg.version} ({pkg.shape}): {len(passing)} tests pass in {baseline.duration_s:.1f} s; "
            f"{len(order)} mutation sites; time limit {limit:.0f} s a run")
        instances: list[dict] = []
        for path, site in order:
            if len(instances) >= plan.instances or report.tries >= plan.max_tries:
                break
            try:
                mutated = mutations.apply(sources[path], site)
            except (ValueError, SyntaxError):
                continue
            report.tries += 1
            decision, row = await _try(sandbox, plan, path, mutated, site, passing, limit, seed)
            if row is None:
                report.rejected[decision] = report.rejected.get(decision, 0) + 1
            else:
                instances.append(row)
            report.kept = len(instances)
            log(f"  [{report.tries}/{plan.max_tries}] {path}:{site.line} {site.kind}: {decision} "
                f"(kept {report.kept}/{plan.instances})")
    finally:
        await sandbox.close()
    return instances, report


async def _try(sandbox, plan: PackagePlan, path: str, mutated: str, site: mutations.Site, passing: list[str],
               limit: float, seed: int) -> tuple[str, dict | None]:
    pkg = plan.package
    target = f"{WORKDIR}/{path}"
    mode = sandbox.host_path(target).stat().st_mode & 0o777
    await sandbox.write_file(target, mutated, mode=mode)
    try:
        tests = await run_tests(sandbox, pkg, timeout_s=limit)
        broken = [t for t in passing if not tests.passing(t)]
        if tests.timed_out:
            return "rejected: the tests ran past the time limit", None
        if not broken:
            return "rejected: no test fails", None
        if len(broken) > MAX_BROKEN_SHARE * len(passing):
            return f"rejected: {len(broken)} of {len(passing)} tests fail", None
        # -R swaps the prefixes too: these come out as a/ (buggy) and b/ (fixed), as in any diff
        gold = (await run(sandbox, "git diff -R --no-color --no-ext-diff --src-prefix=b/ --dst-prefix=a/",
                               "git diff")).stdout
        base = await _commit_hash(sandbox)
    finally:
        await run(sandbox, f"git checkout -q -- {shlex.quote(path)}", "restoring the source")
    broken_set = set(broken)
    digest = hashlib.sha1(gold.encode()).hexdigest()[:8]
    row = {"instance_id": f"{pkg.name}__{site.kind}-{digest}", "repo": f"pypi/{pkg.name}",
           "version": pkg.version, "base_commit": base, "patch": gold, "test_patch": "",
           "problem_statement": problem_statement(pkg, broken, tests.messages, random.Random(f"{seed}:{digest}")),
           "FAIL_TO_PASS": broken, "PASS_TO_PASS": [t for t in passing if t not in broken_set],
           "clawrl_source": pkg.ref, "clawrl_bug_kind": site.kind}
    return f"kept, {len(broken)} FAIL_TO_PASS", row


async def _commit_hash(sandbox) -> str:
    """The hash ``commit_tree`` gives the working tree as it is now, without touching the index."""
    idx = "/tmp/swe-rl-index"
    script = (f"rm -f {idx} && export GIT_INDEX_FILE={idx} && git add -A && "
              f"git commit-tree $(git write-tree) -m {shlex.quote(COMMIT_MESSAGE)} && rm -f {idx}")
    return (await run(sandbox, script, "git commit-tree")).stdout.strip()


def _visit_order(sources: dict[str, str], seed: int, name: str) -> list[tuple[str, mutations.Site]]:
    rng = random.Random(f"{seed}:{name}")
    by_kind: dict[str, list] = {k: [] for k in mutations.KINDS}
    for path in sorted(sources):
        for site in mutations.sites(sources[path]):
            by_kind[site.kind].append((path, site))
    for kind in mutations.KINDS:
        rng.shuffle(by_kind[kind])
    order = []
    while any(by_kind.values()):
        for kind in mutations.KINDS:
            if by_kind[kind]:
                order.append(by_kind[kind].pop())
    return order


_OPENINGS = ("Since the latest change, {name} {version} misbehaves: {n} of its own tests fail.",
             "{name} {version} has a regression: {n} tests of its test suite no longer pass.",
             "Something is broken in {name} {version}. Running its test suite, {n} tests fail.")


# Object reprs carry memory addresses (``<Foo at 0x7f3a...>``, cut by pytest to ``...3a9e2b10>``), which
# differ from run to run: a statement quotes them with the address left out, so the build stays
# deterministic.
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}|(?<=\.\.\.)[0-9a-f]{6,}(?=>)")


def _quoted(message: str) -> str:
    return _ADDRESS.sub("...", message)[:MESSAGE_CHARS]


def problem_statement(pkg: Package, failing: list[str], messages: dict[str, str], rng: random.Random) -> str:
    """An issue written from what fails: the failing tests and what they report, not the cause."""
    lines = [rng.choice(_OPENINGS).format(name=pkg.name, version=pkg.version, n=len(failing)), "",
             "Failing tests:"]
    for test in failing[:STATEMENT_TESTS_SHOWN]:
        message = messages.get(test, "")
        lines.append(f"- {test}" + (f"\n    {_quoted(message)}" if message else ""))
    if len(failing) > STATEMENT_TESTS_SHOWN:
        lines.append(f"- ... and {len(failing) - STATEMENT_TESTS_SHOWN} more")
    lines += ["", f"The rest of the suite passes (run it with: {_display_command(pkg)}). Fix the library's "
                  f"source so that these tests pass again; the tests are right and are not to be changed."]
    return "\n".join(lines)


def _display_command(pkg: Package) -> str:
    paths = [p for p in pkg.pythonpath if p not in (".", "")]
    env = f"PYTHONPATH={':'.join(paths)} " if paths else ""
    return f"{env}python3 -m pytest -q {' '.join(pkg.tests)}"


def write_task_set(out: Path, rows_by_split: dict[str, list[dict]], meta: dict) -> None:
    """``dataset.toml``, ``data/<split>.jsonl`` and ``build.json`` (what was decided) under ``out``."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    for old in (out / "data").glob("*.jsonl"):
        old.unlink()
    for split, rows in sorted(rows_by_split.items()):
        with open(out / "data" / f"{split}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
    (out / "dataset.toml").write_text('name = "swe-rl"\ndescription = "SWE-bench-style instances: procedural '
                                      'bugs in pinned PyPI packages, judged by their own test suites '
                                      '(clawrl env build swe-rl)"\n')
    (out / "build.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


async def build(sandbox_cfg, plans: list[PackagePlan], seed: int, out: Path,
                log: Callable[[str], None]) -> dict:
    """Build every plan's package in turn and write the task set; the build summary."""
    started = time.monotonic()
    rows_by_split: dict[str, list[dict]] = {}
    reports = []
    for plan in plans:
        rows, report = await build_package(sandbox_cfg, plan, seed, log)
        rows_by_split.setdefault(plan.split, []).extend(rows)
        reports.append(report.__dict__)
        log(f"{plan.package.name}: kept {report.kept} of {report.tries} mutations tried "
            f"({', '.join(f'{v} {k}' for k, v in sorted(report.rejected.items())) or 'none rejected'})")
    meta = {"seed": seed, "packages": reports, "instances": {s: len(r) for s, r in sorted(rows_by_split.items())}}
    write_task_set(out, rows_by_split, meta)
    meta["seconds"] = round(time.monotonic() - started, 1)
    return meta
