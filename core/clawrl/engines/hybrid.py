"""A ragged forward for hybrid linear-attention models: Qwen3-Next and Qwen3.5 (text; dense and MoE).

These interleave Gated DeltaNet layers (a causal depthwise conv, then the gated delta rule: a
fixed-size recurrent state per head instead of a KV cache) with gated full-attention layers
(q/k norms, partial rotary, a sigmoid gate on the output). A request's state is therefore two
things, held in one ``HybridState``: K/V buffers for the attention layers, as in ragged.py, and
per linear layer the conv state (the last ``kernel - 1`` conv inputs) and the recurrent state.

As in ragged.py, the HF module's own submodules supply every weight (norms, projections, conv,
MLP or MoE, rotary, lm_head), so in-place weight updates carry over and a swap between two steps
is atomic; only the per-request state handling and the delta-rule kernels (delta_rule.py) are
ours. Continuous batching: every decoding request's token goes through each linear layer in one
batched recurrent step; prefill chunks run the chunked rule from the request's state and leave
the state at the chunk's end, so chunked prefill equals one-shot prefill.

The prefix cache can only resume a recurrent state where one was saved. A cached entry is a
frozen copy (``HybridForward.cache_view``) whose state sits at its last token, plus snapshots of
the conv and recurrent states taken while its prompt was prefilled, every ``snapshot_tokens``
positions (block boundaries). A new request resumes from the whole entry when it extends that
whole sequence (a chat's next turn over the same history), else from the last snapshot inside the
common prefix (another conversation with the same system prompt and tools), else from nothing.
Snapshots cost memory the prefix cache's token budget does not count: per snapshot, every linear
layer's recurrent state (``heads * K * V`` fp32), which is why they are block-spaced, taken only
during prefill, and only when the prefix cache is on.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from clawrl.engines.delta_rule import TorchDeltaRule, l2norm, resolve
from clawrl.engines.ragged import (BATCH_DECODE_MAX_CONTEXT, RaggedForward, Segment, SeqKV, _DecodePool,
                                   segment_inputs, to_device)

log = logging.getLogger(__name__)

HYBRID_MODEL_TYPES = {"qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"}
# Positions between two state snapshots while a prompt is prefilled (see the module docstring).
SNAPSHOT_TOKENS = 1024
PREFIX_CACHE_NOTE = ("hybrid linear-attention model: the prefix cache resumes a request from a cached sequence "
                     "it extends whole, or from the last state snapshot (every %d prompt tokens) inside the common "
                     "prefix (a recurrent state cannot be cut at an arbitrary token)" % SNAPSHOT_TOKENS)


def text_config(model):
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get() if get is not None else cfg


def is_hybrid(model) -> bool:
    """Whether ``model`` has linear-attention layers (a config with ``linear_attention`` layer types)."""
    types = getattr(text_config(model), "layer_types", None) or []
    return any(t == "linear_attention" for t in types)


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot use ``HybridForward``, or None if it can."""
    cfg = text_config(model)
    if cfg.model_type not in HYBRID_MODEL_TYPES:
        return f"model_type '{cfg.model_type}' has no hybrid ragged forward"
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, attr):
            return f"the model has no model.{attr}"
    for i, layer in enumerate(inner.layers):
        la, at = getattr(layer, "linear_attn", None), getattr(layer, "self_attn", None)
        if la is not None:
            needed = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_k_dim", "head_v_dim", "num_k_heads",
                      "num_v_heads")
            missing = [a for a in needed if not hasattr(la, a)]
            if not (hasattr(la, "in_proj_qkvz") or hasattr(la, "in_proj_qkv")):
                missing.append("in_proj_qkvz/in_proj_qkv")
            if missing:
                return f"linear attention of layer {i} has no {missing[0]}"
        elif at is not None:
            missing = [a for a in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "scaling")
                       if not hasattr(at, a)]
            if missing:
                return f"attention of layer {i} has no {missing[0]}"
        else:
            return f"layer {i} has neither linear_attn nor self_attn"
    return None


