"""What megatron-core 0.16-0.19 needs to run on CPU with gloo. Installed only without CUDA.

megatron-core assumes a GPU in three places that matter for training small models on CPU:

- ``torch.cuda.current_device()`` is used as a device argument (rotary frequencies, buffers);
  without CUDA it raises. On CPU it answers ``"cpu"``, a valid device for ``.to(device=...)``.
- The CUDA RNG tracker (``tensor_parallel.random``) forks CUDA generator states around dropout in
  tensor-parallel regions. On CPU the tracker forks named CPU generator states instead.
- ``model_parallel_cuda_manual_seed`` seeds CUDA generators. ``seed_cpu`` seeds the CPU generator
  and registers the model-parallel state the way megatron does (seed + 2718 + tp rank).
- The optimizers and DDP create small bookkeeping tensors with ``device="cuda"`` (overflow flags,
  norms) and call ``.cuda()`` on others. In a process without CUDA, the only possible meaning is the
  CPU, so tensor factories and ``Tensor.cuda`` map a CUDA device to the CPU.
- Activation recomputation saves and restores CUDA generator states around each recomputed
  layer; on CPU those are the CPU generator's.
- Pipeline sends call ``torch.cuda.synchronize()`` around shape exchanges; on CPU, gloo's
  blocking ops are already synchronous, so it is a no-op.
- The distributed optimizer accepts parameters by their type name (``torch.cuda.FloatTensor``);
  ``Tensor.type()`` without arguments answers the CUDA name for CPU tensors.

Everything is patched in this one module so the workarounds are easy to find and to drop.
"""
from __future__ import annotations

import contextlib

import torch

_MODEL_PARALLEL_RNG = "model-parallel-rng"  # megatron's tracker name for the TP-region generator
_installed = False


class CpuRNGStatesTracker:
    """megatron's ``CudaRNGStatesTracker`` surface (add, fork, get/set_states, reset) over CPU states."""

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        generator = torch.Generator().manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda") or isinstance(device, int)


def _on_cpu(factory):
    def wrapped(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    wrapped.__wrapped__ = factory
    return wrapped


def install() -> None:
    """Patch megatron-core for CPU. A no-op with CUDA, and idempotent."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # only in trainer-rank processes, which have no CUDA
    for name in ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "arange"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.synchronize = lambda *args, **kwargs: None
    plain_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _installed = True


def seed_cpu(seed: int, tp_rank: int) -> None:
    """CPU stand-in for ``model_parallel_cuda_manual_seed``: same seeds, CPU generators."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(_MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
