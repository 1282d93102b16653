"""``train.compile``: torch.compile of the elementwise-heavy parts of every decoder layer.

On a GPU, a trained step of a 1-2B model spends about a third of its time outside the matmuls and
attention, in kernels that each make one pass over the activations: an HF RMSNorm is five of them
forward (cast, square, mean, rsqrt, scale) and more backward, and the MLP's ``silu(gate) * up``
another three. Inductor fuses each of these groups into one or two kernels.

Two scopes (``train.compile_scope``), and ``auto`` to pick one:

- ``parts``: each layer's norms and MLP. They see only an activation tensor whose token count is
  marked dynamic, so one compilation serves every step; the first steps pay for it.
- ``layer``: each decoder layer whole, which also fuses rotary, the residual adds and the casts
  around attention. Attention is one operator inside the layer's graph (``clawrl::causal_within``,
  the varlen flash kernels behind it; no graph break), and the packed sequences' bounds reach it as
  a CPU tensor of symbolic size, not a tuple dynamo would guard on by value, so new sample lengths
  compile nothing. On one H200 at the Qwen3-1.7B shape, 8 x 2048 tokens, it was 1.38x the plain HF
  loop against the parts scope's 1.25x, at the same peak memory (BENCHMARKS.md).
- ``auto`` (the default): ``layer`` for an attention-only model; ``parts`` for a hybrid, whose
  linear-attention layers train on HF's pure-torch delta rule where fla's backward is refused: a
  Python loop over chunks that a whole-layer graph would unroll and recompile per sequence length.

The megatron backend (``compile_megatron_layers``) takes the same scopes on megatron-core's local
layer spec. Whole, a ``TransformerLayer`` is one graph too: its core attention (``SdpaCoreAttention``)
calls the same operator, and ``megatron.one_graph`` removes the one other break, so the QKV split,
q/k norms, rotary, attention, residual adds and MLP run as one compiled region.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn.q_norm", "self_attn.k_norm")
MODES = ("off", "on", "auto")
SCOPES = ("auto", "parts", "layer")


# The same parts in megatron-core's local layer spec (its RMSNorms are torch's, its MLP the SwiGLU).
MEGATRON_PARTS = ("input_layernorm", "pre_mlp_layernorm", "mlp", "self_attention.q_layernorm",
                  "self_attention.k_layernorm")


def wanted(mode: str, device: torch.device) -> bool:
    """``auto`` compiles on a GPU only: on CPU the compile time outweighs what fusion saves on the
    small models CPU runs train."""
    if mode not in MODES:
        raise ValueError(f"train.compile must be one of {MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def _resolve_scope(scope: str, hybrid: bool) -> str:
    """``train.compile_scope`` made concrete: ``auto`` is ``layer`` unless the model is a hybrid (the
    module docstring says why)."""
    if scope not in SCOPES:
        raise ValueError(f"train.compile_scope must be one of {SCOPES}, got {scope!r}")
    if scope != "auto":
        return scope
    picked = "parts" if hybrid else "layer"
    log.info("train.compile_scope=auto: %s (%s)", picked, "a hybrid's linear-attention layers would unroll their "
             "chunk loop in a whole-layer graph" if hybrid else "an attention-only model: each layer compiled whole")
    return picked


def compile_layers(model: torch.nn.Module, scope: str = "auto", hybrid: bool = False) -> int:
    """Compile ``PARTS`` of each decoder layer of ``model`` (an HF causal LM, or a peft model around
    one), or each layer whole (``scope="layer"``; ``auto`` picks by ``hybrid``), in place; parameter
    names and the state dict stay as they were. Returns how many modules were compiled: 0, with the
    reason logged, for a model without ``model.layers``."""
    scope = _resolve_scope(scope, hybrid)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        log.info("train.compile: %s has no model.layers; nothing compiled", type(base).__name__)
        return 0
    return _compile(layers, scope, PARTS, "decoder layers")


def compile_megatron_layers(gpt: torch.nn.Module, scope: str = "auto") -> int:
    """``compile_layers`` for a megatron-core ``GPTModel`` of the local layer spec: each layer whole
    (``layer``, and ``auto``: megatron builds no hybrid here) or its norms and MLP (``parts``)."""
    return _compile(gpt.decoder.layers, _resolve_scope(scope, hybrid=False), MEGATRON_PARTS, "megatron layers")


def _compile(layers, scope: str, parts: tuple[str, ...], what: str) -> int:
    """Each of ``layers`` whole (``scope="layer"``), or its ``parts``; how many modules were compiled."""
    if scope == "layer":
        for layer in layers:
            layer.compile(dynamic=True)
        log.info("train.compile: %d %s compiled whole (attention inside their graphs); the first train "
                 "steps compile them", len(layers), what)
        return len(layers)
    count = _compile_parts(layers, parts)
    log.info("train.compile: %d norm and MLP modules of %d %s compiled; the first train steps compile them",
             count, len(layers), what)
    return count


def _compile_parts(layers, names: tuple[str, ...]) -> int:
    count = 0
    for layer in layers:
        for name in names:
            try:
                part = layer.get_submodule(name)
            except AttributeError:  # an architecture without it (no q/k norms, say)
                continue
            part.compile(dynamic=True)
            count += 1
    return count
