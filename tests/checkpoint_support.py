"""Checkpoint fakes shared by the tests of commands that read run directories."""
from __future__ import annotations

import torch


class MegatronShards:
    """What the megatron trainer hands the checkpoint store: rank shards, not HF weights (commands
    that read torch-trainer checkpoints must refuse them in one line)."""

    step = 1

    def state_dict(self) -> dict:
        return {"kind": "megatron", "weights": {"rank0/embedding.weight": torch.zeros(4, 2)}, "optimizer": [],
                "step": 1}
