"""``clawrl check-parallel [overrides]``: validate a model and a parallel layout before a long run.

Runs ``parity.check_parallel`` (one logprob pass and one train step, torch backend against
megatron ranks on this machine) and prints the layout and the largest differences. Exit status:
0 when parity holds, 1 when it does not, 2 for bad input (a layout that does not divide the
model, too few GPUs). Without overrides: the embedded tiny model at ``cluster.tp=2``.
"""
from __future__ import annotations

import sys
import time

import torch

from clawrl.cluster.layout import check_layout, read_hf_config
from clawrl.config import compose
from clawrl.embedded.build import resolve_model
from clawrl.errors import CliError
from clawrl.trainers.megatron.parity import check_parallel


def check_parallel_cli(args) -> int:
    overrides = list(args.overrides)
    if not any(o.startswith(("cluster.tp=", "cluster.pp=")) for o in overrides):
        overrides.append("cluster.tp=2")
    cfg = compose(overrides)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise CliError("check-parallel needs megatron-core: pip install 'clawrl[megatron]'") from None
    cfg = resolve_model(cfg)
    model_path = cfg.model.path
    tp, pp = cfg.cluster.tp, cfg.cluster.pp
    world = max(cfg.cluster.procs_per_node, tp * pp)
    hf_config, name = read_hf_config(model_path)
    check_layout(hf_config, tp, pp, world, name)  # ConfigError: one line, exit 2
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        raise CliError(f"{world} ranks need {world} GPUs, this machine has {torch.cuda.device_count()}; "
                       "run with CUDA_VISIBLE_DEVICES= to check the layout on CPU (gloo)")
    started = time.perf_counter()
    print(f"clawrl: checking tp={tp} pp={pp} on {world} local ranks against the torch backend ...", flush=True)
    report = check_parallel(cfg, model_path, world)
    for line in report.lines():
        print(line)
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0 if report.ok else 1
