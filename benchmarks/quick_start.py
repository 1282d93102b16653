"""Does the quick start learn, and keep its skill? A thumbs-feedback user against ``bash <recipe>/run.sh``.

    python benchmarks/quick_start.py [--recipes openclaw-rl openclaw-combine] [--seeds 0 1 2]
                                     [--interactions 160] [--eval-every 40] [--out benchmarks/results]

Each run starts the recipe exactly as a user would, ``bash <recipe>/run.sh server.port=<free port>
run_dir=<temporary dir>``:
the embedded model and every learning setting as the recipe composes them (dataclass < the embedded
model's ``conf/embedded.yaml`` < the recipe's ``config.yaml``); the two overrides only say where to
listen and write. The seed is the simulated user's (its questions, its feedback, the sampling seed of
every request), not the server's.

**The user** likes short replies and says so only with a thumbs-up or a thumbs-down, as the next
message of the same session (``X-Session-Id``; the session ends with it, ``X-Session-Done``). The
rules judge reads them as +1 and -1. A reply is *short* when it is one line of at most
``SHORT_CHARS`` (14) characters: "7 + 5 = 12.", "51 + 58 = 109" and "12" are; "67 plus 5 is 72.", "The
sum of 7 and 5 is 12." and a tool call are not. The embedded model's greedy replies are mostly of the
first kind, so the preference can be learned without giving up the worked sum (a bare number is
right far less often: in the demo's measurements 1 of 12 against 19 of 36 for "a + b = c"). Requests send neither ``temperature`` nor ``max_tokens``: the server's defaults apply, as for
a client that sets nothing.

**The measures**, before the first interaction and after every ``--eval-every`` (each after the
server has trained every full batch of feedback, read from ``GET /admin/status``), on 64 held-out
addition questions whose pairs the user never asks and the model never saw in pretraining:

- *liked rate*: the share of replies the user would like, sampled at the server's default
  temperature, each question with a fixed sampling seed;
- *greedy correct*: the share of greedy replies (temperature 0) whose last number is the sum.

Every measurement request is a side turn that ends its session (never trained on). Writes
``quick_start.json`` and ``quick_start.png`` into ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT_CHARS = 14
THUMBS_UP, THUMBS_DOWN = "\U0001F44D", "\U0001F44E"
EVAL_HEADERS = {"X-Turn-Type": "side", "X-Session-Done": "1"}
HELD_OUT = 64


def liked(reply: str) -> bool:
    """The user's hidden preference: a short reply (module docstring)."""
    text = reply.strip()
    return bool(text) and "\n" not in text and len(text) <= SHORT_CHARS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it answered")
        try:
            get_json(base + "/v1/models", timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    raise TimeoutError(f"the server did not answer within {timeout_s:g} s")


def wait_settled(base: str, interactions: int, timeout_s: float = 300.0) -> dict:
    """Every interaction's turn judged (or skipped) and every full batch trained: the status is the
    same on two reads 1 s apart, nothing pending, fewer ready samples than a batch."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        st = get_json(base + "/admin/status")["training"]
        s = st["samples"]
        done = s["trained"] + s["skipped"] + s["ready"] + s["consumed"]
        key = (st["train_step"], st["weight_version"], s["trained"], s["ready"], s["pending"])
        if s["pending"] == 0 and s["ready"] < st["batch_size"] and s["consumed"] == 0 and key == last:
            return st
        last = key
        time.sleep(1.0)
    raise TimeoutError(f"learning did not settle within {timeout_s:g} s (samples accounted for: {done}, "
                       f"interactions: {interactions})")


def run_one(recipe: str, user_seed: int, interactions: int, eval_every: int, work: Path,
            overrides: list[str] = ()) -> dict:
    import openai

    from clawrl.demo.evaluation import held_out_questions
    from clawrl.demo.users import ask, correct

    port, run_dir = free_port(), work / f"{recipe}-seed{user_seed}"
    cmd = ["bash", str(ROOT / recipe / "run.sh"), f"server.port={port}", f"run_dir={run_dir}", *overrides]
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    log = open(work / f"{recipe}-seed{user_seed}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        wait_ready(base, proc)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=2, timeout=300)
        model = client.models.list().data[0].id
        rng = random.Random(f"quick-start-user-{user_seed}")
        held_out = held_out_questions(HELD_OUT, user_seed)
        points = []

        def measure(k: int) -> None:
            st = wait_settled(base, k)
            rates, right = [], []
            for i, q in enumerate(held_out):
                r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q.text}],
                                                   seed=(user_seed * 100_003 + i), extra_headers=EVAL_HEADERS)
                rates.append(liked(r.choices[0].message.content or ""))
                g = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q.text}],
                                                   temperature=0, extra_headers=EVAL_HEADERS)
                right.append(correct(q, g.choices[0].message.content or ""))
            points.append({"interactions": k, "liked": sum(rates) / len(rates), "greedy_correct": sum(right) / len(right),
                           "train_step": st["train_step"], "weight_version": st["weight_version"],
                           "seconds": round(time.monotonic() - started, 1)})
            print(f"  {recipe} seed {user_seed}: after {k} interactions liked {points[-1]['liked']:.2f}, greedy correct "
                  f"{points[-1]['greedy_correct']:.2f} (train step {st['train_step']})", flush=True)

        measure(0)
        online = []
        for i in range(1, interactions + 1):
            q = ask(rng, held_out=False)
            asked = [{"role": "user", "content": q.text}]
            session = {"X-Session-Id": f"quick-start-{user_seed}-{i}"}
            r = client.chat.completions.create(model=model, messages=asked, seed=rng.randrange(1 << 31),
                                               extra_headers=session)
            reply = r.choices[0].message.content or ""
            online.append(liked(reply))
            client.chat.completions.create(
                model=model, max_tokens=1, extra_headers={**session, "X-Session-Done": "1"},
                messages=asked + [{"role": "assistant", "content": reply},
                                  {"role": "user", "content": THUMBS_UP if online[-1] else THUMBS_DOWN}])
            if i % eval_every == 0 or i == interactions:
                measure(i)
        return {"recipe": recipe, "seed": user_seed, "overrides": list(overrides),
                "command": " ".join([*cmd[:2], "server.port=<free port>", "run_dir=<temporary dir>", *overrides]),
                "points": points, "online_liked": sum(online) / len(online)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=["openclaw-rl", "openclaw-combine"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--interactions", type=int, default=160)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--keep", default=None, help="keep the run directories and server logs here")
    ap.add_argument("--override", nargs="*", default=[], help="key=value overrides passed to run.sh, to measure "
                    "another setting; the quick start's own measurement passes none")
    ap.add_argument("--replot", default=None, help="only redraw quick_start.png from this quick_start.json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text())["runs"], out / "quick_start.png")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for recipe in args.recipes:
            for seed in args.seeds:
                runs.append(run_one(recipe, seed, args.interactions, args.eval_every, work, args.override))
    rows = ["| recipe | overrides | user seed | liked, " + " / ".join(str(p["interactions"]) for p in runs[0]["points"])
            + " interactions | rise | greedy correct, first -> last | change | train steps | s |",
            "|---|---|---:|---|---:|---|---:|---:|---:|"]
    for r in runs:
        p = r["points"]
        liked_curve = " / ".join(f"{x['liked']:.2f}" for x in p)
        rows.append(f"| {r['recipe']} | {' '.join(r['overrides']) or 'none'} | {r['seed']} | {liked_curve} "
                    f"| {p[-1]['liked'] - p[0]['liked']:+.2f} | {p[0]['greedy_correct']:.2f} -> "
                    f"{p[-1]['greedy_correct']:.2f} | {p[-1]['greedy_correct'] - p[0]['greedy_correct']:+.2f} "
                    f"| {p[-1]['train_step']} | {p[-1]['seconds']:.0f} |")
    table = "\n".join(rows)
    (out / "quick_start.json").write_text(json.dumps({
        "commit": commit + ("-dirty" if dirty else ""), "short_chars": SHORT_CHARS, "held_out": HELD_OUT,
        "command": "python benchmarks/quick_start.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "runs": runs}, indent=2))
    plot(runs, out / "quick_start.png")
    print(table, flush=True)
    return 0


def plot(runs: list[dict], path: Path) -> None:
    """One panel per recipe: each seed's liked rate (solid) and greedy held-out correctness (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(dict.fromkeys(r["recipe"] for r in runs))
    fig, axes = plt.subplots(1, len(recipes), figsize=(5.5 * len(recipes), 4), dpi=120, sharey=True, squeeze=False)
    for ax, recipe in zip(axes[0], recipes):
        for r in (r for r in runs if r["recipe"] == recipe):
            xs = [p["interactions"] for p in r["points"]]
            line, = ax.plot(xs, [p["liked"] for p in r["points"]], marker="o", label=f"seed {r['seed']}: liked")
            ax.plot(xs, [p["greedy_correct"] for p in r["points"]], linestyle="--", marker=".", color=line.get_color(),
                    label=f"seed {r['seed']}: greedy correct")
        ax.set_title(f"bash {recipe}/run.sh, a thumbs-feedback user")
        ax.set_xlabel("interactions")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel("fraction of 64 held-out questions")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
