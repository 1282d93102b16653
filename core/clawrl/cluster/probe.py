"""Validate a cluster before a long run: start the trainer ranks exactly as ``clawrl serve`` would,
with a tiny program that reports where each rank runs and checks a collective.

    # on every node, with that node's NODE_RANK (see docs/multi_node.md):
    python -m clawrl.cluster.probe [key=value ...]      e.g. cluster.tp=2 model.path=/models/Qwen3-1.7B

The ranks run ``clawrl.cluster.rank_probe.ClusterProbe``. Node 0 prints one line per rank and the
all-reduce result; other nodes run their ranks and exit when node 0 is done. Exit status 0 only if
every rank answered and the all-reduce summed right.
"""
from __future__ import annotations

import argparse
import logging
import sys

from clawrl.cluster.control import ClusterError
from clawrl.cluster.launch import read_node_env, run_worker_node, start_trainer_ranks
from clawrl.cluster.layout import describe_layout
from clawrl.config import ConfigError, compose
from clawrl.embedded.build import resolve_model

PROGRAM = "clawrl.cluster.rank_probe:ClusterProbe"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clawrl.cluster.probe", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides (cluster.*, model.path, run_dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = resolve_model(compose(args.overrides))  # the layout is checked against the model
        node = read_node_env(cfg)
        if not node.is_driver:
            run_worker_node(cfg, PROGRAM)
            print(f"clawrl probe: node {node.node_rank}: ranks {node.ranks.start}..{node.ranks.stop - 1} done")
            return 0
        ranks = start_trainer_ranks(cfg, PROGRAM)
        try:
            ranks.wait_ready()
            print(f"clawrl probe: {describe_layout(cfg.cluster.tp, cfg.cluster.pp, node.world_size, node.nnodes)}")
            for r in ranks.call("info"):
                print(f"clawrl probe: rank {r['rank']}/{r['world_size']} node {r['node_rank']} "
                      f"host {r['hostname']} pid {r['pid']} device {r['device']}")
            print(f"clawrl probe: all-reduce of the ranks = {ranks.call('all_reduce_check')}: ok")
        finally:
            ranks.shutdown()
    except (ConfigError, ClusterError) as e:
        print(f"clawrl probe: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
