"""``train.compile``: torch.compile of the elementwise-heavy parts of every decoder layer.

On a GPU, a trained step of a 1-2B model spends about a third of its time outside the matmuls and
attention, in kernels that each make one pass over the activations: an HF RMSNorm is five of them
forward (cast, square, mean, rsqrt, scale) and more backward, and the MLP's ``silu(gate) * up``
another three. Inductor fuses each of these groups into one or two kernels.

Parts, not the whole layer: attention receives the packed sequences' bounds as a Python tuple
(``clawrl.trainers.packed_attention``), which dynamo would guard on by value and recompile for
every new set of sample lengths. The norms and the MLP see only an activation tensor whose token
count is marked dynamic, so one compilation serves every step; the first steps pay for it.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn.q_norm", "self_attn.k_norm")
MODES = ("off", "on", "auto")


def wanted(mode: str, device: torch.device) -> bool:
    """``auto`` compiles on a GPU only: on CPU the compile time outweighs what fusion saves on the
    small models CPU runs train."""
    if mode not in MODES:
        raise ValueError(f"train.compile must be one of {MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def compile_layers(model: torch.nn.Module) -> int:
    """Compile ``PARTS`` of each decoder layer of ``model`` (an HF causal LM, or a peft model around
    one) in place; parameter names and the state dict stay as they were. Returns how many modules
    were compiled: 0, with the reason logged, for a model without ``model.layers``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        log.info("train.compile: %s has no model.layers; nothing compiled", type(base).__name__)
        return 0
    count = 0
    for layer in layers:
        for name in PARTS:
            try:
                part = layer.get_submodule(name)
            except AttributeError:  # an architecture without it (no q/k norms, say)
                continue
            part.compile(dynamic=True)
            count += 1
    log.info("train.compile: %d norm and MLP modules of %d decoder layers compiled; the first train steps "
             "compile them", count, len(layers))
    return count
