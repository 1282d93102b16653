"""The demo loop: gateway + learner in-process, a simulated user over HTTP, measurements, outputs.

Why in-process and over HTTP at once: the user must go through exactly what a real client goes
through (the OpenAI API, session linking by prefix, next states), while the demo must know when
the learner has caught up before it measures. ``Learner.settle`` gives the second; a uvicorn server
on a free port in the same event loop gives the first.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvicorn
from tqdm import tqdm

from clawrl.config import compose
from clawrl.demo.evaluation import held_out_questions, preference_rate, sampling, skill_rate
from clawrl.demo.users import correct, make_user
from clawrl.embedded.build import resolve_model
from clawrl.engines import make_engine
from clawrl.errors import CliError
from clawrl.gateway.app import create_app
from clawrl.logs import parse_level, setup_logging
from clawrl.methods.registry import check_method
from clawrl.orchestration.learner import attach_learning
from clawrl.orchestration.serve import bind_socket
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

log = logging.getLogger(__name__)

# Learning settings that make the embedded model learn a preference within ~160 interactions
# (measured, see BENCHMARKS.md "Learning (issue 4)"). The user's own overrides come after and win.
DEMO_DEFAULTS = (
    "server.port=0",
    "train.batch_size=8",
    "train.save_every=5",
    "engine.max_batch_size=64",
    "opd.topk=8",  # opd/combine: the teacher's top-8 per token, so distillation also says what to say instead
    "logging.wandb.mode=disabled",  # a throwaway run: metrics.jsonl and the demo's own table suffice
)


@dataclass
class Point:
    interactions: int
    rate: float  # preference satisfied on the held-out questions
    correct: float  # held-out replies whose last number is the sum
    weight_version: int
    train_step: int
    online_rate: float | None  # satisfied among the interactions since the previous point
    seconds: float  # since the demo started


async def run_demo(cfg) -> list[Point]:
    """Run the whole demo for a composed config; returns the measured points."""
    import openai  # the demo's simulated users are OpenAI clients (a test extra)

    demo = cfg.demo
    user = make_user(demo.user)
    engine = await asyncio.to_thread(make_engine, cfg)
    store = TurnStore(cfg.run_dir)
    app = create_app(cfg, engine, SessionLinker(store, idle_timeout_s=cfg.sessions.idle_timeout_s))
    learner = attach_learning(app, cfg, engine, store)
    sock = bind_socket(cfg.server.host, cfg.server.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    started = time.monotonic()
    try:
        while not server.started:
            if serving.done():
                serving.result()  # startup failed: raise its error
                raise RuntimeError("the demo server stopped during startup")
            await asyncio.sleep(0.05)
        port = sock.getsockname()[1]
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=cfg.server.api_key or "none",
                                    max_retries=2, timeout=300)
        model = engine.model_info().name
        rng = random.Random(f"demo-user-{cfg.seed}")
        held_out = held_out_questions(demo.eval_prompts, cfg.seed, user.ask)
        points: list[Point] = []
        window: list[bool] = []

        async def measure(k: int) -> None:
            if learner is not None:
                await learner.settle()
            rate, replies = await preference_rate(client, model, user, held_out, demo.temperature,
                                                  demo.max_tokens, cfg.seed)
            if user.domain == "additions":  # the sums' last number, at the serving temperature
                right = sum(correct(q, r) for q, r in zip(held_out, replies)) / len(held_out)
            else:  # the held-out skill the user never judges, greedy
                right = await skill_rate(client, model, demo.max_tokens)
            online = sum(window) / len(window) if window else None
            window.clear()
            step = learner.train_step if learner is not None else 0
            points.append(Point(k, rate, right, engine.model_info().weight_version, step, online,
                                round(time.monotonic() - started, 1)))
            line = (f"after {k} interactions: {100 * rate:.0f}% of {len(held_out)} held-out questions answered the "
                    f"way the user likes (weight version {points[-1].weight_version}, train step {step})")
            log.info(line)
            tqdm.write(f"clawrl demo: {line}", file=sys.stdout)  # above the progress bar, not through it

        await measure(0)
        for i in tqdm(range(1, demo.interactions + 1), desc="interactions", unit="chat"):
            q = user.ask(rng, held_out=False)
            asked = [{"role": "user", "content": q.text}]
            # One session per interaction, named by header as OpenClaw's rl-training-headers plugin does.
            session = {"X-Session-Id": f"demo-{cfg.seed}-{i}"}
            r = await client.chat.completions.create(model=model, messages=asked, **sampling(demo.temperature),
                                                     max_tokens=demo.max_tokens, seed=rng.randrange(1 << 31),
                                                     extra_headers=session)
            reply = r.choices[0].message.content or ""
            window.append(user.satisfied(q, reply))
            # The feedback is the next state of the reply's turn; the session ends with it, so the
            # model's answer to the feedback itself (one token) is stored but never judged.
            feedback = user.feedback(q, reply, rng)
            await client.chat.completions.create(
                model=model, max_tokens=1, **sampling(demo.temperature),
                extra_headers={**session, "X-Session-Done": "1"},
                messages=asked + [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}])
            if i % demo.eval_every == 0 or i == demo.interactions:
                await measure(i)
        return points
    finally:
        server.should_exit = True
        await serving
        sock.close()
        store.close()


def write_outputs(points: list[Point], cfg, out_dir: Path) -> tuple[Path, Path, str]:
    """results.json, results.md (the table) and preference_rate.png; returns (png, md, table)."""
    from clawrl.demo.plot import plot_curves

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = ["| interactions | held-out rate | held-out correct | weight version | train steps "
            "| satisfied since last row | s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        online = "" if p.online_rate is None else f"{p.online_rate:.2f}"
        rows.append(f"| {p.interactions} | {p.rate:.2f} | {p.correct:.2f} | {p.weight_version} | {p.train_step} "
                    f"| {online} | {p.seconds:.0f} |")
    rise = points[-1].rate - points[0].rate
    table = "\n".join(rows) + f"\n\nrise: {points[0].rate:.2f} -> {points[-1].rate:.2f} ({rise:+.2f})\n"
    (out_dir / "results.md").write_text(table)
    (out_dir / "results.json").write_text(json.dumps({
        "method": cfg.method, "user": cfg.demo.user, "seed": cfg.seed, "train_enabled": cfg.train.enabled,
        "lr": cfg.train.lr, "batch_size": cfg.train.batch_size, "points": [asdict(p) for p in points]}, indent=2))
    label = f"method={cfg.method} seed={cfg.seed}" + ("" if cfg.train.enabled else " (no training)")
    png = plot_curves({f"preference satisfied, {label}": [(p.interactions, p.rate) for p in points]},
                      out_dir / "preference_rate.png", f"simulated user '{cfg.demo.user}'",
                      side_curves={"sum correct": [(p.interactions, p.correct) for p in points]})
    return png, out_dir / "results.md", table


def demo_cli(args) -> int:
    """``clawrl demo method=rl|opd|combine [key=value ...]``."""
    overrides = list(args.overrides)
    if not any(o.startswith("run_dir=") for o in overrides):
        # A fresh directory per demo: an old run's checkpoint would resume and spoil the curve.
        overrides.append(f"run_dir=runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = resolve_model(compose([*DEMO_DEFAULTS, *overrides]))
    check_method(cfg.method)
    run_dir = Path(cfg.run_dir)
    if (run_dir / "clawrl.sqlite").exists():
        raise CliError(f"run_dir={run_dir} already holds a run; the demo needs a fresh directory")
    demo = cfg.demo
    # The console gets warnings only (all of it at logging.level=DEBUG); the log file everything.
    log_path = run_dir / "demo.log"
    debug = parse_level(cfg.logging.level) <= logging.DEBUG
    log_file = setup_logging(cfg.logging.level, console_level=None if debug else "WARNING", log_file=log_path)
    print(f"clawrl demo: method={cfg.method}, simulated user '{demo.user}', {demo.interactions} interactions, "
          f"{demo.eval_prompts} held-out questions every {demo.eval_every}; writing to {run_dir} "
          f"(log: {log_path})", flush=True)
    try:
        points = asyncio.run(run_demo(cfg))
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    png, md, table = write_outputs(points, cfg, run_dir / "demo")
    print(table, flush=True)
    print(f"clawrl demo: table in {md}, plot in {png}, log in {log_path}", flush=True)
    return 0
