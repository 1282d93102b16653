"""Decode attention over the static KV arena as a split-K (flash-decoding) Triton kernel.

At decode each sequence has one query token per head, so attention is a pure read of the K/V it
has filled: at 64 streams of about 700 tokens on the Qwen3-1.7B shape that is some 200 MB a
layer, most of a step's bytes. SDPA (and a plain matmul-softmax-matmul) reads the whole padded
width ``W`` of every slot and reaches about half the memory bandwidth on those small shapes. Here:

- each program reads one (sequence, KV head, split) block of positions and only up to that
  sequence's own length, which it reads from the device (``pos``), so a CUDA graph captured for
  width ``W`` still reads only live tokens and needs no mask;
- the query heads that share a KV head (GQA) are one tile, so each K/V byte is read once;
- the positions are split across programs (flash-decoding) so that few sequences still fill the
  GPU, and a second small kernel merges the splits by their log-sum-exp.

``decode_attention`` needs Triton and a CUDA device; ``available()`` says whether it can run
(callers fall back to SDPA). The launch parameters depend only on (batch, width), so a captured
graph replays them as they are.
"""
from __future__ import annotations

import math

import torch

try:  # optional: the GPU images ship Triton; CPU installs run SDPA instead
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_N = 64  # positions per inner step
TARGET_PROGRAMS = 1024  # enough (sequence, head, split) programs to fill an H200's 132 SMs a few times


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def splits_for(batch: int, kv_heads: int, width: int) -> tuple[int, int]:
    """(splits, positions per split) for a batch attending over up to ``width`` positions: enough
    splits that batch x heads x splits programs fill the GPU, each a whole number of blocks."""
    blocks = max(1, -(-width // BLOCK_N))
    splits = max(1, min(blocks, -(-TARGET_PROGRAMS // (batch * kv_heads))))
    chunk = -(-blocks // splits) * BLOCK_N
    return -(-width // chunk), chunk


if triton is not None:
    @triton.jit
    def _split_kernel(Q, K, V, Pos, MidO, MidL, scale,
                      sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                      so_b, so_h, so_s, so_g, sl_b, sl_h, sl_s,
                      CHUNK: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(Pos + b).to(tl.int32) + 1  # positions 0..pos are visible (pos is the new token's)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, length)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        q = tl.load(Q + b * sq_b + h * sq_h + offs_g[:, None] * sq_g + offs_d[None, :], mask=gmask[:, None],
                    other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for n0 in range(0, CHUNK, BLOCK):  # a fixed trip count; blocks past ``end`` load nothing
            offs_n = start + n0 + tl.arange(0, BLOCK)
            nmask = offs_n < end
            k = tl.load(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_n + offs_d[None, :], mask=nmask[:, None],
                        other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [BLOCK_G, BLOCK]
            scores = tl.where(nmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            v = tl.load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_n + offs_d[None, :], mask=nmask[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            denom = denom * alpha + tl.sum(p, 1)
            m = m_new
        live = denom > 0  # a split past the sequence's length read nothing
        out = acc / tl.where(live, denom, 1.0)[:, None]
        lse = tl.where(live, m + tl.log(tl.where(live, denom, 1.0)), float("-inf"))
        tl.store(MidO + b * so_b + h * so_h + s * so_s + offs_g[:, None] * so_g + offs_d[None, :], out,
                 mask=gmask[:, None])
        tl.store(MidL + b * sl_b + h * sl_h + s * sl_s + offs_g, lse, mask=gmask)

    @triton.jit
    def _merge_kernel(MidO, MidL, Out, so_b, so_h, so_s, so_g, sl_b, sl_h, sl_s, st_b, st_h, st_g,
                      SPLITS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for s in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(MidL + b * sl_b + h * sl_h + s * sl_s + offs_g, mask=gmask,
                                      other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)  # padding rows of BLOCK_G only: split 0 always reads
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for s in tl.static_range(SPLITS):
            w = tl.exp(tl.load(MidL + b * sl_b + h * sl_h + s * sl_s + offs_g, mask=gmask, other=float("-inf")) - m)
            o = tl.load(MidO + b * so_b + h * so_h + s * so_s + offs_g[:, None] * so_g + offs_d[None, :],
                        mask=gmask[:, None], other=0.0)
            acc += w[:, None] * o
            total += w
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(Out + b * st_b + h * st_h + offs_g[:, None] * st_g + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=gmask[:, None])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float,
                     width: int) -> torch.Tensor:
    """Attention of one query token per sequence over its own positions ``0..pos[i]``.

    ``q``: ``[b, kv_heads, group, dim]`` (the query heads sharing each KV head); ``k``/``v``:
    ``[b, kv_heads, >= width, dim]`` views of the arena (last dim contiguous); ``pos``: ``[b]``
    on the device, each ``< width``. Returns ``[b, kv_heads, group, dim]`` in ``q``'s dtype."""
    b, hkv, group, dim = q.shape
    if k.shape[:2] != (b, hkv) or k.shape[-1] != dim or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"decode_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)} do not fit")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"decode_attention needs a power-of-two head dim >= 16, got {dim}")
    splits, chunk = splits_for(b, hkv, width)
    block_g = max(16, 1 << math.ceil(math.log2(group)))  # tl.dot wants at least 16 rows
    mid_o = torch.empty(b, hkv, splits, group, dim, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(b, hkv, splits, group, dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _split_kernel[(b, hkv, splits)](
        q, k, v, pos, mid_o, mid_l, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_l.stride(0), mid_l.stride(1), mid_l.stride(2),
        CHUNK=chunk, G=group, BLOCK_G=block_g, D=dim, BLOCK=BLOCK_N,
        # fp32 (the exactness tests' dtype) must not round through TF32; bf16 runs on tensor cores
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    _merge_kernel[(b, hkv)](
        mid_o, mid_l, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_l.stride(0), mid_l.stride(1), mid_l.stride(2), out.stride(0), out.stride(1), out.stride(2),
        SPLITS=splits, G=group, BLOCK_G=block_g, D=dim, num_warps=4)
    return out
