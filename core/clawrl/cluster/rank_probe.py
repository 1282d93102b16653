"""The rank program of ``python -m clawrl.cluster.probe``: who and where each rank is, and one
collective. Apart from the probe's command line, so a rank imports torch and nothing of the model."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


class ClusterProbe:
    """A rank program with no model: who and where each rank is, and one collective on the
    program's own world (NCCL on GPUs, gloo on CPU)."""

    def __init__(self, cfg):
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")

    def info(self) -> list[dict]:
        """Every rank's identity, gathered (the driver sees rank 0's reply only)."""
        me = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
              "node_rank": int(os.environ.get("GROUP_RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "hostname": socket.gethostname(), "pid": os.getpid(), "device": str(self.device)}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
        return everyone

    def all_reduce_check(self) -> int:
        """Sum of all ranks by all-reduce on the program's world; raises unless it is 0+1+...+(n-1)."""
        n = dist.get_world_size()
        total = torch.tensor([float(dist.get_rank())], device=self.device)
        dist.all_reduce(total)
        expected = n * (n - 1) // 2
        if int(total.item()) != expected:
            raise RuntimeError(f"all-reduce of the ranks summed to {total.item():g}, expected {expected}")
        return expected
