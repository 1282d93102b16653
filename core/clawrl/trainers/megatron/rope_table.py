"""The rotary embedding's cos and sin, computed once per forward for megatron's attention.

Without transformer-engine, megatron rotates queries and keys with
``rope_utils._apply_rotary_pos_emb_bshd``, which takes the frequencies and computes their cos and
sin inside each rotation: compiled, every layer runs three kernels (queries and keys forward, their
gradient) that evaluate both functions once per head and element, 12 ms of an H200 train step at
8 x 2048 tokens for the 1.7B shape, where the HF layer reads a table computed once per forward.
``table`` stacks that cos and sin once; ``install`` wraps the ``apply_rotary_pos_emb`` that
megatron's attention calls so that a table (a 5-dimensional tensor, never a frequency tensor) is
applied by megatron's own formula, with its rounding: cos and sin taken in float32, scaled, then
cast to the activations' dtype. Any other call goes to megatron's function unchanged.
"""
from __future__ import annotations

import torch


def usable(config) -> bool:
    """Whether the table covers this model's rotation: megatron's plain (unfused, not interleaved,
    not multi-latent) form is the one it reproduces."""
    return not (getattr(config, "apply_rope_fusion", False) or getattr(config, "rotary_interleaved", False)
                or getattr(config, "multi_latent_attention", False) or getattr(config, "mrope_section", None))


def table(freqs: torch.Tensor) -> torch.Tensor:
    """``[2, L, 1, 1, d]``: cos and sin of megatron's ``[L, 1, 1, d]`` float32 frequencies."""
    return torch.stack((torch.cos(freqs), torch.sin(freqs)))


def _rotate(t: torch.Tensor, cos_sin: torch.Tensor, mscale: float) -> torch.Tensor:
    cos, sin = (cos_sin[0] * mscale).to(t.dtype), (cos_sin[1] * mscale).to(t.dtype)
    rot = cos.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    first, second = torch.chunk(t, 2, dim=-1)
    return torch.cat(((t * cos) + (torch.cat((-second, first), dim=-1) * sin), rest), dim=-1)


def install() -> None:
    """Wrap megatron's attention's ``apply_rotary_pos_emb`` (once; later calls find it wrapped)."""
    from megatron.core.transformer import attention

    megatrons = attention.apply_rotary_pos_emb
    if getattr(megatrons, "takes_cos_sin_table", False):
        return

    def apply_rotary_pos_emb(t, freqs, config=None, cu_seqlens=None, mscale=1.0, *args, **kwargs):
        if freqs.dim() == 5:  # table(): the layer's rotation without recomputing cos and sin
            return _rotate(t, freqs, mscale)
        return megatrons(t, freqs, config, cu_seqlens, mscale, *args, **kwargs)

    apply_rotary_pos_emb.takes_cos_sin_table = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
