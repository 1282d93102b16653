"""A ragged forward pass for Llama-family decoders, reusing the HF module's own submodules.

Continuous batching needs one forward over sequences of different lengths at different
positions: some decode one token, some prefill a chunk of their prompt. HF's forward wants a
rectangular padded batch and one cache object, so instead we walk the HF layers ourselves: the
embedding, norms, projections, MLP, rotary embedding and lm_head are the HF modules (so weight
updates and rope scaling carry over for free); only attention is ours, run per sequence against
that sequence's own KV buffers, while every matmul runs once over all tokens of the step.

Covers Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q_norm/k_norm) without sliding windows;
``unsupported_reason`` says why anything else must take the generic HF path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

log = logging.getLogger(__name__)

RAGGED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
# Decoding sequences shorter than this are attended in one padded batch (see RaggedForward.forward).
BATCH_DECODE_MAX_CONTEXT = 2048


class SeqKV:
    """One sequence's KV cache: per layer a K and a V buffer ``[capacity, kv_heads, head_dim]``.

    Token-major, so a sequence's first ``n`` positions are one contiguous block (cheap to copy
    into a padded batch or out of the prefix cache)

    ``length`` positions are filled. Buffers grow by doubling (bounded by ``max_tokens``), so a
    request pays for what it uses rather than for the whole context window up front.
    """

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype, device,
                 capacity: int, max_tokens: int):
        self.max_tokens = max_tokens
        cap = max(1, min(capacity, max_tokens))
        self.layers = [
            (torch.empty(cap, kv_heads, head_dim, dtype=dtype, device=device),
             torch.empty(cap, kv_heads, head_dim, dtype=dtype, device=device))
            for _ in range(n_layers)
        ]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.layers[0][0].shape[0]

    def ensure(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = max(needed, min(2 * cap, self.max_tokens))
        grown = []
        for k, v in self.layers:
            nk = k.new_empty(new_cap, *k.shape[1:])
            nv = v.new_empty(new_cap, *v.shape[1:])
            nk[: self.length] = k[: self.length]
            nv[: self.length] = v[: self.length]
            grown.append((nk, nv))
        self.layers = grown

    def copy_prefix_from(self, other: "SeqKV", n: int) -> None:
        """Start this (empty) sequence with the first ``n`` positions of ``other``."""
        self.ensure(n)
        for (k, v), (ok, ov) in zip(self.layers, other.layers):
            k[:n] = ok[:n]
            v[:n] = ov[:n]
        self.length = n


@dataclass
class Segment:
    """Tokens of one sequence in one step: ``ids`` go at positions ``kv.length ...``.

    ``logit_rows`` are indices into ``ids`` whose next-token logits the caller needs.
    """

    kv: object
    ids: list[int]
    logit_rows: list[int] = field(default_factory=list)


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot use the ragged path, or None if it can."""
    cfg = model.config
    if cfg.model_type not in RAGGED_MODEL_TYPES:
        return f"model_type '{cfg.model_type}' has no ragged forward"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention layers"
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type == "mistral" and window and window < cfg.max_position_embeddings:
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, attr):
            return f"the model has no model.{attr}"
    attn = inner.layers[0].self_attn
    for attr in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"):
        if not hasattr(attn, attr):
            return f"attention has no {attr}"
    return None


