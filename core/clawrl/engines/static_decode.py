"""Decode steps over preallocated per-slot state, replayed as CUDA graphs on a GPU.

On a GPU the ragged forward is host-bound at decode: a step of a 28-layer model launches about
two thousand small kernels, and each launch costs more host time than the kernel takes on the
device. Here every decoding sequence owns one slot of a static state arena that is allocated once
and updated in place, so the tensors a decode step touches never move, and the whole step --
embedding, every layer, the state updates, attention, the final norm and the fp32 logits -- is
captured once as a CUDA graph and then replayed with one launch.

What a slot holds and how the layers run is the model's ``*Step`` (its arena and its layer loop);
the slots, buckets, graphs and sampling are ``StaticDecoder``'s, the same for every model:

- ``AttentionStep`` (Llama-family models, ``RaggedForward``): a K/V arena
  ``[layers, 2, slots, kv_heads, capacity, head_dim]``; each step writes the new K/V at each row's
  position before attention reads it.
- ``HybridStep`` (Qwen3-Next, Qwen3.5: ``HybridForward``): a K/V arena for the full-attention
  layers only, and per linear-attention layer each slot's conv window ``[conv_dim, kernel-1]`` and
  recurrent state ``[heads, K, V]`` (fp32), which the single-token conv and delta-rule step advance
  in place with fixed-shape ops (hybrid.py's and delta_rule.py's math).

Graphs are captured lazily per (batch bucket, attention-width bucket): a batch of ``n`` sequences
runs the graph of the smallest bucket ``>= n`` (padding rows write only into free slots), and
attention reads the first ``W`` positions of each slot, ``W`` the longest context rounded up, so
the bytes read grow with the contexts actually in the batch rather than with ``capacity``.
Slots are kept dense: when a sequence leaves, the last one moves into its hole.

The graphs read the model's parameters where they are, so a weight update must copy new values
into the same storage (``TorchEngine`` does), which it does between steps; ``check_weights`` drops
the graphs if a parameter moved anyway. On CPU (and with ``graphs=False``) the same step runs
eagerly; tests use that to check it against the ragged path.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import clawrl.engines.decode_attention as decode_attention
from clawrl.engines.base import SamplingParams
from clawrl.engines.hybrid import (
    HybridForward, HybridState, conv_step, feed_forward, gated_output, gates_and_heads, project_linear, text_config,
)
from clawrl.engines.ragged import RaggedForward, SeqKV, rms_norm, to_device
from clawrl.engines.sampling import draw, draw_options, pack

log = logging.getLogger(__name__)

# What the decode step's attention can run through (engine.decode_attention).
ATTENTIONS = ("sdpa", "triton")
# Fraction of the free device memory the arena may take when no capacity is given.
ARENA_MEMORY_FRACTION = 0.3


def batch_buckets(slots: int) -> list[int]:
    """Batch sizes that get their own graph: 1, 2, 4, 8, then multiples of 8, and ``slots``."""
    sizes = [b for b in (1, 2, 4) if b < slots] + list(range(8, slots, 8)) + [slots]
    return sorted(set(sizes))


def width_bucket(needed: int, capacity: int) -> int:
    """Attention width for contexts up to ``needed`` tokens: rounded up to a multiple of a step that
    is an eighth of the next power of two (at least 128), so a few graphs cover each doubling and
    at most about an eighth of the KV read (attention's bytes, most of a step's at 64 streams) is
    padding."""
    p = 1 << max(needed - 1, 1).bit_length()
    step = max(128, p // 8)
    return min(capacity, -(-needed // step) * step)


def default_capacity(runner: RaggedForward | HybridForward, slots: int, max_context: int) -> int:
    """Tokens per slot that fit in ``ARENA_MEMORY_FRACTION`` of free device memory beside the slots'
    fixed state, at most ``max_context``, rounded down to a multiple of 256 (0: not worth an arena)."""
    p = runner.inner.embed_tokens.weight
    per_token, per_slot = step_type(runner).footprint(runner)
    free, _ = torch.cuda.mem_get_info(p.device)
    cap = min(max_context, (int(free * ARENA_MEMORY_FRACTION) - slots * per_slot) // max(slots * per_token, 1))
    return max(cap, 0) // 256 * 256


def step_type(runner: RaggedForward | HybridForward) -> type:
    """The decode step (arena and layer loop) for the model ``runner`` runs."""
    return HybridStep if isinstance(runner, HybridForward) else AttentionStep


class StaticDecoder:
    """See the module docstring. ``owner`` objects (the engine's requests) are opaque here."""

    def __init__(self, runner: RaggedForward | HybridForward, slots: int, capacity: int, graphs: bool | None = None,
                 attention: str = "sdpa"):
        if slots < 1 or capacity < 1:
            raise ValueError(f"a static decoder needs slots >= 1 and capacity >= 1, got {slots} and {capacity}")
        self.runner = runner
        p = runner.inner.embed_tokens.weight
        self.device = p.device
        self.slots, self.capacity = slots, capacity
        self.graphs = p.device.type == "cuda" if graphs is None else graphs
        if self.graphs and p.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        # "sdpa": a masked SDPA over the width (bf16 logprobs bit-match HF's forward on the tested
        # models); "triton": the split-K kernel of decode_attention, which reads only each slot's
        # live positions (CUDA with Triton; elsewhere sdpa runs instead, with a warning)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'triton' or 'sdpa', got {attention!r}")
        if attention == "triton" and not decode_attention.available(p.device):
            log.warning("decode_attention=triton needs Triton and a CUDA device; using sdpa")
            attention = "sdpa"
        self.attention = attention
        self.vocab = int(text_config(runner.model).vocab_size)
        self.model_step = step_type(runner)(runner, slots, capacity, attention)
        # Per-slot state on the device, so that consecutive steps need nothing from the host: the
        # next input token (written by the previous step's sampling), its position, and what
        # sampling needs (seed, tokens drawn so far, top-k; temperature, top-p).
        self.state_i = torch.zeros(5, slots, dtype=torch.long, device=p.device)
        self.state_f = torch.zeros(2, slots, dtype=torch.float32, device=p.device)
        self.ids, self.pos, self.seeds, self.counters, self.top_k = self.state_i
        self.temps, self.top_p = self.state_f
        self.rows = torch.arange(slots, device=p.device)
        self.logits = torch.empty(slots, self.vocab, dtype=torch.float32, device=p.device)
        self.members: list = []  # slot -> owner
        self.lengths: list[int] = []  # slot -> positions filled (counting steps launched)
        self.params: list[SamplingParams] = []  # slot -> its sampling params
        self._slot_of: dict[int, int] = {}  # id(owner) -> slot
        self._buckets = batch_buckets(slots)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._addresses = self._parameter_addresses()
        self.captures = 0

    def _parameter_addresses(self) -> list[int]:
        return [t.data_ptr() for t in self.runner.model.parameters()]

    def check_weights(self) -> None:
        """After a weight update: drop the graphs, which captured the old addresses, if a parameter
        moved (the runner fused its weights again, or an update replaced a parameter's storage
        instead of copying into it)."""
        fused_again = self.runner.check_weights()
        addresses = self._parameter_addresses()
        if fused_again or addresses != self._addresses:
            self.drop_graphs()
            self._addresses = addresses

    # ------------------------------------------------------------------ membership

    def __len__(self) -> int:
        return len(self.members)

    def holds(self, owner) -> bool:
        return id(owner) in self._slot_of

    def fits(self, tokens: int) -> bool:
        """Whether a sequence that will reach ``tokens`` positions can live in a slot."""
        return tokens <= self.capacity

    def admit(self, owner, kv: SeqKV | HybridState, token: int = 0, params: SamplingParams | None = None,
              seed: int = 0, drawn: int = 0) -> None:
        """Give ``owner`` the next free slot, holding a copy of ``kv``'s state (its filled positions,
        and a hybrid's conv and recurrent states); ``token`` is its next input, ``params``/``seed``/
        ``drawn`` (tokens drawn so far) what ``launch`` samples with."""
        if len(self.members) >= self.slots:
            raise RuntimeError("no free decode slot")
        if kv.length >= self.capacity:
            raise RuntimeError(f"{kv.length} positions do not fit a slot of {self.capacity}")
        params = params or SamplingParams(temperature=0.0)
        slot, n = len(self.members), kv.length
        self.model_step.load(slot, kv)
        top_k = params.top_k if 0 < params.top_k < self.vocab else 0
        # through pinned memory without a sync: a step may be in flight
        self.state_i[:, slot] = to_device([token, n, seed, drawn, top_k], self.device)
        self.state_f[:, slot] = to_device([max(params.temperature, 0.0), params.top_p], self.device, torch.float32)
        self.members.append(owner)
        self.lengths.append(n)
        self.params.append(params)
        self._slot_of[id(owner)] = slot

    def release(self, owner, into: SeqKV | HybridState | None = None) -> None:
        """Free ``owner``'s slot; with ``into``, first copy the slot's state back there (for the
        prefix cache). The last slot moves into the hole, so slots stay dense."""
        slot = self._slot_of.pop(id(owner))
        n = self.lengths[slot]
        if into is not None and n:
            self.model_step.store(slot, into, n)
        last = len(self.members) - 1
        if slot != last:
            self.model_step.move(slot, last, self.lengths[last])
            self.state_i[:, slot] = self.state_i[:, last]
            self.state_f[:, slot] = self.state_f[:, last]
            self.members[slot], self.lengths[slot] = self.members[last], self.lengths[last]
            self.params[slot] = self.params[last]
            self._slot_of[id(self.members[slot])] = slot
        self.members.pop()
        self.lengths.pop()
        self.params.pop()

    def length(self, owner) -> int:
        return self.lengths[self._slot_of[id(owner)]]

    def drop_graphs(self) -> None:
        self._graphs.clear()

    # ------------------------------------------------------------------ the step

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` to slot ``i`` at its next position; fp32 logits ``[len(tokens), V]``.

        The returned tensor is a view of a static buffer that the next step overwrites."""
        n = len(self.members)
        if len(tokens) != n or n == 0:
            raise ValueError(f"step needs one token per member ({n}), got {len(tokens)}")
        self.ids[:n] = torch.tensor(tokens, dtype=torch.long)
        self.pos[:n] = torch.tensor(self.lengths, dtype=torch.long)
        return self._run_forward()

    def launch(self) -> "Launched":
        """One decode step for every member, its inputs already on the device, then sampling on the
        device, whose tokens become the next step's inputs. Returns at once: the results travel to
        the host asynchronously, so the caller can prepare (and launch) the next step meanwhile.
        A member that leaves before its results are read just has them ignored."""
        n = len(self.members)
        if n == 0:
            raise ValueError("no members to decode")
        logits = self._run_forward()
        params = list(self.params)
        res = draw(logits, self.temps[:n], self.top_k[:n], self.top_p[:n], self.seeds[:n], self.counters[:n],
                   **draw_options(params, self.vocab))
        self.ids[:n] = res[0]
        self.pos[:n] += 1
        self.counters[:n] += 1
        return Launched(list(self.members), [p.top_logprobs for p in params], pack(*res))

    def _run_forward(self) -> torch.Tensor:
        n = len(self.members)
        if max(self.lengths) >= self.capacity:
            raise RuntimeError("a decode slot is full")
        b = next(s for s in self._buckets if s >= n)
        w = width_bucket(max(self.lengths) + 1, self.capacity)
        if not self.graphs:
            self._forward(b, w)
        elif (b, w) not in self._graphs:
            self._capture(b, w)
        elif self._graphs[(b, w)] is None:
            self._forward(b, w)
        else:
            self._graphs[(b, w)].replay()
        for i in range(n):
            self.lengths[i] += 1
        return self.logits[:n]

    def _capture(self, b: int, w: int) -> None:
        """Run this step, then capture it as the graph of ``(b, w)`` for the steps after it.

        The step runs once eagerly on a side stream (allocator and library warm-up, as torch asks),
        and that run is this step: a capture only records, it executes nothing, so the graph's first
        replay is the next step. (Replaying right after the capture would run this step twice: for
        a hybrid model, whose step advances recurrent states in place, a wrong result.)"""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(b, w)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the trainer may share the GPU from another thread, and under the default
            # "global" mode its allocations (cudaMalloc) during a capture fail its train step and
            # invalidate the capture. Nothing it does touches this capture's stream or pool.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._forward(b, w)
        except Exception as e:  # e.g. a rope variant that syncs, an MoE that routes on the host: eager
            log.warning("decode graph for batch %d, width %d not captured (%s: %s); running it eagerly",
                        b, w, type(e).__name__, str(e)[:200])
            graph = None
        self._graphs[(b, w)] = graph
        self.captures += 1

    def _forward(self, b: int, w: int) -> None:
        """One decode step for slots ``[0, b)`` attending over ``[0, w)``; writes ``self.logits[:b]``."""
        self.logits[:b] = self.model_step.logits(self.ids[:b], self.pos[:b], self.rows[:b], w)


class KVArena:
    """The K/V of every slot for the attention layers, ``[layers, 2, slots, kv_heads, capacity,
    head_dim]``, and one decode step's attention over it (``attention``: sdpa or triton, see
    ``StaticDecoder``)."""

    def __init__(self, layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int, like: torch.Tensor,
                 attention: str):
        # zeros, not empty: a padding row attends to position 0 of a free slot, and NaN garbage there
        # would poison its (discarded) output and, through 0 * NaN, nothing else -- but keep it finite
        self.kv = like.new_zeros(layers, 2, slots, kv_heads, capacity, head_dim)
        self.attention = attention

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, like: torch.Tensor) -> int:
        return layers * 2 * kv_heads * head_dim * like.element_size()

    def load(self, slot: int, kv: SeqKV, n: int) -> None:
        """Copy ``kv``'s first ``n`` positions into the slot."""
        for li in range(self.kv.shape[0]):
            k, v = kv.layers[li]
            self.kv[li, 0, slot, :, :n] = k[:n].transpose(0, 1)
            self.kv[li, 1, slot, :, :n] = v[:n].transpose(0, 1)

    def store(self, slot: int, into: SeqKV, n: int) -> None:
        """Copy the slot's first ``n`` positions into ``into`` (grown to hold them) and set its length."""
        into.ensure(n)
        for li in range(self.kv.shape[0]):
            k, v = into.layers[li]
            k[:n] = self.kv[li, 0, slot, :, :n].transpose(0, 1)
            v[:n] = self.kv[li, 1, slot, :, :n].transpose(0, 1)
        into.length = n

    def move(self, dst: int, src: int, n: int) -> None:
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]

    def mask(self, pos: torch.Tensor, w: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The step's additive padding mask ``[b, 1, 1, w]`` for sdpa, made once for every layer (None
        for triton, which reads each slot's live positions only)."""
        if self.attention == "triton":
            return None
        visible = torch.arange(w, device=pos.device)[None, :] <= pos[:, None]
        return torch.zeros(pos.shape[0], 1, 1, w, dtype=dtype, device=pos.device).masked_fill_(
            ~visible[:, None, None, :], float("-inf"))

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               rows: torch.Tensor, w: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Write ``k, v [b, kv_heads, d]`` at each row's position of layer ``li``, then attend with ``q
        [b, heads, d]`` over ``[0, w)``: ``[b, heads * d]``."""
        b, hq, d = q.shape
        hkv = k.shape[1]
        kc, vc = self.kv[li, 0], self.kv[li, 1]
        kc[rows, :, pos] = k
        vc[rows, :, pos] = v
        # the query heads sharing a KV head act as that head's queries: [b, kv_heads, group, dim]
        q = q.reshape(b, hkv, hq // hkv, d)
        if self.attention == "triton":  # reads positions 0..pos of each slot, whatever the width
            o = decode_attention.decode_attention(q, kc[:b], vc[:b], pos, scale, w)
        else:
            o = F.scaled_dot_product_attention(q, kc[:b, :, :w], vc[:b, :, :w], attn_mask=mask, scale=scale)
        return o.reshape(b, hq * d)


def step_inputs(runner, arena: KVArena, ids: torch.Tensor, pos: torch.Tensor, w: int):
    """What every layer of a decode step reads: the tokens' embeddings, their rotary tables and the
    attention mask of width ``w`` (made once per step)."""
    x = runner.inner.embed_tokens(ids)
    cos, sin = runner.rope_tables(x, pos)
    return x, cos, sin, arena.mask(pos, w, x.dtype)


class AttentionStep:
    """The decode step of Llama-family models (``RaggedForward``): every layer attends, so a slot's
    state is its K/V alone."""

    def __init__(self, runner: RaggedForward, slots: int, capacity: int, attention: str):
        self.runner = runner
        self.arena = KVArena(runner.n_layers, slots, runner.kv_heads, capacity, runner.head_dim,
                             runner.inner.embed_tokens.weight, attention)

    @staticmethod
    def footprint(runner: RaggedForward) -> tuple[int, int]:
        """Arena bytes per slot: per token of capacity, and fixed."""
        p = runner.inner.embed_tokens.weight
        return KVArena.bytes_per_token(runner.n_layers, runner.kv_heads, runner.head_dim, p), 0

    def load(self, slot: int, kv: SeqKV) -> None:
        self.arena.load(slot, kv, kv.length)

    def store(self, slot: int, into: SeqKV, n: int) -> None:
        self.arena.store(slot, into, n)

    def move(self, dst: int, src: int, n: int) -> None:
        self.arena.move(dst, src, n)

    def logits(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, w: int) -> torch.Tensor:
        """Fp32 logits ``[b, V]`` for token ``ids[i]`` of slot ``rows[i]`` at ``pos[i]``.

        Written for few kernels, since at decode each kernel is tiny and their count, not the bytes,
        sets the step time: q, k and v come from one matmul and gate/up from another (the fused
        weights of ``fuse_weights``), q and k are normalised and rotated together, and the padding
        mask is made once per step."""
        r = self.runner
        inner = r.inner
        x, cos, sin, mask = step_inputs(r, self.arena, ids, pos, w)
        for li, layer in enumerate(inner.layers):
            q, k, v = r.qkv(li, rms_norm(layer.input_layernorm, x), cos, sin)
            o = self.arena.attend(li, q, k, v, pos, rows, w, mask, r.scaling)
            x = x + layer.self_attn.o_proj(o)
            x = x + r.mlp(li, rms_norm(layer.post_attention_layernorm, x))
        return r.model.lm_head(rms_norm(inner.norm, x)).float()


class HybridStep:
    """The decode step of hybrid linear-attention models (``HybridForward``): a K/V arena for the
    full-attention layers, and per linear-attention layer a conv window ``conv [n_linear, slots,
    conv_dim, kernel-1]`` and a recurrent state ``ssm [n_linear, slots, heads, K, V]`` (fp32) per slot.

    The linear layers advance rows ``[0, b)`` of both in place (padding rows only free slots, whose
    rows ``load`` overwrites on admission) with the same math as the ragged path: ``conv_step``, then
    the delta rule's one-token ``recurrent`` step of the runner's kernels (fla's fused recurrent
    kernel on a GPU, else pure torch), both fixed-shape and free of host syncs."""

    def __init__(self, runner: HybridForward, slots: int, capacity: int, attention: str):
        self.runner = runner
        p = runner.inner.embed_tokens.weight
        self.arena = KVArena(len(runner.attn_index), slots, runner.kv_heads, capacity, runner.head_dim, p, attention)
        n_linear = len(runner.linear_index)
        self.conv = p.new_zeros(n_linear, slots, runner.conv_dim, runner.conv_k - 1)
        self.ssm = torch.zeros(n_linear, slots, runner.hv, runner.dk, runner.dv, dtype=torch.float32, device=p.device)

    @staticmethod
    def footprint(runner: HybridForward) -> tuple[int, int]:
        """Arena bytes per slot: per token of capacity (the attention layers' K/V), and fixed (the
        linear layers' conv windows and recurrent states)."""
        p = runner.inner.embed_tokens.weight
        per_token = KVArena.bytes_per_token(len(runner.attn_index), runner.kv_heads, runner.head_dim, p)
        conv = runner.conv_dim * (runner.conv_k - 1) * p.element_size()
        return per_token, len(runner.linear_index) * (conv + runner.hv * runner.dk * runner.dv * 4)

    def load(self, slot: int, state: HybridState) -> None:
        self.arena.load(slot, state.kv, state.length)
        self.conv[:, slot] = state.conv
        self.ssm[:, slot] = state.ssm

    def store(self, slot: int, into: HybridState, n: int) -> None:
        self.arena.store(slot, into.kv, n)
        into.conv.copy_(self.conv[:, slot])
        into.ssm.copy_(self.ssm[:, slot])
        into.length = n

    def move(self, dst: int, src: int, n: int) -> None:
        self.arena.move(dst, src, n)
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def logits(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, w: int) -> torch.Tensor:
        """Fp32 logits ``[b, V]`` for token ``ids[i]`` of slot ``rows[i]`` at ``pos[i]``; advances the
        linear layers' states of slots ``[0, b)``. HybridForward.forward's layer loop, on the arena."""
        r = self.runner
        inner = r.inner
        x, cos, sin, mask = step_inputs(r, self.arena, ids, pos, w)
        for li, layer in enumerate(inner.layers):
            h = layer.input_layernorm(x)
            if li in r.linear_index:
                h = self._linear(r.linear_index[li], layer.linear_attn, h)
            else:
                attn = layer.self_attn
                q, k, v, gate = r.gated_qkv(attn, h, cos, sin)
                o = self.arena.attend(r.attn_index[li], q, k, v, pos, rows, w, mask, attn.scaling)
                h = attn.o_proj(o * torch.sigmoid(gate))
            x = x + h
            x = x + feed_forward(layer.mlp, layer.post_attention_layernorm(x))
        return r.model.lm_head(inner.norm(x)).float()

    def _linear(self, j: int, la, h: torch.Tensor) -> torch.Tensor:
        """Linear-attention layer ``j`` (of the linear ones) for one token of each of rows ``[0, b)``."""
        b = h.shape[0]
        mixed, z, beta_in, a = project_linear(la, h)
        y, window = conv_step(la, self.conv[j, :b], mixed)
        self.conv[j, :b] = window
        q, k, v, g, beta = gates_and_heads(la, F.silu(y.to(h.dtype)), beta_in, a)
        o, state = self.runner.kernels.recurrent(q, k, v, g, beta, self.ssm[j, :b])
        self.ssm[j, :b] = state
        return gated_output(la, o.to(h.dtype), z)


class Launched:
    """A launched decode step: its members (slot order at launch) and, once ``read``, one
    ``[tokens, logprob, top ids..., top logprobs...]`` row per member."""

    def __init__(self, members: list, top_ns: list[int], packed: torch.Tensor):
        self.members, self.top_ns = members, top_ns
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = packed, None

    def read(self) -> list[list[float]]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
