"""Measure what a sandbox costs: start + first exec, and each further exec, per backend, against a
plain subprocess that runs the same command with no sandbox at all.

- start + first exec: ``open_sandbox`` (claim a uid slot, make the tree; the once-per-process probe
  of the backend is excluded by a warm-up open) plus the first ``exec(["true"])``, then ``close``
  timed separately;
- per exec: ``exec(["true"])`` and ``exec([python3, "-c", "pass"])`` in one open sandbox (the
  running interpreter's python3, by absolute path, inside and out).

Each figure is the median of ``--runs`` runs; the ratio is against the median of the plain
``asyncio.create_subprocess_exec`` of the same command (for start + first exec: of ``true``). The
subprocess backend (no isolation) is included to show the cost of the wrappers (prlimit) alone.

Last, ``--concurrent`` sandboxes per backend open, run ``sleep 1`` and close all at once: the wall
time (1 s would be perfect overlap).

    python benchmarks/bench_sandbox.py [--runs 30] [--backends bwrap,unshare,subprocess] [--concurrent 16] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from clawrl.config import SandboxConfig
from clawrl.envs.sandbox import BACKENDS, Sandbox, SandboxError, open_sandbox

# The same python3 binary inside and outside (the sandbox mounts the running Python's environment);
# a bare "python3" could be a pyenv shim script outside.
PYTHON = os.path.join(os.path.dirname(os.path.realpath(sys.executable)), "python3")
COMMANDS = {"true": ["true"], "python3 -c pass": [PYTHON, "-c", "pass"]}
FIGURES = ("start+first exec", "close", *COMMANDS)


async def _plain(argv: list[str]) -> float:
    t = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    return time.perf_counter() - t


async def _checked(sb: Sandbox, argv: list[str]) -> float:
    r = await sb.exec(argv)
    if r.returncode != 0:
        raise RuntimeError(f"{sb.backend}: {argv} exited {r.returncode}: {r.stderr.strip()}")
    return r.duration_s


async def _start(cfg: SandboxConfig) -> tuple[float, float]:
    """Seconds of open + first exec, and of close."""
    t = time.perf_counter()
    sb = open_sandbox(cfg)
    await _checked(sb, ["true"])
    started = time.perf_counter() - t
    t = time.perf_counter()
    await sb.close()
    return started, time.perf_counter() - t


async def main_async(args) -> dict[str, dict[str, float]]:
    """Median seconds per backend and figure. Runs interleave the backends, so that load from
    elsewhere on the machine falls on all of them alike."""
    samples: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as root:
        open_boxes: dict[str, Sandbox] = {}
        for backend in args.backends.split(","):
            cfg = SandboxConfig(backend=backend, allow_unisolated=backend == "subprocess", root=root)
            try:
                await open_sandbox(cfg).close()  # the once-per-process probe, outside the timings
                open_boxes[backend] = open_sandbox(cfg)
            except SandboxError as e:
                print(f"{backend}: skipped ({e})", file=sys.stderr)
        try:
            for _ in range(args.runs):
                plain = samples.setdefault("plain subprocess", {f: [] for f in FIGURES})
                for name, argv in COMMANDS.items():
                    plain[name].append(await _plain(argv))
                plain["start+first exec"].append(plain["true"][-1])
                plain["close"].append(0.0)
                for backend, sb in open_boxes.items():
                    s = samples.setdefault(backend, {f: [] for f in FIGURES})
                    started, closed = await _start(sb.sandbox_cfg)
                    s["start+first exec"].append(started)
                    s["close"].append(closed)
                    for name, argv in COMMANDS.items():
                        s[name].append(await _checked(sb, argv))
        finally:
            for sb in open_boxes.values():
                await sb.close()
    return {b: {f: statistics.median(v) for f, v in figs.items()} for b, figs in samples.items()}


async def concurrent_wall(backends: list[str], n: int) -> dict[str, float]:
    """Wall seconds for ``n`` sandboxes of each backend to run ``sleep 1`` at once (1.0 is perfect
    overlap; each sandbox is opened and closed inside the timing)."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as root:
        for backend in backends:
            cfg = SandboxConfig(backend=backend, allow_unisolated=backend == "subprocess", root=root)
            try:
                await open_sandbox(cfg).close()
            except SandboxError:
                continue

            async def one() -> None:
                async with open_sandbox(cfg) as sb:
                    await _checked(sb, ["sleep", "1"])

            t = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(n)))
            out[backend] = time.perf_counter() - t
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="runs per figure (medians)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated sandbox backends")
    p.add_argument("--concurrent", type=int, default=16, help="sandboxes running sleep 1 at once")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line too")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    walls = asyncio.run(concurrent_wall(args.backends.split(","), args.concurrent))
    base = results["plain subprocess"]
    cols = list(FIGURES)
    print(f"medians of {args.runs} runs, ms (x plain subprocess)")
    print("| backend | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for backend, r in results.items():
        cells = [f"{r[c] * 1e3:.1f}" + (f" ({r[c] / base[c]:.1f}x)" if base[c] and c != "close" else "")
                 for c in cols]
        print(f"| {backend} | " + " | ".join(cells) + " |")
    print(f"{args.concurrent} sandboxes open, run sleep 1 and close, all at once: "
          + ", ".join(f"{b} {w:.2f} s" for b, w in walls.items()))
    if args.json:
        print(json.dumps({"medians": {b: {k: round(v, 6) for k, v in r.items()} for b, r in results.items()},
                          "concurrent_wall_s": {b: round(w, 3) for b, w in walls.items()}}))


if __name__ == "__main__":
    main()
