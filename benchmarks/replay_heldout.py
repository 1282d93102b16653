"""What online learning would have done: a real ``clawrl demo`` run, replayed offline with other settings,
its held-out curve beside each replay's.

    python benchmarks/replay_heldout.py [--seed 0] [--out benchmarks/results]

Runs, each as a subprocess with the exact command printed:

1. ``clawrl demo method=rl seed=0 run_dir=D`` (``seed`` is ``--seed``) (the embedded model, the demo's defaults);
2. ``clawrl replay --run-dir D --out R --held-out`` with no override (the held-out curve must come out
   equal to D's, point for point), then with ``train.lr=5e-5`` and ``train.lr=1e-3``;
3. ``clawrl demo method=combine demo.user=student seed=0 run_dir=C``, replayed with ``method=rl`` (its
   rewards alone) and ``method=opd`` (its teacher's scores alone).

Each replay writes its own ``heldout.json`` and ``heldout.png``; this script reads them and writes
``replay_heldout.json`` and ``replay_heldout.png`` (one panel per original run, every curve in it) into
``--out``, and prints a table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {  # name: (demo overrides, replays' overrides)
    "rl": (["method=rl"], [[], ["train.lr=5e-5"], ["train.lr=1e-3"]]),
    "combine": (["method=combine", "demo.user=student"], [[], ["method=rl"], ["method=opd"]]),
}


def clawrl(*args: str) -> float:
    cmd = [sys.executable, "-m", "clawrl.cli", *args]
    print("$ clawrl " + " ".join(shlex.quote(a) for a in args), flush=True)
    started = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return round(time.monotonic() - started, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"seed": args.seed, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            demo, replays = RUNS[name]
            run = Path(tmp) / name
            seconds = clawrl("demo", *demo, f"seed={args.seed}", f"run_dir={run}")
            entry = {"demo": demo, "demo_seconds": seconds, "replays": []}
            for i, overrides in enumerate(replays):
                d2 = Path(tmp) / f"{name}-replay{i}"
                seconds = clawrl("replay", "--run-dir", str(run), "--out", str(d2), "--held-out", *overrides)
                data = json.loads((d2 / "heldout.json").read_text())
                entry["original"] = data["original"]
                entry["metric"], entry["side_metric"] = data["metric"], data["side_metric"]
                entry["replays"].append({"overrides": overrides, "original_values": data["original_values"],
                                         "seconds": seconds, "points": data["replay"]})
            results["runs"][name] = entry
    (out / "replay_heldout.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "replay_heldout.png")
    print(table(results))
    return 0


def table(results: dict) -> str:
    def figures(points: list[dict], key: str) -> str:
        return " / ".join(f"{p[key]:.2f}" for p in points)

    rows, steps = [], []
    for name, e in results["runs"].items():
        steps = [p["train_step"] for p in e["original"]]
        m, side = e["metric"], e["side_metric"]
        rows.append(f"| {name} | original ({' '.join(e['demo'])}) | {figures(e['original'], m)} | "
                    f"{figures(e['original'], side)} | {e['demo_seconds']:.0f} |")
        for r in e["replays"]:
            label = " ".join(r["overrides"]) or "no override"
            rows.append(f"| {name} | replay, {label} | {figures(r['points'], m)} | {figures(r['points'], side)} | "
                        f"{r['seconds']:.0f} |")
    head = (f"| demo | run | held-out preference rate at train steps {' / '.join(map(str, steps))} | held-out "
            "correct | s |\n|---|---|---|---|---:|")
    return head + "\n" + "\n".join(rows)


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), dpi=110, squeeze=False)
    for ax, (name, e) in zip(axes[0], runs.items()):
        orig = e["original"]
        ax.plot([p["train_step"] for p in orig], [p[e["metric"]] for p in orig], marker="o", linewidth=3,
                alpha=0.5, color="black", label=f"original: {' '.join(e['demo'])}")
        for r in e["replays"]:
            label = " ".join(r["overrides"]) or "no override (= original)"
            ax.plot([p["train_step"] for p in r["points"]], [p[e["metric"]] for p in r["points"]], marker=".",
                    linestyle=":" if not r["overrides"] else "-", label=f"replay: {label}")
        ax.set_xlabel("train step (the run's recorded batches)")
        ax.set_ylabel(f"held-out {e['metric']}")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.set_title(f"clawrl demo {' '.join(e['demo'])}, seed {results['seed']}, and its replays", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