class HybridState:
    """One request's state: ``kv`` (a SeqKV over the attention layers only), and per linear layer
    a conv state ``conv [n_linear, conv_dim, kernel-1]`` and a recurrent state ``ssm [n_linear,
    heads, K, V]`` (fp32), both at position ``length``."""

    def __init__(self, kv: SeqKV, conv: torch.Tensor, ssm: torch.Tensor):
        self.kv, self.conv, self.ssm = kv, conv, ssm
        self.length = 0
        # position -> (conv, ssm) as they were there; written once, never changed (shared by copies)
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def ensure(self, needed: int) -> None:
        self.kv.ensure(needed)

    def copy_prefix_from(self, other: "HybridState", n: int) -> None:
        """Start from ``other``'s first ``n`` tokens if its state sits exactly there, else from its
        last snapshot at or before ``n``, else from nothing: ``length`` says how far (the caller
        counts ``length``, not ``n``, as reused)."""
        if n <= 0:
            return
        if n == other.length:
            conv, ssm = other.conv, other.ssm
        else:
            at = max((p for p in other.snapshots if p <= n), default=0)
            if not at:
                return
            n, (conv, ssm) = at, other.snapshots[at]
        self.kv.copy_prefix_from(other.kv, n)
        self.conv.copy_(conv)
        self.ssm.copy_(ssm)
        self.snapshots = {p: snap for p, snap in other.snapshots.items() if p <= n}
        self.length = n

    def frozen(self) -> "HybridState":
        """A copy for the prefix cache: the K/V buffers shared (a live request only appends past
        ``length``, and a grown buffer is a new tensor), conv and recurrent state cloned (they
        change in place with every token)."""
        kv = SeqKV.__new__(SeqKV)
        kv.max_tokens, kv.layers, kv.length = self.kv.max_tokens, list(self.kv.layers), self.length
        out = HybridState(kv, self.conv.clone(), self.ssm.clone())
        out.length = self.length
        out.snapshots = dict(self.snapshots)
        return out


