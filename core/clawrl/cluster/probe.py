"""Validate a cluster before a long run: start the trainer ranks exactly as ``clawrl serve`` would,
with a tiny program that reports where each rank runs and checks a collective.

    # on every node, with that node's NODE_RANK (see docs/multi_node.md):
    python -m clawrl.cluster.probe [key=value ...]      e.g. cluster.tp=2 model.path=/models/Qwen3-1.7B

Node 0 prints one line per rank and the all-reduce result; other nodes run their ranks and exit
when node 0 is done. Exit status 0 only if every rank answered and the all-reduce summed right.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

PROGRAM = "clawrl.cluster.probe:ClusterProbe"


class ClusterProbe:
    """A rank program with no model: who and where each rank is, and one collective on the
    program's own world (NCCL on GPUs, gloo on CPU)."""

    def __init__(self, cfg):
        import torch
        import torch.distributed as dist

        self.dist = dist
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")

    def info(self) -> list[dict]:
        """Every rank's identity, gathered (the driver sees rank 0's reply only)."""
        me = {"rank": self.dist.get_rank(), "world_size": self.dist.get_world_size(),
              "node_rank": int(os.environ.get("GROUP_RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "hostname": socket.gethostname(), "pid": os.getpid(), "device": str(self.device)}
        everyone = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(everyone, me)
        return everyone

    def all_reduce_check(self) -> int:
        """Sum of all ranks by all-reduce on the program's world; raises unless it is 0+1+...+(n-1)."""
        import torch

        n = self.dist.get_world_size()
        total = torch.tensor([float(self.dist.get_rank())], device=self.device)
        self.dist.all_reduce(total)
        expected = n * (n - 1) // 2
        if int(total.item()) != expected:
            raise RuntimeError(f"all-reduce of the ranks summed to {total.item():g}, expected {expected}")
        return expected


def main(argv: list[str] | None = None) -> int:
    import logging

    from clawrl.cluster.control import ClusterError
    from clawrl.cluster.launch import read_node_env, run_worker_node, start_trainer_ranks
    from clawrl.cluster.layout import describe_layout
    from clawrl.config import ConfigError, compose

    p = argparse.ArgumentParser(prog="python -m clawrl.cluster.probe", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides (cluster.*, model.path, run_dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = compose(args.overrides)
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
