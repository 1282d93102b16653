"""Measure what a sandbox costs: start + first exec, and each further exec, per backend, against a
plain subprocess that runs the same command with no sandbox at all.

- start + first exec: ``open_sandbox`` (claim a uid slot, make the tree; the once-per-process probe
  of the backend is excluded by a warm-up open) plus the first ``exec(["true"])``, then ``close``
  timed separately;
- per exec: ``exec(["true"])`` and ``exec(["python3", "-c", "pass"])`` in one open sandbox.

Each figure is the median of ``--runs`` runs; the ratio is against the median of the plain
``asyncio.create_subprocess_exec`` of the same command (for start + first exec: of ``true``). The
subprocess backend (no isolation) is included to show the cost of the wrappers (prlimit) alone.

    python benchmarks/bench_sandbox.py [--runs 30] [--backends bwrap,unshare,subprocess] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

from clawrl.config import SandboxConfig
from clawrl.envs.sandbox import BACKENDS, SandboxError, open_sandbox

COMMANDS = {"true": ["true"], "python3 -c pass": ["python3", "-c", "pass"]}


async def _plain(argv: list[str]) -> float:
    t = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    return time.perf_counter() - t


async def bench_backend(cfg: SandboxConfig, runs: int) -> dict[str, float]:
    """Median seconds of start + first exec, close, and each command's exec, in ``cfg.backend``."""
    await open_sandbox(cfg).close()  # the once-per-process probe, outside the timings
    starts, closes = [], []
    for _ in range(runs):
        t = time.perf_counter()
        sb = open_sandbox(cfg)
        r = await sb.exec(["true"])
        starts.append(time.perf_counter() - t)
        if r.returncode != 0:
            raise RuntimeError(f"{cfg.backend}: true exited {r.returncode}: {r.stderr.strip()}")
        t = time.perf_counter()
        await sb.close()
        closes.append(time.perf_counter() - t)
    out = {"start+first exec": statistics.median(starts), "close": statistics.median(closes)}
    async with open_sandbox(cfg) as sb:
        for name, argv in COMMANDS.items():
            times = []
            for _ in range(runs):
                r = await sb.exec(argv)
                if r.returncode != 0:
                    raise RuntimeError(f"{cfg.backend}: {name} exited {r.returncode}: {r.stderr.strip()}")
                times.append(r.duration_s)
            out[name] = statistics.median(times)
    return out


async def main_async(args) -> dict:
    plain = {name: statistics.median([await _plain(argv) for _ in range(args.runs)])
             for name, argv in COMMANDS.items()}
    results = {"plain subprocess": {"start+first exec": plain["true"], "close": 0.0, **plain}}
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as root:
        for backend in args.backends.split(","):
            cfg = SandboxConfig(backend=backend, allow_unisolated=backend == "subprocess", root=root)
            try:
                results[backend] = await bench_backend(cfg, args.runs)
            except SandboxError as e:
                print(f"{backend}: skipped ({e})", file=sys.stderr)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="runs per figure (medians)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated sandbox backends")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line too")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    base = results["plain subprocess"]
    cols = ["start+first exec", "close", *COMMANDS]
    print(f"medians of {args.runs} runs, ms (x plain subprocess)")
    print("| backend | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for backend, r in results.items():
        cells = [f"{r[c] * 1e3:.1f}" + (f" ({r[c] / base[c]:.1f}x)" if base[c] and c != "close" else "")
                 for c in cols]
        print(f"| {backend} | " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps({b: {k: round(v, 6) for k, v in r.items()} for b, r in results.items()}))


if __name__ == "__main__":
    main()
