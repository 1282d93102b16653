"""Which delta-rule kernels a hybrid model's linear-attention layers train with.

The torch trainer runs HF's own Gated DeltaNet layers (Qwen3-Next, Qwen3.5). transformers binds
them to flash-linear-attention when its modeling module is imported, whenever fla imports, with no
switch per model or per call. Two cases need its pure-torch delta rule instead:

- ``model.linear_attention=torch``;
- fla refuses its own gated chunk backward on this GPU. fla 0.6 raises in ``chunk_bwd_dqkwg`` with
  Triton >= 3.4 and < 3.7.1 on Hopper (H100, H200), whose gradients it found wrong (fla issue
  #640). On the H200 image (torch 2.11, Triton 3.6) that was a crash at the first backward of the
  first step, after the forward had run fine.

``torch_kernels(kernel_bindings(model))`` rebinds the kernel functions of the model's modeling
module to the undecorated torch functions they wrap while its block runs. The trainer holds it over
a whole train step, backward included: with ``train.gradient_checkpointing`` the backward runs each
layer's forward again, and a recomputation on fla's kernels saves other tensors than the forward
did (torch's checkpoint refuses that; an H100 run found it). Blocks nest (the outermost binds and
restores). The rebinding is module-wide while it lasts: the engine's own hybrid forward
(``clawrl.engines.hybrid``) never calls these functions, so serving beside training is unaffected.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading

import torch

from clawrl.engines.delta_rule import DeltaRuleUnavailable, resolve

log = logging.getLogger(__name__)

# The module-level names HF's Gated DeltaNet forward calls (transformers 5.17-5.24).
KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def fla_backward_refusal() -> str | None:
    """Why fla will refuse the gated chunk backward on this process's GPU, or None. Read from the
    flags fla's own check uses, so a fixed fla or Triton ends the refusal here too."""
    try:
        import triton
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except Exception:  # fla or Triton does not import: resolve() has said so already
        return None
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        return (f"flash-linear-attention refuses its gated chunk backward with Triton {triton.__version__} on "
                f"Hopper GPUs (fla issue #640: wrong gradients); it needs Triton >= 3.7.1 or tilelang")
    return None


def training_kernels(choice: str, device: torch.device) -> str:
    """``fla`` or ``torch``: the kernels HF's linear-attention layers train with for
    ``model.linear_attention=choice``. ``fla`` that cannot train here is an error; ``auto`` falls
    back to torch with the reason logged."""
    if choice == "torch" or resolve(choice, device).name != "fla":
        return "torch"
    refusal = fla_backward_refusal()
    if refusal is None:
        return "fla"
    if choice == "fla":
        raise DeltaRuleUnavailable(f"model.linear_attention=fla cannot train here: {refusal}")
    log.warning("training the linear-attention layers on HF's pure-torch delta rule (slower; serving keeps fla): "
                "%s", refusal)
    return "torch"


def kernel_bindings(model: torch.nn.Module) -> list[tuple[object, str, object]]:
    """(module, name, HF's function) for each kernel function of the modules that define ``model``'s
    linear-attention layers, found once so that each forward only rebinds them."""
    names = {type(m).__module__ for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "dt_bias")}
    return [(mod, name, getattr(mod, name)) for mod in (sys.modules[n] for n in sorted(names))
            for name in KERNEL_FUNCTIONS if hasattr(mod, name)]


_held = threading.local()  # how deep in torch_kernels blocks this thread is


@contextlib.contextmanager
def torch_kernels(bindings: list[tuple[object, str, object]]):
    """Run the HF linear-attention layers of ``bindings`` (``kernel_bindings``) on their pure-torch
    delta rule inside the block; an inner block changes nothing, so an exit cannot undo an outer one."""
    depth = getattr(_held, "depth", 0)
    _held.depth = depth + 1
    try:
        if depth == 0:
            for mod, name, fn in bindings:
                setattr(mod, name, inspect.unwrap(fn))
        yield
    finally:
        _held.depth = depth
        if depth == 0:
            for mod, name, fn in bindings:
                setattr(mod, name, fn)
