#!/usr/bin/env python3
"""What the model does on toolcall-rl, per template: success, tool use, well-formed calls.

`clawrl env eval` reports one success rate; calibrating the embedded model's corpus (issue 16,
items 6 and 7) needs the parts: per template, the share of episodes that succeed, that call the
tool with a well-formed call first, and that answer without calling it. The episodes are played by
the same function as `clawrl env eval` (``evaluation.model_episode``), under toolcall-rl's
config.yaml, so the overall success rate is the one `clawrl env eval` prints for the same
arguments.

    python3 benchmarks/toolcall_agent_profile.py --split test [--temperature 0] [--n 1] [--stride K] [key=value ...]

The last line is JSON: {"overall": {...}, "templates": {name: {...}}}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import defaultdict

from transformers.utils import logging as transformers_logging

from clawrl.engines.base import SamplingParams
from clawrl.envs.tool_calls import parse_reply
from clawrl.orchestration.env_commands import resolve, split_records
from clawrl.orchestration.evaluation import (default_concurrency, episode_seed, model_episode, open_eval_engine)
from clawrl.envs.scripted import success_of


def first_action(episode) -> str:
    """'call' (a well-formed python call), 'answer' (a box, no call), or 'malformed'."""
    replies = [m["content"] for m in episode.transcript if m.get("role") == "assistant"]
    if not replies:
        return "malformed"
    reply = parse_reply(replies[0])
    return "call" if reply.calls else "answer" if reply.answer is not None else "malformed"


async def profile(cfg, records, n: int, temperature: float) -> dict:
    engine, notes = await open_eval_engine(cfg, None)
    for note in notes:
        print(f"clawrl: {note}", file=sys.stderr)
    gate = asyncio.Semaphore(default_concurrency(cfg))

    async def play(index, record, k):
        params = SamplingParams(max_new_tokens=cfg.env.max_tokens_per_turn, temperature=temperature,
                                seed=episode_seed(cfg.seed, index, n, k))
        async with gate:
            return record, await model_episode(cfg, engine, record, params)

    try:
        played = await asyncio.gather(*(play(i, r, k) for i, r in enumerate(records) for k in range(n)))
    finally:
        await engine.shutdown()
    groups: dict[str, list] = defaultdict(list)
    for record, episode in played:
        groups[record.task.data.get("template", "?")].append(episode)
        groups["overall"].append(episode)
    out = {}
    for name, episodes in groups.items():
        ran = [e for e in episodes if not e.failed]
        k = len(ran) or 1
        first = [first_action(e) for e in ran]
        called = [e for e, f in zip(ran, first) if f == "call"]
        out[name] = {
            "episodes": len(episodes), "failed": len(episodes) - len(ran),
            "success": round(sum(success_of(e.reward, e.info) for e in ran) / k, 3),
            "first_call_well_formed": round(len(called) / k, 3),
            "first_answer_without_tool": round(first.count("answer") / k, 3),
            "first_malformed": round(first.count("malformed") / k, 3),
            "success_when_called": round(sum(success_of(e.reward, e.info) for e in called) / (len(called) or 1), 3),
            "malformed_replies_per_episode": round(sum(e.malformed for e in ran) / k, 2),
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="test")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--stride", type=int, default=1, help="every K-th task of the split (all templates, fewer tasks)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    transformers_logging.disable_progress_bar()
    task_set = resolve("toolcall-rl", args.overrides)
    records = split_records(task_set, args.split, args.limit)[::args.stride]
    result = asyncio.run(profile(task_set.cfg, records, args.n, args.temperature))
    overall = result.pop("overall")
    for name in sorted(result):
        r = result[name]
        print(f"{name:18s} n={r['episodes']:4d} success={r['success']:.3f} call={r['first_call_well_formed']:.3f} "
              f"guess={r['first_answer_without_tool']:.3f} malformed={r['first_malformed']:.3f} "
              f"success|call={r['success_when_called']:.3f}", file=sys.stderr)
    print(json.dumps({"overall": overall, "templates": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
