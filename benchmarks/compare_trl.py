"""A peer side by side: TRL's GRPOTrainer against clawrl's own GRPO loop (issue 22, item 3).

Both sides train the embedded model (clawrl-tiny, ``clawrl.embedded.build.default_model_path()``,
1.5M parameters, float32 on the CPU) from the same weights, in the same run, on:

- the same prompts: ``--prompts`` addition questions from ``clawrl.demo.users.ask`` (the phrasings
  the model knows; pairs from the training side of the corpus), each a one-message chat rendered
  by the model's own chat template;
- the same reward: the ``clawrl demo`` simulated user's preference as a plain function
  (``reward``: 1.0 when ``USERS[--user].satisfied(question, reply)``, else 0.0; default the
  "worked" user, who likes "7 + 5 = 12");
- the same group size (``--group-size``, 4), samples per optimizer step (``--batch``, 8 = two
  groups), learning rate (the embedded model's default, ``train.lr`` from
  ``core/clawrl/conf/embedded.yaml``: 2e-4), constant schedule, AdamW (0.9, 0.999, eps 1e-8, no
  weight decay), grad-norm clip 1.0, no KL, one optimizer step per batch (PPO clip 0.2/0.28: inert
  for TRL, whose ratio is 1; near it for clawrl, whose rollouts may be a weight version or two
  behind), GRPO mean/std advantages, token-mean loss;
- the same generation: temperature 1.0, no top-p/top-k, at most ``demo.max_tokens`` (24) tokens,
  one turn;
- the same number of rollouts: clawrl runs first for ``--steps`` train steps; TRL then runs for as
  many optimizer steps as it takes to sample at least as many completions as clawrl rolled out.

What each side runs:

- clawrl: exactly what ``clawrl serve`` runs for an environment recipe, in-process as
  ``tests/test_env_training.py`` does: ``Learner(cfg, make_engine(cfg), TurnStore(run_dir))`` with
  ``env.name=benchmarks/compare_trl.py:PreferenceEnv`` (a one-turn ``clawrl.envs.Env`` whose
  reward is ``reward``), ``method=rl``, and ``env.group_size``, ``train.batch_size`` and
  ``env.max_train_steps`` set to G, B and S. So: clawrl's engine samples each group with exact
  per-token logprobs
  (``RolloutWorker``/``EnvSource``, 2 groups in flight, rollouts ahead of training by at most 2
  batches), groups whose rewards are all equal are filtered out (no samples), ``score_group`` gives
  the GRPO advantages, the episodes and samples are stored in the run's SQLite store, the torch
  trainer takes whole groups B samples at a time (``clawrl.losses.policy_loss``), the new weights
  are swapped into the engine after each step, and a checkpoint is written at the end; the trained
  weights are read back with ``clawrl export-model``'s ``export_model``.
- TRL: ``trl.GRPOTrainer`` (``GRPOConfig``: ``num_generations=G``, ``per_device_train_batch_size=B``,
  ``steps_per_generation=1``, ``num_iterations=1``, ``loss_type="dapo"`` (token-mean, its
  default), ``beta=0``, ``epsilon=0.2``, ``epsilon_high=0.28``, ``scale_rewards="group"``,
  ``lr_scheduler_type="constant"``, ``max_completion_length=24``, ``use_cpu=True``, float32,
  ``gradient_checkpointing=False`` (TRL 1.16 turns it on by default; clawrl's trainer has it off)),
  sampling with ``transformers``' ``generate`` (no vLLM on a CPU), a conversational dataset of
  the same prompts, reward function ``reward``. It trains every group, equal rewards included
  (zero advantage).

Measured: every rollout's reward, in the order it was sampled (the training curve: mean reward per
window of rollouts, against rollouts sampled), the wall-clock seconds of training (from the first
rollout to the last step, model loading and evaluation excluded), rollouts sampled and samples
trained per minute, and, with one evaluator for all three models (``transformers`` ``generate`` at
temperature 1.0, ``--eval-prompts`` held-out questions (pairs the corpus never shows) x
``--eval-samples`` samples, the same seed), the held-out reward of the starting weights and of each
side's trained weights. Gain per sample = (held-out reward after - before) / rollouts sampled.
Writes benchmarks/results/compare_trl.json and .png and prints the table for BENCHMARKS.md.

TRL is a benchmark-only dependency (not in requirements.txt or constraints.txt). Install it beside
torch 2.13.0+cpu and transformers 5.24.0 without touching the system environment:

    python3 -m venv --system-site-packages /tmp/trlvenv
    /tmp/trlvenv/bin/pip install trl==1.16.0

which added (nothing else replaced; ``--dry-run`` first showed no torch or transformers change):
trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19, pandas 3.1.1, pyarrow 26.0.1, and
setuptools 84.2.1 (inside the venv, over the venv's own 65.5.0). Then:

    /tmp/trlvenv/bin/python benchmarks/compare_trl.py              # --steps 20 --prompts 48 --group-size 4 --batch 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clawrl.demo.users import USERS, Question, ask
from clawrl.envs import Env, Observation, StepOutcome, Task

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
INSTALL = ("python3 -m venv --system-site-packages /tmp/trlvenv && /tmp/trlvenv/bin/pip install trl==1.16.0, "
           "then run this script with /tmp/trlvenv/bin/python")

# Read by PreferenceEnv, which clawrl loads from this file as its own module (env.name=FILE:CLASS).
ENV_USER, ENV_PROMPTS, ENV_SEED, ENV_LOG = ("COMPARE_TRL_USER", "COMPARE_TRL_PROMPTS", "COMPARE_TRL_SEED",
                                            "COMPARE_TRL_LOG")


def reward(user_name: str, q: Question, reply: str) -> float:
    """The simulated user's preference as a reward: 1.0 when satisfied, else 0.0."""
    return 1.0 if USERS[user_name].satisfied(q, reply) else 0.0


