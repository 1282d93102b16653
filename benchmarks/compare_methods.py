"""Run ``clawrl demo`` for each method on each simulated user and put the curves side by side.

    python benchmarks/compare_methods.py [--seeds 0 1 2] [--out docs] [--hinted OVERRIDE ...]

Each run is a real demo (live gateway, simulated user, learner) with the embedded model's own
defaults; this script only reads the ``results.json`` each run writes. Four methods: ``rl``, ``opd``,
``combine``, and ``combine`` with the hinted policy's own replies distilled (``opd.hinted_sample``;
``--hinted`` gives its overrides). For each user, method and seed it prints the preference rate and
the held-out correctness at every measurement; it writes ``methods_compared.md`` (every run, then
the means over the seeds) and ``methods_compared.png``: one panel per user, the mean preference rate
(solid) and the mean held-out correctness (dashed) of each method side by side.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

USERS = ("student", "teacher")
EVAL_PROMPTS = 64  # demo.eval_prompts, left at its default here
# the measured setting (BENCHMARKS.md, "Learning users can trust"): greedy replies of the frozen starting policy
# under the hint, their NLL at 4x, and lr 2e-4 (at the embedded default 1e-4 the teacher user's rate stayed at 0.02)
HINTED = ("opd.hinted_sample=true", "opd.hinted_temperature=0", "opd.teacher=base", "opd.hinted_coef=4",
          "train.lr=2e-4")


def methods(hinted: list[str]) -> dict[str, list[str]]:
    return {"rl": ["method=rl"], "opd": ["method=opd"], "combine": ["method=combine"],
            "combine+hinted": ["method=combine", *hinted]}


def run_demo(overrides: list[str], user: str, seed: int, run_dir: Path) -> dict:
    args = ["demo", *overrides, f"demo.user={user}", f"seed={seed}", "engine.threads=1", f"run_dir={run_dir}"]
    print("$ clawrl " + " ".join(shlex.quote(a) for a in args), flush=True)
    subprocess.run([sys.executable, "-m", "clawrl.cli", *args], check=True, stdout=subprocess.DEVNULL)
    return json.loads(next(run_dir.rglob("results.json")).read_text())


def forms_before_training(run_dir: Path, n: int) -> dict[str, list[int]]:
    """{form: [correct, replies]} over the first measurement's ``n`` held-out replies of a demo run (the
    untrained model, sampled as the demo samples): a bare number, the worked sum "a + b = c", or other."""
    import re
    import sqlite3

    from clawrl.store import load_messages

    c = sqlite3.connect(run_dir / "clawrl.sqlite")
    try:
        rows = c.execute("SELECT messages, message_blobs, response_text FROM turns WHERE turn_type = 'side' "
                         "ORDER BY turn_id LIMIT ?", (n,)).fetchall()
        out: dict[str, list[int]] = {"bare": [0, 0], "worked": [0, 0], "other": [0, 0]}
        for messages, blobs, reply in rows:
            a, b = map(int, re.findall(r"\d+", load_messages(c, messages, blobs)[0]["content"])[-2:])
            form = ("bare" if re.fullmatch(r"\s*-?\d+\.?\s*", reply) else
                    "worked" if re.fullmatch(r"\s*\d+\s*\+\s*\d+\s*=\s*-?\d+\.?\s*", reply) else "other")
            numbers = re.findall(r"-?\d+", reply)
            out[form][0] += bool(numbers) and int(numbers[-1]) == a + b
            out[form][1] += 1
        return out
    finally:
        c.close()


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--out", default="docs")
    ap.add_argument("--hinted", nargs="*", default=list(HINTED), help="overrides of the combine+hinted row")
    ap.add_argument("--keep", default=None, help="keep the demos' run directories here")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    forms: dict[int, dict[str, list[int]]] = {}
    rows = ["| user | method | seed | rate at " + " / ".join(str(40 * i) for i in range(5)) + " interactions "
            "| rise | held-out correct, first -> last | change |", "|---|---|---:|---|---:|---|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or tmp
        for user in USERS:
            for name, overrides in methods(args.hinted).items():
                for seed in args.seeds:
                    res = run_demo(overrides, user, seed, Path(tmp) / f"{user}-{name}-{seed}")
                    runs.setdefault((user, name), []).append(res)
                    p = res["points"]
                    curve = " / ".join(f"{x['rate']:.2f}" for x in p)
                    rows.append(f"| {user} | {name} | {seed} | {curve} "
                                f"| {p[-1]['rate'] - p[0]['rate']:+.2f} | {p[0]['correct']:.2f} -> {p[-1]['correct']:.2f} "
                                f"| {p[-1]['correct'] - p[0]['correct']:+.2f} |")
                    print(rows[-1], flush=True)
                    if name == "rl" and user == USERS[0]:  # before training, every run of a seed asks the
                        # same questions of the same model with the same sampling seeds: count them once
                        forms[seed] = forms_before_training(Path(tmp) / f"{user}-{name}-{seed}", EVAL_PROMPTS)
    means = ["| user | method | mean rate at " + " / ".join(str(40 * i) for i in range(5)) + " | mean rise "
             "| mean correct at the same points | mean change |", "|---|---|---|---:|---|---:|"]
    fig, axes = plt.subplots(1, len(USERS), figsize=(11, 4), dpi=120, sharey=True)
    for ax, user in zip(axes, USERS):
        for name in methods(args.hinted):
            rs = runs[(user, name)]
            xs = [p["interactions"] for p in rs[0]["points"]]
            rate = [mean([r["points"][i]["rate"] for r in rs]) for i in range(len(xs))]
            right = [mean([r["points"][i]["correct"] for r in rs]) for i in range(len(xs))]
            line, = ax.plot(xs, rate, marker="o", label=f"{name}: preference")
            ax.plot(xs, right, linestyle="--", marker=".", color=line.get_color(), alpha=0.8,
                    label=f"{name}: held-out correct")
            means.append(f"| {user} | {name} | {' / '.join(f'{x:.2f}' for x in rate)} | {rate[-1] - rate[0]:+.2f} "
                         f"| {' / '.join(f'{x:.2f}' for x in right)} | {right[-1] - right[0]:+.2f} |")
        ax.set_title(f"user '{user}', mean of seeds {', '.join(map(str, args.seeds))}")
        ax.set_xlabel("interactions with the simulated user")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of held-out questions")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "methods_compared.png")
    total = {f: [sum(v[f][0] for v in forms.values()), sum(v[f][1] for v in forms.values())]
             for f in ("bare", "worked", "other")}
    form_line = ("The untrained model's sampled held-out replies (first measurement, every seed): "
                 + "; ".join(f"{f}: {k} of {n} correct" for f, (k, n) in total.items()))
    table = "\n".join(rows) + "\n\n" + "\n".join(means) + "\n\n" + form_line + "\n"
    (out / "methods_compared.md").write_text(table)
    (out / "methods_compared.json").write_text(json.dumps(
        {"seeds": args.seeds, "hinted": args.hinted, "forms_before_training": total,
         "runs": {f"{u}/{m}": rs for (u, m), rs in runs.items()}}, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
