"""Run ``clawrl demo`` for each method on each simulated user and put the curves side by side.

    python benchmarks/compare_methods.py [--seed 0] [--out docs]

Each run is a real demo (live gateway, simulated user, learner); this script only reads the
``results.json`` each run writes and draws one table and one PNG (``methods_compared.png``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

METHODS = ("rl", "opd", "combine")
USERS = ("student", "teacher")


def run_demo(method: str, user: str, seed: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "clawrl.cli", "demo", f"method={method}", f"demo.user={user}", f"seed={seed}",
           "engine.threads=1", f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(next(run_dir.rglob("results.json")).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    from clawrl.demo.plot import plot_curves

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for user in USERS:
            for method in METHODS:
                res = run_demo(method, user, args.seed, Path(tmp) / f"{user}-{method}")
                pts = [(p["interactions"], p["rate"]) for p in res["points"]]
                curves[f"{user}, {method}"] = pts
                rates = " / ".join(f"{r:.2f}" for _, r in pts)
                rows.append(f"| {user} | {method} | {rates} | {pts[-1][1] - pts[0][1]:+.2f} |")
                print(rows[-1], flush=True)
    header = ("| user | method | satisfaction rate at " + " / ".join(str(n) for n, _ in pts) + " interactions | rise |\n"
              "|---|---|---|---:|")
    table = header + "\n" + "\n".join(rows) + "\n"
    (out / "methods_compared.md").write_text(table)
    plot_curves(curves, out / "methods_compared.png", f"rl vs opd vs combine, seed {args.seed}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