def train_questions(n: int, seed: int) -> list[Question]:
    rng = random.Random(f"compare-trl-train-{seed}")
    return [ask(rng, held_out=False) for _ in range(n)]


def eval_questions(n: int, seed: int) -> list[Question]:
    rng = random.Random(f"compare-trl-eval-{seed}")
    return [ask(rng, held_out=True) for _ in range(n)]


class PreferenceEnv(Env):
    """One question, one reply, the user's verdict as the reward (clawrl's side of the comparison)."""

    def __init__(self):
        self.q: Question | None = None

    @classmethod
    def tasks(cls, split: str) -> list[Task]:
        n, seed = int(os.environ.get(ENV_PROMPTS, "48")), int(os.environ.get(ENV_SEED, "1"))
        qs = train_questions(n, seed) if split == "train" else eval_questions(n, seed)
        return [Task(task_id=f"{split}-{i}", data={"text": q.text, "a": q.a, "b": q.b}) for i, q in enumerate(qs)]

    async def reset(self, task: Task) -> Observation:
        self.q = Question(task.data["text"], int(task.data["a"]), int(task.data["b"]))
        return Observation([{"role": "user", "content": self.q.text}])

    async def step(self, action: str) -> StepOutcome:
        r = reward(os.environ.get(ENV_USER, "worked"), self.q, action)
        if os.environ.get(ENV_LOG):
            with open(os.environ[ENV_LOG], "a") as f:
                f.write(json.dumps({"t": time.time(), "reward": r}) + "\n")
        return StepOutcome(None, reward=r, done=True)


# ---------------------------------------------------------------- settings both sides share


def shared_settings(args) -> dict:
    """The settings both sides take, from clawrl's composed config for the embedded model."""
    from clawrl.config import compose
    from clawrl.embedded.build import resolve_model

    cfg = resolve_model(compose(["logging.wandb.mode=disabled"]))
    return {"model_path": str(cfg.model.path), "lr": cfg.train.lr, "group_size": args.group_size,
            "batch": args.batch, "max_tokens": cfg.demo.max_tokens, "temperature": 1.0,
            "grad_clip": cfg.train.grad_clip, "weight_decay": cfg.train.weight_decay,
            "eps_clip_low": cfg.train.eps_clip_low, "eps_clip_high": cfg.train.eps_clip_high,
            "kl_coef": cfg.train.kl_coef, "group_advantage": cfg.train.group_advantage,
            "aggregation": cfg.train.aggregation}


