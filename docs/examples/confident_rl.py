"""A new method in one file: Binary RL that trusts praise more than complaints.

Run it with ``clawrl serve method=docs/examples/confident_rl.py:ConfidentRL`` (or any run.sh). It
keeps everything of ``method=rl`` -- the reward judge, the readiness rule, the buffer's advantages --
and changes one thing: tokens of samples with a negative advantage train at half weight, a common
choice when complaints are noisier than praise. tests/test_docs_examples.py trains a step with it.
"""
from clawrl.methods.rl import BinaryRL
from clawrl.trainers.batching import MicroBatch


class ConfidentRL(BinaryRL):
    negative_weight = 0.5

    def advantages(self, batches: list[MicroBatch]) -> dict[str, float]:
        metrics = super().advantages(batches)  # Binary RL's per-token advantages and loss masks
        for mb in batches:
            mb.advantages = mb.advantages.where(mb.advantages >= 0, mb.advantages * self.negative_weight)
        return {**metrics, "negative_weight": self.negative_weight}
