#!/usr/bin/env python3
"""gui-rl's measured baselines, without a model.

    python3 gui-rl/baselines.py throughput --browsers 2   # scripted (oracle) episodes per minute
    python3 gui-rl/baselines.py random --split test_click # success of a policy that clicks a random element

``throughput`` plays the oracle on every scripted task's test rows with as many episodes at once as
browsers in the pool. ``random`` clicks one element of the screen uniformly at random per turn, for
up to env.max_turns (6) turns, on every row of the split (seeded, so reruns agree).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path

from clawrl.envs.base import Task
from clawrl.envs.gui.browser import BrowserPool
from clawrl.envs.gui.env import GuiEnv
from clawrl.envs.gui.miniwob_tasks import SOLVERS
from clawrl.envs.scripted import play

HERE = Path(__file__).resolve().parent
MAX_TURNS, MAX_TIME_S = 6, 120.0


def rows(split: str) -> list[Task]:
    out = []
    for line in (HERE / "data" / f"{split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append(Task(row.pop("task_id"), row))
    return out


async def throughput(browsers: int) -> dict:
    pool = BrowserPool(browsers)
    tasks = [t for t in rows("test") if t.data.get("miniwob") in SOLVERS]
    gate = asyncio.Semaphore(browsers)

    async def one(task):
        async with gate:
            return await play(GuiEnv(pool, MAX_TIME_S, None), task, "oracle", 12)

    await one(tasks[0])  # start the browsers' first instance outside the clock
    start = time.monotonic()
    reports = await asyncio.gather(*(one(t) for t in tasks))
    minutes = (time.monotonic() - start) / 60
    pool.close()
    return {"browsers": browsers, "episodes": len(reports), "solved": sum(r.success for r in reports),
            "episodes_per_minute": round(len(reports) / minutes, 1)}


async def random_clicks(split: str, seed: int) -> dict:
    pool = BrowserPool(2)
    rng = random.Random(seed)
    by_task: dict[str, list[bool]] = {}
    for task in rows(split):
        env = GuiEnv(pool, MAX_TIME_S, None)
        try:
            await env.reset(task)
            success = False
            for _ in range(MAX_TURNS):
                if not env.elements:
                    break
                out = await env.step(json.dumps({"action": "click", "element": rng.choice(env.elements).id}))
                if out.done:
                    success = bool(out.info["success"])
                    break
        finally:
            await env.close()
        by_task.setdefault(re.sub(r"^family/|/\d+$", "", task.task_id), []).append(success)
    pool.close()
    flat = [s for v in by_task.values() for s in v]
    return {"split": split, "episodes": len(flat), "success_rate": round(sum(flat) / len(flat), 3),
            "by_task": {k: round(sum(v) / len(v), 2) for k, v in by_task.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--browsers", type=int, default=2)
    r = sub.add_parser("random")
    r.add_argument("--split", default="test_click")
    r.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = asyncio.run(throughput(args.browsers) if args.cmd == "throughput" else random_clicks(args.split, args.seed))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
