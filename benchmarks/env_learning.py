"""Does an environment recipe learn? Held-out success before and after a short training run, per seed.

Runs exactly the commands a user would (issue 16, item 7), as subprocesses:

    clawrl env eval RECIPE --split test
    bash RECIPE/run.sh run_dir=D seed=1 env.max_train_steps=30 env.eval_every=10   (seeds 1, 2, 3)
    clawrl env eval RECIPE --split test --run-dir D

for each seed, then reads each run's ``metrics.jsonl`` for the curves (held-out success by train
step; rollout success, reward, truncation and turns per episode by step), writes them to
``benchmarks/results/<recipe>_learning.json`` and a PNG beside it, and prints a markdown table
(before, after, gain, well-formed tool-call rate, success among well-formed episodes, minutes,
episodes per minute) for BENCHMARKS.md. The gain is measured against the untrained model's score in
the same run; nothing is timed against a threshold.

    python benchmarks/env_learning.py toolcall-rl --seeds 1 2 3 --steps 30
    python benchmarks/env_learning.py terminal-rl --seeds 1 --steps 10 -- env.group_size=4
    python benchmarks/env_learning.py gui-rl --eval-split test_click --seeds 1 2 --steps 8 --eval-every 4 \
        -- env.split=train_click_easy env.group_size=16

``--eval-split`` names the held-out split of both evaluations (and of the runs' periodic ones).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]


def evaluate(recipe: str, run_dir: Path | None, overrides: list[str], split: str = "test") -> tuple[dict, float]:
    """The last JSON line of ``clawrl env eval RECIPE --split SPLIT [--run-dir D]`` and its seconds."""
    cmd = [*CLAWRL, "env", "eval", recipe, "--split", split, *(["--run-dir", str(run_dir)] if run_dir else []),
           *overrides]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"env eval failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.monotonic() - started


def train(recipe: str, run_dir: Path, seed: int, steps: int, eval_every: int, overrides: list[str]) -> float:
    """``bash RECIPE/run.sh`` with the run dir, seed, steps and eval interval; its seconds (log in D)."""
    cmd = ["bash", str(REPO / recipe / "run.sh"), f"run_dir={run_dir}", f"seed={seed}",
           f"env.max_train_steps={steps}", f"env.eval_every={eval_every}", "server.port=0", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(run_dir / "serve.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    log_text = (run_dir / "serve.log").read_text()
    if proc.returncode != 0 or f"env.max_train_steps={steps} train steps done" not in log_text:
        # a server stopped from outside also exits 0: only the line after the last step counts as done
        raise SystemExit(f"training did not finish its {steps} steps (exit {proc.returncode}): "
                         f"{log_text.strip().splitlines()[-3:]}")
    return time.monotonic() - started


def curves(run_dir: Path) -> dict:
    """Per train step from metrics.jsonl: held-out eval figures and the rollouts' window."""
    evals, steps = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("kind") != "train_step":
            continue
        if "eval/success_rate" in m:
            evals.append({"step": m["step"], **{k[5:]: v for k, v in m.items() if k.startswith("eval/")}})
        if "rollout/episodes" in m:
            steps.append({"step": m["step"], "reward_mean": m.get("reward_mean"), "loss": m.get("loss"),
                          **{k[8:]: v for k, v in m.items() if k.startswith("rollout/")}})
    return {"eval": evals, "steps": steps}


def plot(recipe: str, runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=110)
    panels = [("held-out success (greedy)", "eval", "success_rate"), ("rollout reward", "steps", "reward_mean"),
              ("rollout truncation rate", "steps", "truncated_rate"), ("turns per episode", "steps", "turns_mean")]
    for ax, (title, kind, key) in zip(axes.flat, panels):
        for run in runs:
            points = [(p["step"], p[key]) for p in run["curves"][kind] if p.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if kind == "eval" else None, label=f"seed {run['seed']}")
        ax.set_title(title)
        ax.set_xlabel("train step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{recipe}: learning on 2 CPU cores (embedded model)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="a method directory with an environment: toolcall-rl, terminal-rl")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-split", default="test", help="the held-out split (default: test)")
    ap.add_argument("--keep", help="keep the run directories under this directory")
    ap.add_argument("overrides", nargs="*", help="key=value for training and both evaluations (model.path=... "
                    "evaluates that model), anywhere or after --")
    args = ap.parse_intermixed_args(argv)  # key=value after the options, with or without --
    # stopped from outside (timeout, a scheduler): end as an exception, so subprocess.run kills the
    # training server it waits on instead of leaving it running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="clawrl-env-learning-"))
    overrides = [*args.overrides, f"env.eval_split={args.eval_split}"]
    before, before_s = evaluate(args.recipe, None, args.overrides, args.eval_split)  # the model the runs train
    print(f"untrained: {json.dumps(before)} ({before_s:.0f} s)", flush=True)
    runs = []
    for seed in args.seeds:
        run_dir = base / f"{args.recipe}-seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        train_s = train(args.recipe, run_dir, seed, args.steps, args.eval_every, overrides)
        after, after_s = evaluate(args.recipe, run_dir, args.overrides, args.eval_split)
        c = curves(run_dir)
        episodes = sum(p["episodes"] for p in c["steps"])
        run = {"seed": seed, "after": after, "train_s": round(train_s, 1), "eval_s": round(after_s, 1),
               "minutes_total": round((before_s + train_s + after_s) / 60, 2),
               "episodes_per_minute": round(episodes / (train_s / 60), 1), "curves": c}
        runs.append(run)
        print(f"seed {seed}: {before['success_rate']:.3f} -> {after['success_rate']:.3f} "
              f"({run['minutes_total']} min, {run['episodes_per_minute']} episodes/min)", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"recipe": args.recipe, "commit": commit, "steps": args.steps, "eval_split": args.eval_split,
              "overrides": args.overrides,
              "command": " ".join(["python benchmarks/env_learning.py", args.recipe, "--seeds",
                                   *map(str, args.seeds), "--steps", str(args.steps),
                                   *(["--eval-every", str(args.eval_every)] if args.eval_every != 10 else []),
                                   *(["--eval-split", args.eval_split] if args.eval_split != "test" else []), *(
                                       ["--", *args.overrides] if args.overrides else [])]),
              "hardware": f"{os.cpu_count()} CPU cores", "before": before, "runs": runs}
    out = RESULTS / f"{args.recipe.strip('/').replace('/', '_')}_learning.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(args.recipe, runs, out.with_suffix(".png"))
    print("\n| seed | held-out success before | after | gain | well-formed rate after | success when "
          "well-formed | truncated after | minutes (eval+train+eval) | episodes/min |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        a = r["after"]
        print(f"| {r['seed']} | {before['success_rate']:.3f} | {a['success_rate']:.3f} | "
              f"{a['success_rate'] - before['success_rate']:+.3f} | {a['well_formed_rate']:.3f} | "
              f"{a['success_when_well_formed']:.3f} | {a['truncated_rate']:.3f} | {r['minutes_total']} | "
              f"{r['episodes_per_minute']} |")
    print(f"\nwrote {out} and {out.with_suffix('.png')}; runs in {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
