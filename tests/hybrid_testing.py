"""Tiny random-weight hybrid (Gated DeltaNet + gated attention) chat models for the engine and
trainer tests: Qwen3-Next and Qwen3.5 (text) directories written with ``save_pretrained``, sharing
engine_testing's byte-level tokenizer and ChatML template, built in about a second.

Both use every moving part of the real families at toy width: grouped value heads in the
linear-attention layers (more value heads than key heads), partial rotary in the attention layers,
attention output gates, and a layer pattern with linear layers before and after an attention one.
Qwen3-Next can also be built with a small MoE (``moe=True``); ``qwen3_5_moe`` is Qwen3.5's MoE text model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine_testing import build_tokenizer

HYBRID_ARCHS = ("qwen3_next", "qwen3_5")


def hybrid_config(arch: str, vocab_size: int, eos: int | None = None, pad: int | None = None, moe: bool = False,
                  layers: int = 4, hidden: int = 64, max_pos: int = 4096):
    """The tiny config of ``arch``: layers ``linear, linear, linear, full`` repeated (Qwen's 3:1)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    pattern = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_pos,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=[pattern[i % 4] for i in range(layers)],
        eos_token_id=eos, pad_token_id=pad, bos_token_id=None, tie_word_embeddings=False,
    )
    if arch == "qwen3_next":
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                     shared_expert_intermediate_size=hidden, decoder_sparse_step=1) if moe else dict(num_experts=0)
        return Qwen3NextConfig(**common, **extra,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5})
    if arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        common.pop("intermediate_size")
        return Qwen3_5MoeTextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                                    shared_expert_intermediate_size=hidden,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5,
                                                            "mrope_section": [2, 1, 1]})
    raise ValueError(f"unknown hybrid arch {arch}; one of {HYBRID_ARCHS}")


def make_hybrid_dir(out: Path, arch: str = "qwen3_next", seed: int = 0, std: float = 0.25, **kw) -> Path:
    """Write a random-weight ``arch`` hybrid chat model to ``out``.

    Weights are drawn wider than HF's init (as in engine_testing) so greedy decoding has no
    near-ties; ``A_log`` and ``dt_bias`` keep HF's init, since they set the decay rates and
    random ones would make every state forget at once or never."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = hybrid_config(arch, len(tok), eos=tok.convert_tokens_to_ids("<|im_end|>"), pad=tok.pad_token_id, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0.0, std)
            elif "conv1d" in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    return out
