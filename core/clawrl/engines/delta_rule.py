"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), behind one small interface.

Per value head, with a recurrent state ``S`` (``[K, V]``, fp32) and per token a decay ``g`` (log
space, <= 0) and a write strength ``beta`` in (0, 1)::

    S = exp(g) * S
    S = S + k (beta * (v - k^T S))^T      # the delta rule: write only what S does not predict yet
    o = q^T S * K**-0.5

``q`` and ``k`` arrive L2-normalised (callers do it, in fp32, as HF does) and already repeated to
the value heads, so every implementation sees the same numbers and none has to agree with
another on head grouping.

Two implementations, both with per-sequence initial and final states (the engine carries a
request's state across prefill chunks and decode steps; the trainer starts each from zeros):

- ``TorchDeltaRule``: pure torch, runs anywhere. ``chunk`` is the chunked (WY/UT-transform) form,
  a few matmuls per 64 tokens, for prefill and training; ``recurrent`` is the token-by-token
  form, for one decode token of many sequences at once. Same math as HF's reference functions
  (transformers' modeling_qwen3_next), written here so it takes our layout and does not move
  when transformers renames or rewires its functions.
- ``FlaDeltaRule``: flash-linear-attention's Triton kernels (GPU only), which also take many
  sequences of different lengths in one launch (``cu_seqlens``).

``resolve`` picks one: ``auto`` is fla on a CUDA device when it imports, else torch; asking for
``fla`` without it is an error, never a silent fallback.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from clawrl.engines.loading import ModelLoadError

log = logging.getLogger(__name__)

CHOICES = ("auto", "torch", "fla")
CHUNK = 64


class DeltaRuleUnavailable(ModelLoadError):
    """The requested kernels cannot run here; the message says why and how to get them (a
    ModelLoadError: the model cannot be served or trained as configured, one line for the user)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32 L2 normalisation over the last dim, with the epsilon placement of HF and FLA."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class TorchDeltaRule:
    """Pure-torch gated delta rule; see the module docstring. Shapes, one sequence at a time:
    ``q, k [T, H, K]``, ``v [T, H, V]``, ``g, beta [T, H]``, ``state [H, K, V]`` fp32."""

    name = "torch"

    def chunk(self, q, k, v, g, beta, state: torch.Tensor | None):
        """Outputs ``[T, H, V]`` (fp32) and the final state, for one sequence, in chunks of 64."""
        T, H, K = k.shape
        V = v.shape[-1]
        q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T, .]
        g, beta = g.float().t(), beta.float().t()  # [H, T]
        q = q * K ** -0.5
        pad = (CHUNK - T % CHUNK) % CHUNK
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        n = (T + pad) // CHUNK
        kb, vb = k * beta[..., None], v * beta[..., None]
        q, k, kb, vb = (x.reshape(H, n, CHUNK, -1) for x in (q, k, kb, vb))
        cum = g.reshape(H, n, CHUNK).cumsum(-1)  # log decay from the chunk's start, inclusive
        upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
        # the UT transform: (I + strictly-lower(beta k k^T decay))^-1 turns the chunk's sequential
        # delta-rule writes into matmuls (u: the new values, w: the decayed keys reading the old state)
        system = (kb @ k.transpose(-1, -2)) * decay
        # (its diagonal is ignored: unitriangular)
        u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
        intra = ((q @ k.transpose(-1, -2)) * decay)
        S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device) if state is None else state.float()
        qd = q * cum.exp()[..., None]
        kd = k * (cum[..., -1:] - cum).exp()[..., None]
        last = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
        out = torch.empty(H, n, CHUNK, V, dtype=torch.float32, device=q.device)
        for i in range(n):
            v_new = u[:, i] - w[:, i] @ S
            out[:, i] = qd[:, i] @ S + intra[:, i] @ v_new
            S = S * last[:, i] + kd[:, i].transpose(-1, -2) @ v_new
        return out.reshape(H, -1, V)[:, :T].transpose(0, 1), S

    def recurrent(self, q, k, v, g, beta, state: torch.Tensor):
        """One token each of ``B`` sequences: ``q, k [B, H, K]``, ``v [B, H, V]``, ``g, beta
        [B, H]``, ``state [B, H, K, V]``; outputs ``[B, H, V]`` and the new states."""
        K = k.shape[-1]
        q, k, v = q.float() * K ** -0.5, k.float(), v.float()
        S = state.float() * g.float().exp()[..., None, None]
        delta = (v - (S * k[..., None]).sum(-2)) * beta.float()[..., None]
        S = S + k[..., None] * delta[..., None, :]
        return (S * q[..., None]).sum(-2), S

    def varlen(self, q, k, v, g, beta, lens: list[int], states: list[torch.Tensor | None]):
        """Several sequences packed along dim 0 (``lens`` tokens each), each from its own state."""
        outs, finals, off = [], [], 0
        for n, s in zip(lens, states):
            o, f = self.chunk(q[off: off + n], k[off: off + n], v[off: off + n], g[off: off + n],
                              beta[off: off + n], s)
            outs.append(o)
            finals.append(f)
            off += n
        return torch.cat(outs), finals


class FlaDeltaRule(TorchDeltaRule):
    """flash-linear-attention's Triton kernels: one launch for all prefilling sequences
    (``cu_seqlens``, per-sequence initial states) and one for all decoding ones."""

    name = "fla"

    def __init__(self):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self._chunk, self._recurrent = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def chunk(self, q, k, v, g, beta, state):
        o, finals = self.varlen(q, k, v, g, beta, [k.shape[0]], [state])
        return o, finals[0]

    def recurrent(self, q, k, v, g, beta, state):
        K, dt = k.shape[-1], v.dtype  # the kernels take q, k, v, beta in one dtype (the model's)
        o, s = self._recurrent(q[:, None].to(dt).contiguous(), k[:, None].to(dt).contiguous(), v[:, None].contiguous(),
                               g=g[:, None].float().contiguous(), beta=beta[:, None].to(dt).contiguous(),
                               scale=K ** -0.5, initial_state=state.float().contiguous(), output_final_state=True)
        return o[:, 0].float(), s.float()

    def varlen(self, q, k, v, g, beta, lens, states):
        K, H, V, dt = k.shape[-1], k.shape[1], v.shape[-1], v.dtype
        cu_cpu = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
        init = torch.stack([s.float() if s is not None else q.new_zeros(H, K, V, dtype=torch.float32)
                            for s in states])
        o, final = self._chunk(q[None].to(dt).contiguous(), k[None].to(dt).contiguous(), v[None].contiguous(),
                               g[None].float().contiguous(), beta[None].to(dt).contiguous(), scale=K ** -0.5,
                               initial_state=init, output_final_state=True, cu_seqlens=cu_cpu.to(q.device),
                               cu_seqlens_cpu=cu_cpu)
        return o[0].float(), [f.float() for f in final.unbind(0)]


def fla_available() -> str | None:
    """None if flash-linear-attention imports, else why not."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # ImportError, or a Triton/driver problem at import time
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def resolve(choice: str, device: torch.device) -> TorchDeltaRule:
    """The kernels for ``choice`` (auto | torch | fla) on ``device``; see the module docstring."""
    if choice not in CHOICES:
        raise DeltaRuleUnavailable(f"unknown linear-attention kernels '{choice}'; one of {', '.join(CHOICES)}")
    if choice == "torch":
        return TorchDeltaRule()
    missing = fla_available()
    if choice == "fla":
        if device.type != "cuda":
            raise DeltaRuleUnavailable(f"linear-attention kernels 'fla' need a CUDA device, the model is on {device}")
        if missing:
            raise DeltaRuleUnavailable(f"linear-attention kernels 'fla' requested but flash-linear-attention does "
                                       f"not import ({missing}); pip install 'clawrl[fla]'")
        return FlaDeltaRule()
    if device.type == "cuda" and not missing:
        return FlaDeltaRule()
    if device.type == "cuda":
        log.warning("flash-linear-attention does not import (%s): linear-attention layers run the pure-torch "
                    "path, much slower on a GPU; pip install 'clawrl[fla]'", missing)
    return TorchDeltaRule()
