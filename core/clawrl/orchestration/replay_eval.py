"""``clawrl replay --held-out``: the replay's held-out curve beside the original run's.

A replay with overrides (another ``train.lr``, another ``method``) is only worth its name if it shows
what online learning would have done, measured as the run measured itself. So the replay evaluates its
weights at the recorded train steps where the original run evaluated, with the original's own measure,
and writes both curves side by side (``D2/heldout.json`` and ``D2/heldout.png``).

Where the original's held-out curve is, and how it was measured (the two ways clawrl evaluates held out):

- *A chat run of* ``clawrl demo``: ``D/demo/results.json``, a point per measurement with its train step.
  The measure is the demo's own (``clawrl.demo.evaluation``): the held-out questions of ``demo.eval_prompts``
  and ``seed``, asked through a gateway (``create_app``, on a free loopback port, its side turns recorded
  in ``D2/heldout/``) at the serving temperature with each question's fixed sampling seed, scored by the
  simulated user ``demo.user`` (the preference rate, and the share of correct sums beside it).
- *An environment run* (``env.name``, ``env.eval_every``): the ``eval/success_rate`` rows of
  ``D/metrics.jsonl``. The measure is the learner's periodic evaluation (``Learner.held_out_eval``): greedy,
  once per task of ``env.eval_split`` (at most ``env.eval_limit``), through ``evaluate``, the function of
  ``clawrl env eval`` (success rate, and mean reward beside it).

The replay's weights reach a serving engine of its own the way a run's do (``trainer.weight_sync(engine)``,
the export the learner pushes), after the recorded step the original evaluated at; step 0 is the base
weights. The engine, the gateway and the evaluations run on an event loop in a thread of their own, and
training waits for each evaluation. A chat run that is not a demo has no held-out measure: ``--held-out``
is refused for it in one line.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from clawrl.config import ClawrlConfig
from clawrl.envs import CHAT, EnvError, env_class
from clawrl.envs.task_formats import TaskRecord
from clawrl.envs.tasks import load_tasks
from clawrl.errors import CliError

HELD_OUT_JSON = "heldout.json"
HELD_OUT_PNG = "heldout.png"
HELD_OUT_STORE = "heldout"  # D2/heldout/: the gateway's store of the demo measure's side turns
DEMO_RESULTS = Path("demo") / "results.json"


@dataclass
class Curve:
    """A held-out curve: per train step, the main figure and the one beside it."""

    kind: str  # "demo" | "env"
    metric: str
    side_metric: str
    points: dict[int, dict[str, float]] = field(default_factory=dict)  # train step -> {metric: value, ...}

    def series(self, metric: str) -> list[tuple[int, float]]:
        return [(step, p[metric]) for step, p in sorted(self.points.items()) if metric in p]


def original_curve(root: Path) -> Optional[Curve]:
    """Run ``root``'s held-out curve as the run measured it, or None when it has none."""
    demo = root / DEMO_RESULTS
    if demo.is_file():
        try:
            points = json.loads(demo.read_text())["points"]
        except (ValueError, KeyError, TypeError) as e:
            raise CliError(f"{demo}: not a demo's results ({type(e).__name__}: {e})") from None
        curve = Curve("demo", "preference_rate", "correct")
        for p in points:  # two measurements of one step (no training between): the later one
            curve.points[int(p["train_step"])] = {"preference_rate": float(p["rate"]), "correct": float(p["correct"]),
                                                  "interactions": p["interactions"]}
        return curve if curve.points else None
    metrics = root / "metrics.jsonl"
    if metrics.is_file():
        curve = Curve("env", "success_rate", "mean_reward")
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(row, dict) and "eval/success_rate" in row and "step" in row:
                curve.points[int(row["step"])] = {"success_rate": float(row["eval/success_rate"]),
                                                  "mean_reward": float(row.get("eval/mean_reward", 0.0))}
        return curve if curve.points else None
    return None


def check_held_out(root: Path) -> Curve:
    """The original curve, or CliError in one line when ``root`` has none."""
    curve = original_curve(root)
    if curve is None:
        raise CliError(f"--held-out: {root} has no held-out curve to compare with (no {DEMO_RESULTS} of a clawrl "
                       "demo, no eval/success_rate in metrics.jsonl of an environment run with env.eval_every)")
    return curve