class HybridForward:
    """Runs ``Segment`` lists through an HF hybrid model; see the module docstring."""

    ragged = True

    def __init__(self, model, kernels: str = "auto", snapshot_tokens: int = 0):
        self.model = model
        self.snapshot_tokens = snapshot_tokens  # 0: no snapshots (no prefix cache to use them)
        self.cfg = text_config(model)
        self.inner = model.model
        dev = self.inner.embed_tokens.weight.device
        self.kernels = resolve(kernels, dev)
        self.ref = TorchDeltaRule()
        self.attn_index: dict[int, int] = {}
        self.linear_index: dict[int, int] = {}
        for i, layer in enumerate(self.inner.layers):
            if getattr(layer, "linear_attn", None) is not None:
                self.linear_index[i] = len(self.linear_index)
            else:
                self.attn_index[i] = len(self.attn_index)
        first_attn = next(self.inner.layers[i].self_attn for i in self.attn_index) if self.attn_index else None
        self.head_dim = first_attn.head_dim if first_attn is not None else 0
        self.n_heads = self.cfg.num_attention_heads
        self.kv_heads = self.cfg.num_key_value_heads
        la = next(self.inner.layers[i].linear_attn for i in self.linear_index)
        self.conv_dim = la.conv1d.weight.shape[0]
        self.conv_k = la.conv1d.weight.shape[-1]
        self.hv, self.dk, self.dv = la.num_v_heads, la.head_k_dim, la.head_v_dim
        self.hk = la.num_k_heads
        self._states = _StatePool()  # the decoding requests' conv and recurrent states, batched
        self._kv_pool = _DecodePool()  # their attention K/V, padded (ragged.py's)
        log.info("hybrid forward: %d linear-attention layers (%s kernels), %d attention layers",
                 len(self.linear_index), self.kernels.name, len(self.attn_index))

    def _rope_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """Position ids as this model's rotary module takes them: Qwen3.5's is multimodal (one row
        each for time, height, width; text repeats its position in all three), and transformers
        5.17's version of it takes only that ``[3, batch, n]`` form."""
        if hasattr(self.inner.rotary_emb, "mrope_section"):
            return pos[None, None].expand(3, 1, -1)
        return pos[None]

    def rope_tables(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[n, 1, rotary_dim]`` at positions ``pos``, for ``_rotate``."""
        cos, sin = self.inner.rotary_emb(x[None], self._rope_positions(pos))
        return cos[0][:, None, :], sin[0][:, None, :]

    def gated_qkv(self, attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """A gated attention layer's q ``[n, heads, d]`` and k ``[n, kv_heads, d]`` (normed, then partially
        rotated), v, and the output gate ``[n, heads * d]`` (q_proj makes q and the gate together); the
        layer's output is ``attn.o_proj(attention * sigmoid(gate))``."""
        n, d = h.shape[0], self.head_dim
        q, gate = attn.q_proj(h).view(n, self.n_heads, 2 * d).chunk(2, dim=-1)
        q = attn.q_norm(q)
        k = attn.k_norm(attn.k_proj(h).view(n, self.kv_heads, d))
        v = attn.v_proj(h).view(n, self.kv_heads, d)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v, gate.reshape(n, self.n_heads * d)

    def check_weights(self) -> bool:
        """Nothing is fused: the forward reads the modules' parameters every step."""
        return False

    def sync(self) -> None:
        """Make every request's own state complete (the decode pools advance only themselves)."""
        self._states.sync()
        self._kv_pool.sync()

    def release(self) -> None:
        """Write back and drop the decode pools (nobody is decoding now)."""
        self.sync()
        self._states, self._kv_pool = _StatePool(), _DecodePool()

    def cache_view(self, state: HybridState) -> HybridState:
        return state.frozen()

    def new_kv(self, capacity: int, max_tokens: int) -> HybridState:
        p = self.inner.embed_tokens.weight
        kv = SeqKV(max(1, len(self.attn_index)), self.kv_heads, max(1, self.head_dim), p.dtype, p.device,
                   capacity if self.attn_index else 1, max_tokens if self.attn_index else 1)
        conv = torch.zeros(len(self.linear_index), self.conv_dim, self.conv_k - 1, dtype=p.dtype, device=p.device)
        ssm = torch.zeros(len(self.linear_index), self.hv, self.dk, self.dv, dtype=torch.float32, device=p.device)
        return HybridState(kv, conv, ssm)

    # ------------------------------------------------------------------ the forward

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Fp32 logits ``[sum(len(logit_rows)), vocab]`` in segment order; advances each state."""
        dev = self.inner.embed_tokens.weight.device
        lens, starts, ids, pos = segment_inputs(segments, dev)
        x = self.inner.embed_tokens(ids)
        cos, sin = self.rope_tables(x, pos)
        offs = [0]
        for n in lens[:-1]:
            offs.append(offs[-1] + n)
        states = [s.kv for s in segments]
        # Decoding requests (one token each) run batched against pools that keep their states
        # between steps while the set of decoders is unchanged; a request outside the pools this
        # step reads its own buffers, so the pools are written back first when the set changes.
        decode = [i for i, n in enumerate(lens) if n == 1]
        decode_rows = to_device([offs[i] for i in decode], dev) if decode else None
        self._states = self._states.prepare([states[i] for i in decode])
        padded = [i for i in decode if starts[i] < BATCH_DECODE_MAX_CONTEXT] if len(decode) > 1 else []
        batch = None
        if padded:
            width = max(starts[i] for i in padded) + 1
            pos_b = to_device([starts[i] for i in padded], dev)
            batch = (padded, to_device([offs[i] for i in padded], dev), pos_b, width,
                     (torch.arange(width, device=dev)[None, :] <= pos_b[:, None])[:, None, None, :],
                     self._kv_pool.prepare([states[i].kv for i in padded], [starts[i] for i in padded]))
        else:
            self._kv_pool.sync()
            self._kv_pool = _DecodePool()
        for li, layer in enumerate(self.inner.layers):
            h = layer.input_layernorm(x)
            if li in self.linear_index:
                h = self.linear(li, layer.linear_attn, h, states, starts, lens, offs, decode, decode_rows)
            else:
                h = self.attention(li, layer.self_attn, h, states, starts, lens, offs, cos, sin, batch)
            x = x + h
            x = x + feed_forward(layer.mlp, layer.post_attention_layernorm(x))
        for s, n in zip(segments, lens):
            s.kv.length += n
            s.kv.kv.length = s.kv.length
        rows, off = [], 0
        for s, n in zip(segments, lens):
            rows += [off + r for r in s.logit_rows]
            off += n
        if not rows:
            return x.new_empty(0, self.model.config.get_text_config().vocab_size, dtype=torch.float32)
        return self.model.lm_head(self.inner.norm(x[to_device(rows, dev)])).float()

    def attention(self, li, attn, h, states, starts, lens, offs, cos, sin, batch) -> torch.Tensor:
        """Gated full attention of layer ``li``: short-context decoders in one padded call
        (``batch``), every other request against its own K/V."""
        n_tok, d, hq, hkv = h.shape[0], self.head_dim, self.n_heads, self.kv_heads
        q, k, v, gate = self.gated_qkv(attn, h, cos, sin)
        out = q.new_empty(n_tok, hq * d)
        slot = self.attn_index[li]
        pooled = set()
        if batch is not None:
            members, rows, pos, width, pad_mask, pool = batch
            pooled = set(members)
            kp, vp = pool.layers[slot]
            r = torch.arange(len(members), device=kp.device)
            kp[r, pos] = k[rows]
            vp[r, pos] = v[rows]
            o = F.scaled_dot_product_attention(
                q[rows][:, :, None], kp[:, :width].transpose(1, 2), vp[:, :width].transpose(1, 2),
                attn_mask=pad_mask, scale=attn.scaling, enable_gqa=hkv != hq)
            out[rows] = o.reshape(len(members), -1)
        for i, (st, n, off, state) in enumerate(zip(starts, lens, offs, states)):
            if i in pooled:
                continue
            kb, vb = state.kv.layers[slot]
            kb[st: st + n] = k[off: off + n]
            vb[st: st + n] = v[off: off + n]
            mask = RaggedForward._mask(st, n, h.device, q.dtype)  # a chunk after st: query i sees up to st + i
            o = F.scaled_dot_product_attention(
                q[off: off + n].transpose(0, 1)[None], kb[: st + n].transpose(0, 1)[None],
                vb[: st + n].transpose(0, 1)[None], attn_mask=mask, is_causal=(mask is None and n > 1),
                scale=attn.scaling, enable_gqa=hkv != hq)
            out[off: off + n] = o[0].transpose(0, 1).reshape(n, -1)
        return attn.o_proj(out * torch.sigmoid(gate))

    def _cuts(self, start: int, n: int) -> list[int]:
        """Snapshot positions inside a prefill chunk ``[start, start + n)``'s end, exclusive of start."""
        every = self.snapshot_tokens
        if not every or n < 2:
            return []
        return list(range((start // every + 1) * every, start + n + 1, every))

    def _snapshot(self, state: HybridState, at: int, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        snap = state.snapshots.get(at)
        if snap is None:
            snap = state.snapshots[at] = (torch.empty_like(state.conv), torch.empty_like(state.ssm))
        snap[0][slot].copy_(conv)
        snap[1][slot].copy_(ssm)

    def linear(self, li, la, h, states, starts, lens, offs, decode, rows) -> torch.Tensor:
        """Gated DeltaNet layer ``li``: conv and delta rule from each request's state, states advanced
        (and snapshotted at block boundaries a prefill chunk crosses)."""
        slot = self.linear_index[li]
        km1 = self.conv_k - 1
        mixed, z, b, a = project_linear(la, h)
        conv_out = torch.empty_like(mixed)
        prefill = [i for i, n in enumerate(lens) if n > 1]
        pool = self._states
        if decode:
            y, window = conv_step(la, pool.conv[:, slot], mixed[rows])
            conv_out[rows] = y.to(conv_out.dtype)
            pool.conv[:, slot] = window
        cuts = {i: self._cuts(starts[i], lens[i]) for i in prefill}
        conv_snaps = {}
        for i in prefill:
            off, n, conv = offs[i], lens[i], states[i].conv[slot]
            full = torch.cat([conv, mixed[off: off + n].t().to(conv.dtype)], dim=-1)  # [C, k-1+n]
            conv_out[off: off + n] = F.conv1d(full[None], la.conv1d.weight, la.conv1d.bias,
                                              groups=self.conv_dim)[0].t().to(conv_out.dtype)
            # full's column j holds position start - (k-1) + j: the k-1 inputs before p start at p - start
            conv_snaps[i] = {p: full[:, p - starts[i]: p - starts[i] + km1].clone() for p in cuts[i]}
            conv.copy_(full[:, -km1:])
        q, k, v, g, beta = gates_and_heads(la, F.silu(conv_out), b, a)
        core = q.new_empty(h.shape[0], self.hv, self.dv, dtype=torch.float32)
        if decode:
            o, final = self.kernels.recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows], pool.ssm[:, slot])
            core[rows] = o
            pool.ssm[:, slot] = final
        whole = [i for i in prefill if not cuts[i]]
        if whole:  # one call for every chunk that crosses no snapshot position
            idx = torch.cat([torch.arange(offs[i], offs[i] + lens[i], device=h.device) for i in whole])
            o, finals = self.kernels.varlen(q[idx], k[idx], v[idx], g[idx], beta[idx], [lens[i] for i in whole],
                                            [states[i].ssm[slot] for i in whole])
            core[idx] = o
            for i, f in zip(whole, finals):
                states[i].ssm[slot].copy_(f)
        for i in prefill:  # the others piece by piece, the state carried, a snapshot at each cut
            if not cuts[i]:
                continue
            state, pos = states[i].ssm[slot].clone(), starts[i]
            for end in [*cuts[i], starts[i] + lens[i]]:
                if end == pos:
                    continue
                a, b = offs[i] + pos - starts[i], offs[i] + end - starts[i]
                core[a:b], state = self.kernels.chunk(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
                if end in conv_snaps[i]:
                    self._snapshot(states[i], end, slot, conv_snaps[i][end], state)
                pos = end
            states[i].ssm[slot].copy_(state)
        return gated_output(la, core.to(h.dtype), z)


class _StatePool:
    """The conv ``[B, n_linear, C, k-1]`` and recurrent ``[B, n_linear, H, K, V]`` states of the
    decoding requests, stacked, so each linear layer's decode step is one batched read and write
    instead of one copy per request and layer (on a GPU a kernel launch each). Rebuilt, after writing
    its rows back into the requests' own states, whenever the set of decoders changes or one of them
    went on elsewhere (its length is not where this pool left it: the static decoder advanced it and
    copied its state back); ``sync`` writes back without dropping it, and only what a step advanced
    since, so it never writes stale rows over a state that went on elsewhere."""

    def __init__(self):
        self.members: list[HybridState] = []
        self.lengths: list[int] = []  # each member's length after the pool's last step
        self.conv = self.ssm = None
        self.advanced = False  # a step has advanced the rows since they were last written back

    def prepare(self, states: list[HybridState]) -> "_StatePool":
        """The pool for this step's decoders ``states``, whose rows the step then advances."""
        pool = self
        if not (len(states) == len(self.members) and all(a is b for a, b in zip(states, self.members))
                and [s.length for s in states] == self.lengths):
            self.sync()
            pool = _StatePool()
            if states:
                pool.members = list(states)
                pool.conv = torch.stack([s.conv for s in states])
                pool.ssm = torch.stack([s.ssm for s in states])
        pool.lengths = [s.length + 1 for s in states]
        pool.advanced = bool(states)
        return pool

    def sync(self) -> None:
        if not self.advanced:
            return
        for row, s in enumerate(self.members):
            s.conv.copy_(self.conv[row])
            s.ssm.copy_(self.ssm[row])
        self.advanced = False


# -------------------------------------------------------------------- shared with the trainer

def project_linear(la, h: torch.Tensor):
    """A Gated DeltaNet layer's input projections of ``h [n, hidden]``: the conv input ``mixed
    [n, conv_dim]`` (q, k, v concatenated, in that order), ``z [n, HV, V]``, ``b`` and ``a [n, HV]``.
    Qwen3-Next interleaves q/k/v/z per key head in one projection (HF's fix_query_key_value_ordering
    untangles it); Qwen3.5 has four plain projections."""
    n = h.shape[0]
    if hasattr(la, "in_proj_qkvz"):
        q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(h)[None], la.in_proj_ba(h)[None])
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, la.num_v_heads, la.head_v_dim), b.reshape(n, -1), a.reshape(n, -1)
    return (la.in_proj_qkv(h), la.in_proj_z(h).view(n, la.num_v_heads, la.head_v_dim), la.in_proj_b(h),
            la.in_proj_a(h))


def conv_step(la, window: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv for one new input ``x [B, C]`` per sequence, given each one's last
    ``kernel - 1`` inputs ``window [B, C, kernel-1]``: the conv output ``[B, C]`` (before its SiLU) and
    the window moved on by one. Fixed shapes, no host sync: the static decoder captures it."""
    full = torch.cat([window, x[:, :, None].to(window.dtype)], dim=-1)
    y = (full * la.conv1d.weight[:, 0]).sum(-1)
    if la.conv1d.bias is not None:
        y = y + la.conv1d.bias
    return y, full[:, :, 1:]


def gates_and_heads(la, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
    """From the conv output: L2-normed q, k repeated to the value heads (fp32), v, the log decay
    ``g`` and write strength ``beta``, as the delta rule (delta_rule.py) takes them."""
    n = mixed.shape[0]
    kd = la.num_k_heads * la.head_k_dim
    q, k, v = mixed.split([kd, kd, mixed.shape[-1] - 2 * kd], dim=-1)
    q, k = q.reshape(n, la.num_k_heads, la.head_k_dim), k.reshape(n, la.num_k_heads, la.head_k_dim)
    v = v.reshape(n, la.num_v_heads, la.head_v_dim)
    rep = la.num_v_heads // la.num_k_heads
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    beta = b.sigmoid()
    g = -la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias)
    return l2norm(q), l2norm(k), v, g, beta


def gated_output(la, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated RMSNorm (by ``z``) per value head, then the output projection."""
    n = core.shape[0]
    out = la.norm(core.reshape(-1, la.head_v_dim), z.reshape(-1, la.head_v_dim))
    return la.out_proj(out.reshape(n, -1))


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first ``rotary_dim`` channels only (these models rotate part of each head)."""
    r = cos.shape[-1]
    rot, rest = t[..., :r], t[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def feed_forward(mlp, h: torch.Tensor) -> torch.Tensor:
    """A layer's MLP (dense, or MoE) on ``h [n, hidden]``: the HF blocks take a batch dimension."""
    out = mlp(h[None])
    if isinstance(out, tuple):  # an MoE block that also returns router logits
        out = out[0]
    return out[0]