def clawrl_overrides(args, s: dict, run_dir: Path) -> list[str]:
    return [f"run_dir={run_dir}", "method=rl", f"seed={args.seed}", "logging.wandb.mode=disabled",
            f"env.name={Path(__file__).resolve()}:PreferenceEnv", f"env.group_size={s['group_size']}",
            f"train.batch_size={s['batch']}", "env.max_turns=1", f"env.max_tokens_per_turn={s['max_tokens']}",
            f"env.temperature={s['temperature']}", f"env.max_train_steps={args.steps}", "env.eval_every=0",
            f"train.save_every={args.steps}"]


# ---------------------------------------------------------------- clawrl's side


def run_clawrl(args, s: dict, work: Path) -> dict:
    from clawrl.config import compose
    from clawrl.embedded.build import resolve_model
    from clawrl.engines import make_engine
    from clawrl.orchestration.export_model import export_model
    from clawrl.orchestration.learner import Learner
    from clawrl.store import TurnStore

    run_dir, log = work / "clawrl-run", work / "clawrl-rewards.jsonl"
    os.environ.update({ENV_USER: args.user, ENV_PROMPTS: str(args.prompts), ENV_SEED: str(args.seed),
                       ENV_LOG: str(log)})
    cfg = resolve_model(compose(clawrl_overrides(args, s, run_dir)))
    assert cfg.train.lr == s["lr"]
    engine = make_engine(cfg)
    store = TurnStore(cfg.run_dir)
    timing = {}

    async def main():
        done = asyncio.Event()
        learner = Learner(cfg, engine, store, on_done=done.set)
        await engine.start()
        try:
            await asyncio.to_thread(learner.prepare)
            timing["start"] = time.time()
            await learner.start()
            await asyncio.wait_for(done.wait(), args.timeout)
            timing["end"] = time.time()
            return learner.train_step, learner.status()
        finally:
            await learner.stop()
            await engine.shutdown()

    try:
        steps, status = asyncio.run(main())
        trained = store.connection().execute("SELECT COUNT(*) FROM samples WHERE state = 'trained'").fetchone()[0]
    finally:
        store.close()
    export_model(cfg, run_dir, work / "clawrl-model")
    rewards = [json.loads(line) for line in log.read_text().splitlines()]
    sampled_until = [r for r in rewards if r["t"] <= timing["end"]]
    env = status.get("env", {})  # the rollout worker's counters: groups kept, filtered (all rewards equal), ...
    return {"train_steps": steps, "samples_trained": trained, "rollouts": len(sampled_until),
            "rewards": [r["reward"] for r in sampled_until], "seconds": timing["end"] - timing["start"],
            "groups": {k: v for k, v in env.items() if isinstance(v, (int, float)) and "group" in k},
            "model_dir": str(work / "clawrl-model")}


# ---------------------------------------------------------------- TRL's side


def trl_config(s: dict, steps: int, out: Path, trl_seed: int):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, seed=int(trl_seed), report_to=[],
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=s["weight_decay"],
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=s["grad_clip"],
        per_device_train_batch_size=s["batch"], num_generations=s["group_size"], steps_per_generation=1,
        num_iterations=1, max_steps=steps, loss_type="dapo", beta=s["kl_coef"], epsilon=s["eps_clip_low"],
        epsilon_high=s["eps_clip_high"], scale_rewards="group", temperature=s["temperature"], top_p=1.0,
        top_k=0, max_completion_length=s["max_tokens"], logging_steps=1, save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False)


