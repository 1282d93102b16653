"""Load and soak: many concurrent simulated sessions against one ``clawrl serve`` with training on,
for minutes, and what it cost (issue 20, item 2).

    python benchmarks/soak.py [--sessions 64] [--minutes 10] [--out benchmarks/results/soak.json] [key=value ...]

``--sessions`` threads each run the crash campaign's sessions (``benchmarks/reliability.py``: a
question, then the user's feedback that closes the session and is judged; half streamed) one after
another, against a server that judges and trains (method rl, rules judge, a train step every two
judged turns). Every ``--sample-s`` seconds the server's resident memory (RSS, from /proc) is
recorded. At the end: request latency p50/p99, requests and train steps per minute, RSS over
time (first, peak, last and the slope of the second half, which bounded memory keeps near zero),
and the check that every acknowledged turn is in the store, complete.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "reliability" in sys.modules:  # run by benchmarks/reliability.py, or a test that loaded it
    reliability = sys.modules["reliability"]
else:
    _spec = importlib.util.spec_from_file_location("reliability", Path(__file__).with_name("reliability.py"))
    reliability = importlib.util.module_from_spec(_spec)
    sys.modules["reliability"] = reliability
    _spec.loader.exec_module(reliability)


class TimedLoad(reliability.Load):
    """A session thread that also records how long each request took."""

    def __init__(self, *a, latencies: list, **kw):
        super().__init__(*a, **kw)
        self.latencies = latencies

    def session(self) -> None:
        started = time.monotonic()
        super().session()
        self.latencies.append((time.monotonic() - started) / 2)  # two requests a session


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time, MB per minute."""
    if len(samples) < 2:
        return 0.0
    ts, ys = [t for t, _ in samples], [y for _, y in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def soak(run_dir: Path, sessions: int, seconds: float, sample_s: float, overrides: list[str], log: Path,
         progress=print) -> dict:
    acked = reliability.Acked()
    server = reliability.Server(run_dir, reliability._free_port(), log, overrides)
    model = server.model()
    latencies: list[float] = []
    loads = [TimedLoad(server.url, model, acked, random.Random(i), latencies=latencies) for i in range(sessions)]
    rss: list[tuple[float, float]] = []
    started = time.monotonic()
    try:
        for load in loads:
            load.start()
        while (now := time.monotonic() - started) < seconds:
            rss.append((round(now, 1), round(rss_mb(server.proc.pid), 1)))
            if len(rss) % max(1, int(60 / sample_s)) == 0:
                progress(f"{now / 60:.1f} min: {len(latencies)} sessions, RSS {rss[-1][1]:.0f} MB")
            time.sleep(sample_s)
        status = server.status()
    finally:
        for load in loads:
            load.stop.set()
        for load in loads:
            load.join(60)
        server.proc.terminate()
        server.proc.wait(60)
    lost = reliability.lost_turns(run_dir, acked)
    lat = sorted(latencies)
    second_half = [s for s in rss if s[0] >= seconds / 2]
    minutes = seconds / 60
    return {
        "sessions": sessions, "seconds": seconds, "requests": 2 * len(lat),
        "requests_per_min": round(2 * len(lat) / minutes, 1),
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else None,
        "train_steps": status["training"]["train_step"],
        "train_steps_per_min": round(status["training"]["train_step"] / minutes, 2),
        "acked_turns": len(acked.turns), "acked_streams": len(acked.streamed_sessions), "lost": lost,
        "errors": dict(acked.errors),
        "rss_mb_first": rss[0][1] if rss else None, "rss_mb_peak": max(y for _, y in rss) if rss else None,
        "rss_mb_last": rss[-1][1] if rss else None,
        "rss_slope_second_half_mb_per_min": round(slope_mb_per_min(second_half), 2), "rss": rss,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ts, ys = zip(*result["rss"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t / 60 for t in ts], ys)
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS, MB")
    ax.set_title(f"clawrl serve under {result['sessions']} concurrent sessions, training on")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--run-dir")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "soak.json"))
    ap.add_argument("overrides", nargs="*", help="key=value for clawrl serve (model.path=..., ...)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="clawrl-soak-"))
    log = run_dir.parent / f"{run_dir.name}-serve.log"
    result = soak(run_dir, args.sessions, args.minutes * 60, args.sample_s, args.overrides, log)
    result["command"] = "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"{result['sessions']} sessions for {args.minutes} min: {result['requests']} requests "
          f"({result['requests_per_min']}/min), p50 {result['latency_p50_s']} s, p99 {result['latency_p99_s']} s, "
          f"{result['train_steps']} train steps; RSS {result['rss_mb_first']} -> peak {result['rss_mb_peak']} -> "
          f"{result['rss_mb_last']} MB (second half {result['rss_slope_second_half_mb_per_min']} MB/min); "
          f"lost: {len(result['lost'])}")
    return 0 if not result["lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
