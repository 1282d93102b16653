"""Episodes per minute of tool-call rollouts on one GPU (issue 16 item 7; throughput only).

toolcall-rl's tasks (``ToolCallEnv``: a persistent Python interpreter, answer in ``\\boxed{}``)
rolled out through ``EnvSource`` -- the path ``clawrl serve`` trains from -- against the engine
serving a random-weight model of the given shape (default: the Qwen3-0.6B shape on a GPU, tiny on
a CPU). Several groups are in flight at once, as ``env.groups_in_flight`` runs them. A random
model calls no tools and boxes no answer, so each episode is mostly its first turn's
``env.max_tokens_per_turn`` tokens and the reward is -1: this measures the engine and the rollout
loop, not learning. Like ``gpu_suite.py --part serving``, the model is first made to sample ids
the embedded tokenizer has (``speak_tokenizer``), so the turns decode to text that the
environment parses; ``<|im_end|>`` is its end-of-turn token.

The first group runs untimed (graph captures); then groups are started for ``--seconds`` and the
figure is the episodes of every started group over the time until the last one finished.
``key=value`` arguments after the options are config overrides (e.g. the sandbox backend).

    python benchmarks/gpu_rollouts.py [--shape qwen3-0.6b] [--tokenizer DIR] [--seconds 60]
        [--groups-in-flight 8] [--out FILE] [sandbox.backend=subprocess sandbox.allow_unisolated=true ...]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from clawrl.config import compose
from clawrl.engines.loading import LoadedModel
from clawrl.engines.torch_engine import TorchEngine
from clawrl.envs.source import make_env_source

_spec = importlib.util.spec_from_file_location("gpu_suite", Path(__file__).with_name("gpu_suite.py"))
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)

TASKS = suite.ROOT / "toolcall-rl"


async def roll(src, seconds: float, in_flight: int) -> dict:
    await src.next_group()  # untimed: graph captures, the interpreter's first start
    done, counts = [], collections.Counter()
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            episodes, samples = await src.next_group()
            done.extend(episodes)
            counts["samples"] += len(samples)

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    wall = time.perf_counter() - t0
    for e in done:
        counts["failed" if e.failed else "ok"] += 1
        counts["turns"] += e.turns
        counts["sampled_tokens"] += sum(len(s) for s in e.sampled)
        counts[f"reason:{e.reason}"] += 1
    return {"episodes": len(done), "wall_s": round(wall, 2), "episodes_per_min": round(len(done) / wall * 60, 1),
            "turns_per_episode": round(counts["turns"] / max(1, len(done)), 2),
            "sampled_tok_s": round(counts["sampled_tokens"] / wall, 1), "counts": dict(counts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(suite.SHAPES), default=None,
                    help="model shape (default: qwen3-0.6b on a GPU, tiny on a CPU)")
    ap.add_argument("--tokenizer", default=None, help="directory with the embedded tokenizer (tokenizer_config.json)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long new groups are started")
    ap.add_argument("--groups-in-flight", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON file to merge the figures into (key rollouts.toolcall)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    if args.groups_in_flight < 1 or args.group_size < 1 or args.seconds <= 0:
        ap.error("--groups-in-flight and --group-size must be >= 1 and --seconds > 0")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = args.shape or ("qwen3-0.6b" if device == "cuda" else "tiny")
    work = Path(tempfile.mkdtemp(prefix="gpu-rollouts-"))
    overrides = [f"run_dir={work / 'run'}", "env.name=toolcall", f"env.tasks={TASKS}", "env.max_turns=4",
                 "env.max_tokens_per_turn=192", f"env.group_size={args.group_size}",
                 f"engine.max_batch_size={args.group_size * args.groups_in_flight}", *args.overrides]
    cfg = compose(overrides)
    model = suite.build_model(shape, device)
    tok = suite.chat_tokenizer(args.tokenizer, work)
    suite.speak_tokenizer(model, min(len(tok), model.config.vocab_size))
    lm = LoadedModel(**{**vars(suite.served(model, shape)), "tokenizer": tok,
                        "eos_token_ids": [tok.convert_tokens_to_ids("<|im_end|>")]})

    async def run() -> dict:
        engine = TorchEngine(lm, cfg.engine)
        await engine.start()
        try:
            return await roll(make_env_source(cfg, engine), args.seconds, args.groups_in_flight)
        finally:
            await engine.shutdown()

    res = asyncio.run(run())
    res.update(shape=shape, device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               groups_in_flight=args.groups_in_flight, group_size=args.group_size, commit=suite.commit(),
               command="python benchmarks/gpu_rollouts.py " + shlex.join(sys.argv[1:] if argv is None else argv),
               overrides=overrides[1:])
    print(json.dumps(res, indent=1))
    if args.out:
        out = Path(args.out)
        results = json.loads(out.read_text()) if out.exists() else {}
        results.setdefault("rollouts", {})["toolcall"] = res
        out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