class HeldOutReplay:
    """Evaluates a replay's weights at the original's held-out steps, the original's way; see the
    module docstring. ``start`` before training, ``at`` after each recorded step, ``close`` at the end."""

    def __init__(self, cfg: ClawrlConfig, out: Path, original: Curve):
        self.cfg, self.out, self.original = cfg, out, original
        self.replayed = Curve(original.kind, original.metric, original.side_metric)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clawrl-replay-heldout", daemon=True)
        self._engine = self._sync = self._server = self._serving = self._sock = self._store = None
        self._client = self._records = None

    def wants(self, step: int) -> bool:
        return step in self.original.points

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def start(self) -> None:
        self._thread.start()
        try:
            self._run(self._start())
        except BaseException:
            self.close()
            raise

    def at(self, step: int, trainer, version: int) -> dict[str, float]:
        """Serve ``trainer``'s weights as ``version`` (none: the base weights, step 0) and measure them."""
        figures = self._run(self._at(trainer, version))
        self.replayed.points[step] = figures
        return figures

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._run(self._close())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
        self._loop.close()

    # ---------------------------------------------------------------- on the loop

    async def _start(self) -> None:
        from clawrl.engines import make_engine

        cfg = self.cfg
        if self.original.kind == "env":
            if cfg.env.name == CHAT:
                raise CliError("--held-out: the run evaluated an environment but env.name is not set in its config")
            try:
                tasks = load_tasks(cfg.env.tasks, cfg.env.eval_split, env_class(cfg.env.name))
            except EnvError as e:
                raise CliError(f"--held-out: {str(e).splitlines()[0]}") from None
            self._records = [TaskRecord(t, cfg.env.eval_split, cfg.env.name) for t in tasks][:cfg.env.eval_limit]
            self._engine = await asyncio.to_thread(make_engine, cfg)
            await self._engine.start()
            return
        await self._start_gateway(make_engine)

    async def _start_gateway(self, make_engine) -> None:
        """The demo's measure goes through a gateway, as the demo's did: on a free loopback port, no
        key (the run's key is not stored), no learner."""
        import openai
        import uvicorn

        from clawrl.gateway.app import create_app
        from clawrl.orchestration.serve import bind_socket
        from clawrl.sessions import SessionLinker
        from clawrl.store import TurnStore

        cfg = self.cfg
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, host="127.0.0.1", port=0, api_key=None,
                                                                   admin_key=None))
        self._engine = await asyncio.to_thread(make_engine, cfg)
        self._store = TurnStore(self.out / HELD_OUT_STORE)
        app = create_app(cfg, self._engine, SessionLinker(self._store, idle_timeout_s=cfg.sessions.idle_timeout_s))
        self._sock = bind_socket("127.0.0.1", 0)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._serving = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()
                raise CliError("--held-out: the evaluation gateway stopped during startup")
            await asyncio.sleep(0.05)
        port = self._sock.getsockname()[1]
        self._client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=2,
                                          timeout=300)

    async def _at(self, trainer, version: int) -> dict[str, float]:
        if trainer is not None:
            if self._sync is None:
                self._sync = trainer.weight_sync(self._engine)
            await self._sync.push(trainer, version)
        if self.original.kind == "env":
            from clawrl.orchestration.evaluation import concurrency_beside_rollouts, evaluate

            result = await evaluate(self.cfg, self._engine, self._records, n=1, temperature=0.0,
                                    concurrency=concurrency_beside_rollouts(self.cfg))
            return {"success_rate": result.success_rate, "mean_reward": result.mean_reward}
        from clawrl.demo.evaluation import SERVING_TEMPERATURE, held_out_questions, preference_rate
        from clawrl.demo.users import correct, make_user

        cfg = self.cfg
        questions = held_out_questions(cfg.demo.eval_prompts, cfg.seed)
        rate, replies = await preference_rate(self._client, self._engine.model_info().name, make_user(cfg.demo.user),
                                              questions, SERVING_TEMPERATURE, cfg.demo.max_tokens, cfg.seed)
        right = sum(correct(q, r) for q, r in zip(questions, replies)) / len(questions)
        return {"preference_rate": rate, "correct": right}

    async def _close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._serving  # the app's lifespan shuts the engine down
            self._sock.close()
        elif self._engine is not None:
            await self._engine.shutdown()
        if self._store is not None:
            self._store.close()


def _stored_values(run_dir: Path, keys: list[str]) -> dict[str, Any]:
    """What run ``run_dir``'s stored config holds for ``keys`` (those it has)."""
    from clawrl.run_config import CONFIG_FILE

    path = run_dir / CONFIG_FILE
    if not keys or not path.is_file():
        return {}
    from omegaconf import OmegaConf

    try:
        stored = OmegaConf.load(path)
    except Exception:
        return {}
    out = {}
    for k in keys:
        v = OmegaConf.select(stored, k, default="\0missing")
        if v != "\0missing":
            out[k] = v
    return out


def write_side_by_side(original: Curve, replayed: Curve, out: Path, run_dir: Path, overrides: tuple[str, ...]
                       ) -> tuple[Path, Path]:
    """``heldout.json`` and ``heldout.png`` in ``out``: the original's and the replay's held-out curves
    by train step (the main figure solid, the one beside it dashed)."""
    label = " ".join(overrides) or "no overrides"
    was = _stored_values(run_dir, [o.split("=", 1)[0] for o in overrides if "=" in o])
    original_label = "original run" + (f" ({' '.join(f'{k}={v}' for k, v in was.items())})" if was else "")
    data = {"kind": original.kind, "metric": original.metric, "side_metric": original.side_metric,
            "run_dir": str(run_dir.resolve()), "overrides": list(overrides), "original_values": was,
            "original": [{"train_step": s, **p} for s, p in sorted(original.points.items())],
            "replay": [{"train_step": s, **p} for s, p in sorted(replayed.points.items())]}
    js = out / HELD_OUT_JSON
    js.write_text(json.dumps(data, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=120)
    for curve, name, color in ((original, original_label, "tab:blue"), (replayed, f"replay: {label}", "tab:orange")):
        main, side = curve.series(curve.metric), curve.series(curve.side_metric)
        if main:
            ax.plot(*zip(*main), marker="o", color=color, label=f"{name}: {curve.metric}")
        if side:
            ax.plot(*zip(*side), linestyle="--", marker=".", alpha=0.6, color=color, label=f"{name}: {curve.side_metric}")
    ax.set_xlabel("train step (the recorded batches, in the run's order)")
    ax.set_ylabel("held out")
    if original.metric in ("preference_rate", "success_rate"):
        ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"held out: {run_dir.name} and its replay ({label})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = out / HELD_OUT_PNG
    fig.savefig(png)
    plt.close(fig)
    return js, png

