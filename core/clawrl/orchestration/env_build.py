"""``clawrl env build NAME [--seed N] [--force] [--packages A,B] [--out DIR]``: build an
environment's task set. swe-rl is the environment that has one to build (``clawrl.envs.swe.build``):
its method directory's ``packages.toml`` says what to build, and the task set goes where its
``config.yaml``'s ``env.tasks`` points, unless ``--out`` says elsewhere.

Progress goes to stderr as it is decided (each package's baseline, each mutation kept or why it was
rejected); the last line of stdout is the build's JSON summary. An existing task set is kept unless
``--force``. Usage errors exit 2 with one line.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from clawrl.config import compose
from clawrl.envs import EnvError
from clawrl.envs.swe.build import build, read_plans
from clawrl.errors import CliError

PACKAGES_FILE = "packages.toml"
BUILDABLE = ("swe",)


def build_cli(args, recipe: Path | None) -> int:
    if recipe is None:
        raise CliError(f"{args.target}: env build takes a method directory (swe-rl), found none of that name")
    cfg = compose(args.overrides, yaml_path=str(recipe / "config.yaml"))
    if cfg.env.name not in BUILDABLE:
        raise CliError(f"{recipe.name} (env.name={cfg.env.name}) has no task set to build; "
                       f"env build builds {', '.join(BUILDABLE)}")
    seed = _seed(args.seed)
    out = Path(args.out).expanduser() if args.out else _tasks_dir(recipe, cfg.env.tasks)
    if any((out / "data").glob("*.jsonl")) and not args.force:
        raise CliError(f"{out} already holds a task set; --force rebuilds it")
    only = [p for p in args.packages.split(",") if p] if args.packages else None
    try:
        plans = read_plans(recipe / PACKAGES_FILE, only)
        summary = asyncio.run(build(cfg.sandbox, plans, seed, out,
                                    lambda line: print(line, file=sys.stderr, flush=True)))
    except EnvError as e:
        print(f"clawrl: env build failed: {e}", file=sys.stderr)
        return 1
    summary["out"] = str(out)
    print(json.dumps(summary), flush=True)
    return 0


def _tasks_dir(recipe: Path, tasks: str | None) -> Path:
    if tasks is None:
        raise CliError(f"{recipe} sets no env.tasks: say where the task set goes with --out DIR")
    path = Path(tasks).expanduser()
    return path if path.is_absolute() else recipe / path


def _seed(value: str) -> int:
    try:
        seed = int(value)
    except ValueError:
        raise CliError(f"--seed must be a whole number, got {value!r}") from None
    if seed < 0:
        raise CliError(f"--seed must be a whole number >= 0, got {value!r}")
    return seed
