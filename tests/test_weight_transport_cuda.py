"""Weight sync through CUDA IPC (skipped without a GPU): a sender process on the same GPU streams
buckets whose payload never leaves the device; the receiver's staged tensors equal the sent ones bit
for bit, push after push (a new group each time), and a bad handle fails in one line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from clawrl.weight_transport import WeightSyncError, _open_ipc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def load_sync():
    """benchmarks/gpu_sync.py as an importable module: its sender runs in a spawned process."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import gpu_sync

    return gpu_sync


def test_ipc_sync_stages_exactly_what_the_other_process_sent():
    sync = load_sync()
    sync.BUCKET_MB = 1  # several buckets, and tensors larger than a bucket that go alone
    shapes = {"embed": (300, 1024), "a": (17, 33), "b": (1024, 1024), "c": (5,)}
    times = sync.cross_process(shapes, "cuda", "ipc", runs=2)  # asserts the checksums itself
    assert len(times) == 2 and all(t > 0 for t in times)


def test_a_malformed_ipc_handle_is_refused_in_one_line():
    with pytest.raises(WeightSyncError, match="malformed CUDA IPC handle"):
        _open_ipc({"device": 0, "handle": "not base64 of a handle"}, 16)
