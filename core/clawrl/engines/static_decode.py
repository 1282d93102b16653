"""Decode steps over a preallocated KV arena, replayed as CUDA graphs on a GPU.

On a GPU the ragged forward is host-bound at decode: a step of a 28-layer model launches about
two thousand small kernels, and each launch costs more host time than the kernel takes on the
device. Here every decoding sequence owns one slot of a static KV arena
``[layers, 2, slots, kv_heads, capacity, head_dim]`` that is allocated once and updated in place,
so the tensors a decode step touches never move, and the whole step -- embedding, every layer,
the new K/V written at each row's position, attention, the final norm and the fp32 logits -- is
captured once as a CUDA graph and then replayed with one launch.

Graphs are captured lazily per (batch bucket, attention-width bucket): a batch of ``n`` sequences
runs the graph of the smallest bucket ``>= n`` (padding rows write only into free slots), and
attention reads the first ``W`` positions of each slot, ``W`` the longest context rounded up, so
the bytes read grow with the contexts actually in the batch rather than with ``capacity``.
Slots are kept dense: when a sequence leaves, the last one moves into its hole.

The graphs read the model's parameters where they are, so a weight update must copy new values
into the same storage (``TorchEngine`` does), which it does between steps. On CPU (and with
``graphs=False``) the same step runs eagerly; tests use that to check it against the ragged path.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import clawrl.engines.decode_attention as decode_attention
from clawrl.engines.base import SamplingParams
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


def default_capacity(runner: RaggedForward, slots: int, max_context: int) -> int:
    """Tokens per slot that fit in ``ARENA_MEMORY_FRACTION`` of free device memory, at most
    ``max_context``, rounded down to a multiple of 256 (0: not worth an arena)."""
    p = runner.inner.embed_tokens.weight
    per_token = runner.n_layers * 2 * runner.kv_heads * runner.head_dim * p.element_size()
    free, _ = torch.cuda.mem_get_info(p.device)
    cap = min(max_context, int(free * ARENA_MEMORY_FRACTION) // (slots * per_token))
    return cap // 256 * 256


class StaticDecoder:
    """See the module docstring. ``owner`` objects (the engine's requests) are opaque here."""

    def __init__(self, runner: RaggedForward, slots: int, capacity: int, graphs: bool | None = None,
                 attention: str = "sdpa"):
        if slots < 1 or capacity < 1:
            raise ValueError(f"a static decoder needs slots >= 1 and capacity >= 1, got {slots} and {capacity}")
        self.runner = runner
        inner = runner.inner
        p = inner.embed_tokens.weight
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
        self.vocab = int(runner.model.config.vocab_size)
        # zeros, not empty: a padding row attends to position 0 of a free slot, and NaN garbage there
        # would poison its (discarded) output and, through 0 * NaN, nothing else -- but keep it finite
        self.arena = p.new_zeros(runner.n_layers, 2, slots, runner.kv_heads, capacity, runner.head_dim)
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
        self.captures = 0

    def check_weights(self) -> None:
        """After a weight update: if the runner had to fuse its weights again (new tensors), drop the
        graphs, which captured the old addresses."""
        if self.runner.check_weights():
            self.drop_graphs()

    # ------------------------------------------------------------------ membership

    def __len__(self) -> int:
        return len(self.members)

    def holds(self, owner) -> bool:
        return id(owner) in self._slot_of

    def fits(self, tokens: int) -> bool:
        """Whether a sequence that will reach ``tokens`` positions can live in a slot."""
        return tokens <= self.capacity

    def admit(self, owner, kv: SeqKV, token: int = 0, params: SamplingParams | None = None, seed: int = 0,
              drawn: int = 0) -> None:
        """Give ``owner`` the next free slot, holding a copy of ``kv``'s filled positions; ``token`` is
        its next input, ``params``/``seed``/``drawn`` (tokens drawn so far) what ``launch`` samples with."""
        if len(self.members) >= self.slots:
            raise RuntimeError("no free decode slot")
        if kv.length >= self.capacity:
            raise RuntimeError(f"{kv.length} positions do not fit a slot of {self.capacity}")
        params = params or SamplingParams(temperature=0.0)
        slot, n = len(self.members), kv.length
        for li, (k, v) in enumerate(kv.layers):
            self.arena[li, 0, slot, :, :n] = k[:n].transpose(0, 1)
            self.arena[li, 1, slot, :, :n] = v[:n].transpose(0, 1)
        top_k = params.top_k if 0 < params.top_k < self.vocab else 0
        # through pinned memory without a sync: a step may be in flight
        self.state_i[:, slot] = to_device([token, n, seed, drawn, top_k], self.device)
        self.state_f[:, slot] = to_device([max(params.temperature, 0.0), params.top_p], self.device, torch.float32)
        self.members.append(owner)
        self.lengths.append(n)
        self.params.append(params)
        self._slot_of[id(owner)] = slot

    def release(self, owner, into: SeqKV | None = None) -> None:
        """Free ``owner``'s slot; with ``into``, first copy the slot's positions back there (for the
        prefix cache). The last slot moves into the hole, so slots stay dense."""
        slot = self._slot_of.pop(id(owner))
        n = self.lengths[slot]
        if into is not None and n:
            into.ensure(n)
            for li, (k, v) in enumerate(into.layers):
                k[:n] = self.arena[li, 0, slot, :, :n].transpose(0, 1)
                v[:n] = self.arena[li, 1, slot, :, :n].transpose(0, 1)
            into.length = n
        last = len(self.members) - 1
        if slot != last:
            m = self.lengths[last]
            self.arena[:, :, slot, :, :m] = self.arena[:, :, last, :, :m]
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
        graph = self._graph(b, w) if self.graphs else None
        if graph is None:
            self._forward(b, w)
        else:
            graph.replay()
        for i in range(n):
            self.lengths[i] += 1
        return self.logits[:n]

    def _graph(self, b: int, w: int):
        key = (b, w)
        if key in self._graphs:
            return self._graphs[key]
        # Run once eagerly on a side stream (allocator and library warm-up, as torch asks), then
        # capture. Both see this step's inputs, and the step is idempotent for them: it writes the
        # same K/V at the same positions before attention reads them, so running it again in the
        # replay gives the same result.
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
        except Exception as e:  # e.g. a rope variant that syncs: that shape runs eagerly
            log.warning("decode graph for batch %d, width %d not captured (%s: %s); running it eagerly",
                        b, w, type(e).__name__, str(e)[:200])
            graph = None
        self._graphs[key] = graph
        self.captures += 1
        return graph

    def _forward(self, b: int, w: int) -> None:
        """One decode step for slots ``[0, b)`` attending over ``[0, w)``; writes ``self.logits[:b]``.

        Written for few kernels, since at decode each kernel is tiny and their count, not the bytes,
        sets the step time: q, k and v come from one matmul and gate/up from another (the fused
        weights of ``fuse_weights``), q and k are normalised and rotated together, and the padding
        mask is made once per step."""
        r = self.runner
        inner = r.inner
        hq, hkv, d = r.n_heads, r.kv_heads, r.head_dim
        ids, pos, rows = self.ids[:b], self.pos[:b], self.rows[:b]
        x = inner.embed_tokens(ids)
        cos, sin = r.rope_tables(x, pos)
        # the query heads sharing a KV head act as that head's queries: [b, kv_heads, group, dim]
        triton = self.attention == "triton"
        if not triton:
            visible = torch.arange(w, device=ids.device)[None, :] <= pos[:, None]
            mask = torch.zeros(b, 1, 1, w, dtype=x.dtype, device=x.device).masked_fill_(
                ~visible[:, None, None, :], float("-inf"))
        for li, layer in enumerate(inner.layers):
            h = rms_norm(layer.input_layernorm, x)
            q, k, v = r.qkv(li, h, cos, sin)
            kc, vc = self.arena[li, 0], self.arena[li, 1]
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            q = q.reshape(b, hkv, hq // hkv, d)
            if triton:  # reads positions 0..pos of each slot, whatever the width
                o = decode_attention.decode_attention(q, kc[:b], vc[:b], pos, r.scaling, w)
            else:
                o = F.scaled_dot_product_attention(q, kc[:b, :, :w], vc[:b, :, :w], attn_mask=mask, scale=r.scaling)
            x = x + layer.self_attn.o_proj(o.reshape(b, hq * d))
            x = x + r.mlp(li, rms_norm(layer.post_attention_layernorm, x))
        self.logits[:b] = r.model.lm_head(rms_norm(inner.norm, x)).float()


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