def run_trl(args, s: dict, work: Path, rollouts: int, clawrl_steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    steps = math.ceil(rollouts / s["batch"])
    tok = AutoTokenizer.from_pretrained(s["model_path"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(s["model_path"], dtype="float32")
    qs = train_questions(args.prompts, args.seed)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": q.text}], "text": q.text, "a": q.a, "b": q.b}
                              for q in qs])
    log: list[dict] = []

    def user_reward(prompts, completions, text, a, b, **_):
        out = []
        for c, t, x, y in zip(completions, text, a, b):
            reply = c[0]["content"] if isinstance(c, list) else c
            out.append(reward(args.user, Question(t, int(x), int(y)), reply))
        log.extend({"t": time.time(), "reward": r} for r in out)
        return out

    user_reward.__name__ = f"user_{args.user}"
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=user_reward,
                          args=trl_config(s, steps, work / "trl-out", args.seed), train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # a dict per step on stdout; the rewards are kept here instead
    at_steps = work / "trl-model-at-clawrl-steps"

    class SaveAtClawrlSteps(TrainerCallback):
        """TRL's weights after as many optimizer steps (samples trained) as clawrl took, for the
        second view of the comparison; saving is outside the timed figures' spirit but cheap."""

        def on_step_end(self, a, state, control, model=None, **_):
            if state.global_step == clawrl_steps:
                model.save_pretrained(at_steps)
                tok.save_pretrained(at_steps)
                marks["at_steps"] = (time.time(), len(log))

    marks: dict = {}
    trainer.add_callback(SaveAtClawrlSteps())
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    trainer.model.save_pretrained(work / "trl-model")
    tok.save_pretrained(work / "trl-model")
    return {"train_steps": trainer.state.global_step, "samples_trained": trainer.state.global_step * s["batch"],
            "rollouts": len(log), "rewards": [r["reward"] for r in log], "seconds": seconds,
            "model_dir": str(work / "trl-model"),
            "at_clawrl_steps": {"train_steps": clawrl_steps, "rollouts": marks["at_steps"][1],
                                "seconds": marks["at_steps"][0] - started, "model_dir": str(at_steps)}}


# ---------------------------------------------------------------- one evaluator for every model


def held_out_reward(model_dir: str, tok_dir: str, qs: list[Question], samples: int, s: dict, user: str,
                    seed: int) -> float:
    """Mean reward over ``samples`` replies per held-out question, sampled by transformers' generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": q.text}], tokenize=False,
                                     add_generation_prompt=True) for q in qs]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    total = 0.0
    with torch.no_grad():
        for _ in range(samples):
            out = model.generate(**enc, do_sample=True, temperature=s["temperature"], top_p=1.0, top_k=0,
                                 max_new_tokens=s["max_tokens"], pad_token_id=tok.pad_token_id)
            replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            total += sum(reward(user, q, r) for q, r in zip(qs, replies))
    return total / (len(qs) * samples)


# ---------------------------------------------------------------- outputs


def curve(rewards: list[float], window: int) -> list[tuple[int, float]]:
    """Mean reward of each consecutive window of rollouts, at the rollout count ending it."""
    return [(i + window, sum(rewards[i:i + window]) / window) for i in range(0, len(rewards) - window + 1, window)]


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for name, color in (("clawrl", "tab:blue"), ("trl", "tab:orange")):
        side = result["sides"][name]
        xs, ys = zip(*side["curve"])
        ax.plot(xs, ys, marker=".", color=color, label=f"{name}: training rollouts' reward")
        ax.axhline(side["held_out_after"], color=color, linestyle="--", label=f"{name}: held-out after")
        bx.bar(name, side["rollouts_per_min"], color=color)
    e = result["sides"]["trl"]["at_clawrl_steps"]
    ax.plot([e["rollouts"]], [e["held_out_after"]], marker="*", markersize=12, color="tab:orange", linestyle="",
            label=f"trl: held-out after {e['train_steps']} steps (clawrl's)")
    ax.axhline(result["held_out_before"], color="gray", linestyle=":", label="held-out before (both)")
    ax.set_xlabel(f"rollouts sampled (mean reward per {result['window']})")
    ax.set_ylabel(f"reward (user '{result['user']}' satisfied)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("reward against rollouts sampled")
    bx.set_ylabel("rollouts sampled per minute (training)")
    bx.set_title("throughput, 2 shared CPU cores")
    fig.suptitle(f"clawrl vs TRL GRPOTrainer on the embedded model, group {result['settings']['group_size']}, "
                 f"lr {result['settings']['lr']:g}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def table(result: dict) -> str:
    rows = ["| side | rollouts sampled | samples trained | train steps | held-out reward before | after | gain "
            "| gain per 100 rollouts | training reward, first / last window | rollouts/min | samples trained/min |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("clawrl", "clawrl (Learner + engine + torch trainer)"), ("trl", "TRL 1.16 GRPOTrainer")):
        d = result["sides"][name]
        first, last = d["curve"][0][1], d["curve"][-1][1]
        rows.append(f"| {label} | {d['rollouts']} | {d['samples_trained']} | {d['train_steps']} "
                    f"| {result['held_out_before']:.3f} | {d['held_out_after']:.3f} | {d['gain']:+.3f} "
                    f"| {100 * d['gain_per_rollout']:+.4f} | {first:.2f} / {last:.2f} | {d['rollouts_per_min']:.0f} "
                    f"| {d['samples_trained_per_min']:.0f} |")
    e = result["sides"]["trl"]["at_clawrl_steps"]
    rows.append(f"| TRL, stopped at clawrl's {e['train_steps']} steps (same samples trained) | {e['rollouts']} "
                f"| {e['train_steps'] * result['settings']['batch']} | {e['train_steps']} "
                f"| {result['held_out_before']:.3f} | {e['held_out_after']:.3f} | {e['gain']:+.3f} "
                f"| {100 * e['gain'] / e['rollouts']:+.4f} | | {60 * e['rollouts'] / e['seconds']:.0f} "
                f"| {60 * e['train_steps'] * result['settings']['batch'] / e['seconds']:.0f} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--user", default="worked", choices=sorted(USERS))
    p.add_argument("--prompts", type=int, default=48, help="training questions")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--steps", type=int, default=20, help="clawrl train steps; TRL matches the rollouts")
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--window", type=int, default=32, help="rollouts per point of the training curve")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(RESULTS / "compare_trl"))
    args = p.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        print(f"compare_trl: trl is not importable; install it with: {INSTALL}", file=sys.stderr)
        return 2

    s = shared_settings(args)
    with tempfile.TemporaryDirectory(prefix="compare-trl-") as tmp:
        work = Path(tmp)
        qs = eval_questions(args.eval_prompts, args.seed)

        def evaluate(model_dir):
            return held_out_reward(model_dir, s["model_path"], qs, args.eval_samples, s, args.user, args.seed)

        before = evaluate(s["model_path"])
        print(f"compare_trl: held-out reward before training {before:.3f}", flush=True)
        sides = {"clawrl": run_clawrl(args, s, work)}
        print(f"compare_trl: clawrl {sides['clawrl']['train_steps']} steps, {sides['clawrl']['rollouts']} rollouts "
              f"in {sides['clawrl']['seconds']:.0f} s", flush=True)
        sides["trl"] = run_trl(args, s, work, sides["clawrl"]["rollouts"], sides["clawrl"]["train_steps"])
        print(f"compare_trl: TRL {sides['trl']['train_steps']} steps, {sides['trl']['rollouts']} rollouts "
              f"in {sides['trl']['seconds']:.0f} s", flush=True)
        for d in sides.values():
            d["held_out_after"] = evaluate(d.pop("model_dir"))
            d["gain"] = d["held_out_after"] - before
            d["gain_per_rollout"] = d["gain"] / d["rollouts"]
            d["gain_per_sample_trained"] = d["gain"] / d["samples_trained"]
            d["rollouts_per_min"] = 60 * d["rollouts"] / d["seconds"]
            d["samples_trained_per_min"] = 60 * d["samples_trained"] / d["seconds"]
            d["curve"] = curve(d["rewards"], args.window)
        early = sides["trl"]["at_clawrl_steps"]
        early["held_out_after"] = evaluate(early.pop("model_dir"))
        early["gain"] = early["held_out_after"] - before
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    import torch
    import transformers
    import trl

    result = {"user": args.user, "settings": {**s, "prompts": args.prompts, "clawrl_steps": args.steps,
                                              "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples,
                                              "seed": args.seed},
              "window": args.window, "held_out_before": before, "sides": sides, "commit": commit,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "trl": trl.__version__},
              "hardware": f"{os.cpu_count()} CPU cores (shared with a concurrent CI run)",
              "command": " ".join([Path(sys.executable).as_posix(), *sys.argv])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(table(result))
    print(f"compare_trl: wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