def to_device(values: list, dev: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of ``values`` on ``dev`` without a host sync: a plain ``torch.tensor(...,
    device='cuda')`` waits for the stream after its copy, which would stall the host every step
    instead of letting it queue the step's kernels while the previous ones run."""
    t = torch.tensor(values, dtype=dtype)
    if dev.type == "cpu":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def segment_inputs(segments: list[Segment], dev: torch.device):
    """A step's inputs, the segments end to end: each segment's length and start position, the token
    ids and their positions on ``dev``; each segment's cache is first grown to hold its new tokens."""
    lens = [len(s.ids) for s in segments]
    starts = [s.kv.length for s in segments]
    for s, n in zip(segments, lens):
        s.kv.ensure(s.kv.length + n)
    ids = to_device([t for s in segments for t in s.ids], dev)
    pos = to_device([p for st, n in zip(starts, lens) for p in range(st, st + n)], dev)
    return lens, starts, ids, pos


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """The HF Llama-family RMSNorm (fp32 statistics, weight applied in the input dtype) through
    torch's fused ``rms_norm``: one pass instead of the module's five elementwise ops, which on
    a GPU are separate kernels (over a 15k-token prefill, each a full pass over the activations)."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        return module(x)
    # computed in fp32 and rounded once to x's dtype, as the module does before applying its weight
    return module.weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


class _Fused:
    """One layer's fused weights: views of these are the module parameters themselves."""

    def __init__(self, qkv_w, qkv_b, gate_up_w):
        self.qkv_w, self.qkv_b, self.gate_up_w = qkv_w, qkv_b, gate_up_w


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Concatenate ``params`` (along dim 0) into one new tensor and make each parameter a view of
    it, so the fused tensor and the parameters share storage: a weight update copied into the
    parameters (in place) is what the fused matmul reads, with no second copy to keep in sync."""
    fused = torch.cat([p.detach() for p in params])
    for p, view in zip(params, fused.split([p.shape[0] for p in params])):
        p.data = view
    return fused


def fuse_weights(runner: RaggedForward) -> list[_Fused]:
    """Per layer: q/k/v (and their biases) as one weight, gate/up as one (Llama-family MLPs)."""
    out = []
    with torch.no_grad():
        for layer in runner.inner.layers:
            a = layer.self_attn
            qkv_w = _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            qkv_b = _fuse(biases) if all(bias is not None for bias in biases) else None
            if any(bias is not None for bias in biases) and qkv_b is None:
                raise ValueError("q/k/v projections with and without bias")
            mlp = layer.mlp
            gate_up = None
            if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) \
                    and mlp.gate_proj.bias is None and mlp.up_proj.bias is None:
                gate_up = _fuse([mlp.gate_proj.weight, mlp.up_proj.weight])
            out.append(_Fused(qkv_w, qkv_b, gate_up))
    return out


def fused_intact(runner: RaggedForward, fused: list[_Fused]) -> bool:
    """Whether every parameter is still a view of its fused tensor (something that replaces a
    parameter's storage, instead of copying into it, breaks that)."""
    for layer, f in zip(runner.inner.layers, fused):
        a = layer.self_attn
        if a.q_proj.weight.data_ptr() != f.qkv_w.data_ptr():
            return False
        if f.gate_up_w is not None and layer.mlp.gate_proj.weight.data_ptr() != f.gate_up_w.data_ptr():
            return False
    return True


class RaggedForward:
    """Runs ``Segment`` lists through an HF Llama-family model; see the module docstring."""

    ragged = True  # many segments per step

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.inner = model.model
        self.n_layers = cfg.num_hidden_layers
        attn = self.inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.qk_norm = hasattr(attn, "q_norm")
        eps = [getattr(getattr(attn, n, None), "variance_epsilon", None) for n in ("q_norm", "k_norm")]
        self.qk_eps = eps[0] if eps[0] is not None and eps[0] == eps[1] else None  # None: the modules' own
        self.scaling = attn.scaling
        self._pool = _DecodePool()
        self.fused = fuse_weights(self)

    def check_weights(self) -> bool:
        """After a weight update: if a parameter no longer shares storage with its fused tensor
        (something replaced it instead of copying into it), fuse again. True if it did."""
        if fused_intact(self, self.fused):
            return False
        log.warning("a parameter's storage was replaced: fusing the weights again")
        self.fused = fuse_weights(self)
        return True

    def rope_tables(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and a signed ``sin`` ``[n, 1, head_dim]`` for ``qkv``: rotate_half(t) * sin equals
        roll(t, half) * [-sin_1, sin_2], one kernel (roll) where rotate_half takes two (neg, cat)."""
        cos, sin = self.inner.rotary_emb(x[None], pos[None])
        half = self.head_dim // 2
        sin = torch.cat((-sin[0][:, :half], sin[0][:, half:]), dim=-1)
        return cos[0][:, None, :], sin[:, None, :]

    def qkv(self, li: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer ``li``'s rotated q ``[n, heads, d]``, k and v ``[n, kv_heads, d]`` from normed ``h``:
        one matmul for all three, q and k normalised and rotated together (same values as the HF
        modules, in fewer kernels: at decode the kernel count, not the bytes, sets the step time)."""
        f, attn = self.fused[li], self.inner.layers[li].self_attn
        hq, hkv, d = self.n_heads, self.kv_heads, self.head_dim
        n = h.shape[0]
        qkv = F.linear(h, f.qkv_w, f.qkv_b)
        qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
        if self.qk_norm and self.qk_eps is not None:
            qk = F.rms_norm(qk, (d,), eps=self.qk_eps) * torch.cat(
                (attn.q_norm.weight.expand(hq, d), attn.k_norm.weight.expand(hkv, d)))
        elif self.qk_norm:
            qk = torch.cat((attn.q_norm(qk[:, :hq]), attn.k_norm(qk[:, hq:])), dim=1)
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
        return qk[:, :hq], qk[:, hq:], v

    def mlp(self, li: int, h: torch.Tensor) -> torch.Tensor:
        f, mlp = self.fused[li], self.inner.layers[li].mlp
        if f.gate_up_w is None:
            return mlp(h)
        gate, up = F.linear(h, f.gate_up_w).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def sync(self) -> None:
        """Make every sequence's own KV buffers complete (the decode batch appends only to itself)."""
        self._pool.sync()

    def release(self) -> None:
        """Write back and drop the padded decode batch (no batched decoders now)."""
        self._pool.sync()
        self._pool = _DecodePool()

    def new_kv(self, capacity: int, max_tokens: int) -> SeqKV:
        p = self.inner.embed_tokens.weight
        return SeqKV(self.n_layers, self.kv_heads, self.head_dim, p.dtype, p.device, capacity, max_tokens)

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Fp32 logits ``[sum(len(logit_rows)), vocab]`` in segment order; fills each KV."""
        dev = self.inner.embed_tokens.weight.device
        lens, starts, ids, pos = segment_inputs(segments, dev)
        x = self.inner.embed_tokens(ids)
        cos, sin = self.rope_tables(x, pos)
        total = ids.shape[0]
        offs = [0]
        for n in lens[:-1]:
            offs.append(offs[-1] + n)
        # Decoding sequences with short contexts share one padded attention call: copying their KV
        # into a padded batch is cheaper than a Python-level call each. Long ones go one by one.
        batched = [i for i, (st, n) in enumerate(zip(starts, lens)) if n == 1 and st < BATCH_DECODE_MAX_CONTEXT]
        if len(batched) < 2:
            batched = []
        in_batch = set(batched)
        single = [i for i in range(len(segments)) if i not in in_batch]
        masks = {i: self._mask(starts[i], lens[i], dev, x.dtype) for i in single}
        if batched:
            rows_b = to_device([offs[i] for i in batched], dev)
            pos_b = to_device([starts[i] for i in batched], dev)
            width = max(starts[i] for i in batched) + 1
            pad_mask = (torch.arange(width, device=dev)[None, :] <= pos_b[:, None])[:, None, None, :]
            pool = self._pool.prepare([segments[i].kv for i in batched], [starts[i] for i in batched])
        else:
            self.release()
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            h = rms_norm(layer.input_layernorm, x)
            q, k, v = self.qkv(li, h, cos, sin)
            out = q.new_empty(total, self.n_heads * self.head_dim)
            for i in single:
                seg, st, n, off = segments[i], starts[i], lens[i], offs[i]
                kb, vb = seg.kv.layers[li]
                kb[st: st + n] = k[off: off + n]
                vb[st: st + n] = v[off: off + n]
                o = F.scaled_dot_product_attention(
                    q[off: off + n].transpose(0, 1)[None], kb[: st + n].transpose(0, 1)[None],
                    vb[: st + n].transpose(0, 1)[None],
                    attn_mask=masks[i], is_causal=(masks[i] is None and n > 1), scale=self.scaling,
                    enable_gqa=self.kv_heads != self.n_heads,
                )
                out[off: off + n] = o[0].transpose(0, 1).reshape(n, -1)
            if batched:
                out[rows_b] = self._batched_decode(li, q[rows_b], k[rows_b], v[rows_b], pool, pos_b, width, pad_mask)
            x = x + attn.o_proj(out)
            x = x + self.mlp(li, rms_norm(layer.post_attention_layernorm, x))
        for s, n in zip(segments, lens):
            s.kv.length += n
        rows, off = [], 0
        for s, n in zip(segments, lens):
            rows += [off + r for r in s.logit_rows]
            off += n
        if not rows:
            return x.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        hidden = rms_norm(self.inner.norm, x[to_device(rows, dev)])
        return self.model.lm_head(hidden).float()

    def _batched_decode(self, li, q, k, v, pool, pos, width, pad_mask) -> torch.Tensor:
        """One query per sequence against its KV, all sequences in one padded SDPA call."""
        kp, vp = pool.layers[li]
        rows = torch.arange(q.shape[0], device=kp.device)
        kp[rows, pos] = k
        vp[rows, pos] = v
        o = F.scaled_dot_product_attention(
            q[:, :, None], kp[:, :width].transpose(1, 2), vp[:, :width].transpose(1, 2), attn_mask=pad_mask,
            scale=self.scaling, enable_gqa=self.kv_heads != self.n_heads)
        return o.reshape(q.shape[0], -1)

    @staticmethod
    def _mask(start: int, n: int, dev, dtype) -> torch.Tensor | None:
        """Causal mask for a chunk at offset ``start``; None when SDPA's own flags suffice."""
        if n == 1 or start == 0:
            return None  # one query sees everything; a chunk from 0 is plain causal
        if dev.type == "cuda":  # lets SDPA pick its flash kernel instead of a dense mask
            return causal_lower_right(n, start + n)
        # On CPU an additive float mask runs about 1.5x faster than the same mask as booleans.
        # Query i sits at position start + i and sees keys up to there: -inf strictly above that.
        return torch.full((n, start + n), float("-inf"), dtype=dtype, device=dev).triu_(start + 1)


class _DecodePool:
    """The padded ``[batch, capacity, kv_heads, head_dim]`` KV of the batched decoders.

    While the set of decoding sequences is unchanged, each step appends one position per
    sequence here, one op per layer, instead of re-padding every sequence's whole KV or writing
    each sequence's buffers separately (a kernel launch each on a GPU). Positions appended here
    are written back to the sequences' own buffers (``sync``) before anything else reads those:
    when the batch changes, and when the engine caches or retires a sequence. The batch is
    rebuilt when a sequence joins or leaves, which in steady decoding is rare.
    """

    def __init__(self):
        self.members: list = []
        self.lengths: list[int] = []  # positions held here, per member
        self.synced: list[int] = []  # positions already in the member's own buffers
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def prepare(self, kvs: list, starts: list[int]) -> "_DecodePool":
        capacity = self.layers[0][0].shape[1] if self.layers else 0
        reusable = (len(kvs) == len(self.members) and all(a is b for a, b in zip(kvs, self.members))
                    and starts == self.lengths and max(starts) < capacity)
        if not reusable:
            self.sync()
            self._rebuild(kvs, starts)
        self.lengths = [st + 1 for st in starts]  # after this step's append
        return self

    def sync(self) -> None:
        for row, kv in enumerate(self.members):
            end = min(self.lengths[row], kv.length)  # a failed step appended nothing valid
            start = self.synced[row]
            if end <= start:
                continue
            for (k, v), (kp, vp) in zip(kv.layers, self.layers):
                k[start:end] = kp[row, start:end]
                v[start:end] = vp[row, start:end]
            self.synced[row] = end

    def _rebuild(self, kvs: list, starts: list[int]) -> None:
        capacity = 64
        while capacity <= max(starts) + 16:  # headroom: appends for a while before growing
            capacity *= 2
        self.members = list(kvs)
        self.synced = list(starts)
        self.layers = []
        for li in range(len(kvs[0].layers)):
            k0 = kvs[0].layers[li][0]
            # zeros, not empty: padded positions are masked, but NaN garbage would still poison
            # the attention-weighted sum (0 * NaN)
            kp = k0.new_zeros(len(kvs), capacity, *k0.shape[1:])
            vp = k0.new_zeros(len(kvs), capacity, *k0.shape[1:])
            for row, (kv, st) in enumerate(zip(kvs, starts)):
                kp[row, :st] = kv.layers[li][0][:st]
                vp[row, :st] = kv.layers[li][1][:st]
            self.layers.append((kp, vp))
