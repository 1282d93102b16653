"""Samples -> packed micro-batches: the data layout both trainer backends train on.

A micro-batch is one row of concatenated sequences (prompt + response each), positions restarting
per sequence, with per-token tensors over the *response* tokens only: their targets, advantages,
masks, rollout logprobs, which signals each token's sample has (a judged reward, a teacher), and
the teacher's logprobs and top-k where there is one (``Sample.teacher``); the run's method turns them
into advantages (``clawrl.methods``). ``pack`` splits a step's samples into micro-batches of at most
``train.micro_batch_tokens`` tokens (dynamic micro-batches), so the number of micro-batches follows
the data, not a fixed count.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from clawrl.samples import Sample

log = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """Packed sequences for one forward/backward. Per-token tensors cover response tokens only."""

    input_ids: torch.Tensor  # [1, L] prompt+response tokens of every sequence, end to end
    position_ids: torch.Tensor  # [1, L] restarting at 0 for each sequence
    segment: torch.Tensor  # [L] which sequence each token belongs to (for the block mask)
    logit_rows: torch.Tensor  # [T] positions whose next-token logits predict a response token
    targets: torch.Tensor  # [T] the response tokens
    temperature: torch.Tensor  # [T] sampling temperature of each token's sample
    advantages: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T]
    rollout_logprobs: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [S + 1] over the T response tokens
    has_rl: torch.Tensor  # [T] bool: the token's sample has a judged reward
    has_opd: torch.Tensor  # [T] bool: the token's sample has teacher logprobs
    teacher_logprobs: torch.Tensor  # [T] NaN where there is no teacher
    topk_ids: torch.Tensor | None = None  # [T, K] the teacher's top-k ids (opd.topk > 0)
    topk_logprobs: torch.Tensor | None = None  # [T, K]
    topk_mask: torch.Tensor | None = None  # [T] 1 where the teacher's top-k is present
    bounds: tuple[tuple[int, int], ...] = ()  # (start, end) of each sequence in the row, host-side
    # [T] opd.hinted_sample: the hint's acceptance on the tokens of a teacher's reply under the hinted
    # prompt (their own sequences, after the samples'), 0 elsewhere; None when the batch has none
    hinted_weight: torch.Tensor | None = None
    # [T] train.replay_coef: 1 on the tokens of the reference's own reply to a sample's prompt (their own
    # sequences, after the hinted ones), 0 elsewhere; None when the batch has none
    replay_mask: torch.Tensor | None = None
    # [T, K] train.replay_topk: the reference's top-k ids and logprobs on the replay's tokens, 0 elsewhere
    replay_topk_ids: torch.Tensor | None = None
    replay_topk_logprobs: torch.Tensor | None = None
    num_samples: int = 0  # the first num_samples sequences are the samples' own, in order

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack(samples: list[Sample], max_tokens: int) -> list[list[int]]:
    """Sample indices per micro-batch: greedy, in order, at most ``max_tokens`` prompt+response
    tokens each. A sample longer than the budget gets a micro-batch of its own."""
    if max_tokens < 1:
        raise ValueError(f"train.micro_batch_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    used = 0
    for i, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        hinted = hinted_sequence(s)
        if hinted is not None:  # packed beside the sample (build_micro_batch)
            n += len(s.prompt_ids) + len(hinted[0])
        if s.replay is not None:
            n += len(s.prompt_ids) + len(s.replay.ids)
        if groups and used + n <= max_tokens:
            groups[-1].append(i)
            used += n
        else:
            if n > max_tokens:
                log.warning("sample %d has %d tokens, more than train.micro_batch_tokens=%d; "
                            "it gets a micro-batch of its own", s.sample_id, n, max_tokens)
            groups.append([i])
            used = n
    return groups


def sample_temperature(s: Sample) -> float:
    """The temperature the engine's logprobs were taken at (``extra["temperature"]``; default 1).
    Greedy requests (0) record logprobs at temperature 1, like the engine."""
    t = float(s.extra.get("temperature", 1.0) or 1.0)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"sample {s.sample_id}: temperature must be > 0, got {t}")
    return t


def check_sample(s: Sample, vocab_size: int) -> None:
    """Refuse a malformed sample with a message naming it (a bad length would misalign tokens)."""
    n = len(s.response_ids)
    if not s.prompt_ids:
        raise ValueError(f"sample {s.sample_id}: empty prompt (the first response token needs a context)")
    if n == 0:
        raise ValueError(f"sample {s.sample_id}: empty response")
    if len(s.rollout_logprobs) != n:
        raise ValueError(f"sample {s.sample_id}: {len(s.rollout_logprobs)} rollout logprobs for {n} response tokens")
    if s.loss_mask is not None and len(s.loss_mask) != n:
        raise ValueError(f"sample {s.sample_id}: loss_mask has {len(s.loss_mask)} entries for {n} response tokens")
    bad = next((t for t in (*s.prompt_ids, *s.response_ids) if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise ValueError(f"sample {s.sample_id}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def teacher_signal(s: Sample, topk: int) -> tuple[list[float] | None, list | None, list | None]:
    """(teacher logprobs, top-k ids, top-k logprobs) from ``Sample.teacher``; Nones where absent. A
    top-k of another K than ``topk`` (stored under other settings) is not used."""
    if s.teacher is None:
        return None, None, None
    teacher = [float(x) for x in s.teacher.teacher_logprobs]
    if len(teacher) != len(s.response_ids):
        raise ValueError(f"sample {s.sample_id}: {len(teacher)} teacher logprobs for {len(s.response_ids)} "
                         "response tokens")
    ids, lps = s.teacher.topk_ids, s.teacher.topk_logprobs
    if topk <= 0 or not ids or len(ids) != len(teacher) or any(len(row) != topk for row in ids):
        return teacher, None, None
    return teacher, ids, lps


def hinted_sequence(s: Sample) -> tuple[list[int], float] | None:
    """(token ids, weight) of the teacher's reply under the hinted prompt that ``s`` trains on with
    token NLL under its own prompt (``opd.hinted_sample``), or None."""
    t = s.teacher
    if t is None or not t.hinted_ids or not t.hinted_weight > 0:
        return None
    return [int(x) for x in t.hinted_ids], float(t.hinted_weight)


# Per-token values of each sequence's response tokens: numpy dtype, and the value where a sequence
# does not carry the column (a sequence that is not a sample of the student's own: a hinted or
# replayed reply, trained only through its own term).
_PER_TOKEN = {"temperature": (np.float32, 1.0), "advantages": (np.float32, 0.0), "loss_mask": (np.float32, 0.0),
              "rollout_logprobs": (np.float32, 0.0), "has_rl": (np.bool_, False), "has_opd": (np.bool_, False),
              "teacher_logprobs": (np.float32, math.nan), "topk_ids": (np.int64, 0),
              "topk_logprobs": (np.float32, 0.0), "topk_mask": (np.float32, 0.0), "hinted_weight": (np.float32, 0.0),
              "replay_mask": (np.float32, 0.0), "replay_topk_ids": (np.int64, 0),
              "replay_topk_logprobs": (np.float32, 0.0)}


def build_micro_batch(samples: list[Sample], device: torch.device, topk: int = 0) -> MicroBatch:
    """Packs ``samples`` in order; then, for each that carries a hinted reply (``hinted_sequence``),
    one more sequence of its prompt and that reply, whose tokens train only through the hinted NLL
    term (``hinted_weight`` > 0, ``loss_mask`` 0); then, for each that carries the reference's reply
    (``Sample.replay``), one more of its prompt and that reply, trained only through the replay term
    (``replay_mask`` 1, ``loss_mask`` 0; with the reference's top-k, ``replay_topk_*``).
    ``cu_seqlens``' first ``len(samples)`` sequences are the samples'."""
    sequences = []  # (prompt, response, per-token values of the response: a scalar for all, or rows)
    for s in samples:
        lps, k_ids, k_lps = teacher_signal(s, topk)
        sequences.append((s.prompt_ids, s.response_ids, {
            "temperature": sample_temperature(s), "advantages": float(s.advantage),
            "loss_mask": 1.0 if s.loss_mask is None else s.loss_mask, "rollout_logprobs": s.rollout_logprobs,
            "has_rl": bool(s.rl_signal), "has_opd": lps is not None,
            "teacher_logprobs": math.nan if lps is None else lps, "topk_ids": 0 if k_ids is None else k_ids,
            "topk_logprobs": 0.0 if k_lps is None else k_lps, "topk_mask": float(k_ids is not None)}))
    for s in samples:
        hinted = hinted_sequence(s)
        if hinted is not None:
            sequences.append((s.prompt_ids, hinted[0], {"hinted_weight": hinted[1]}))
    replays = [s for s in samples if s.replay is not None]
    replay_k = next((len(s.replay.topk_ids[0]) for s in replays if s.replay.topk_ids), 0)
    for s in replays:
        values = {"replay_mask": 1.0}
        if replay_k:
            if s.replay.topk_ids is None or len(s.replay.topk_ids) != len(s.replay.ids) or any(
                    len(row) != replay_k for row in s.replay.topk_ids):
                raise ValueError(f"sample {s.sample_id}: the reference reply's top-k is not {len(s.replay.ids)} rows "
                                 f"of {replay_k}, like the step's other replays")
            values.update(replay_topk_ids=s.replay.topk_ids, replay_topk_logprobs=s.replay.topk_logprobs)
        sequences.append((s.prompt_ids, s.replay.ids, values))

    wanted = ["temperature", "advantages", "loss_mask", "rollout_logprobs", "has_rl", "has_opd", "teacher_logprobs"]
    if topk > 0:
        wanted += ["topk_ids", "topk_logprobs", "topk_mask"]
    if any("hinted_weight" in v for _, _, v in sequences):
        wanted.append("hinted_weight")
    if replays:
        wanted.append("replay_mask")
    if replay_k:
        wanted += ["replay_topk_ids", "replay_topk_logprobs"]
    widths = {"topk_ids": topk, "topk_logprobs": topk, "replay_topk_ids": replay_k, "replay_topk_logprobs": replay_k}
    chunks = defaultdict(list)  # column -> one numpy array per sequence
    bounds, cu = [], [0]
    for prompt, response, values in sequences:
        p, r = len(prompt), len(response)
        start = bounds[-1][1] if bounds else 0
        bounds.append((start, start + p + r))
        cu.append(cu[-1] + r)
        targets = np.asarray(response, np.int64)
        chunks["input_ids"] += [np.asarray(prompt, np.int64), targets]
        chunks["position_ids"].append(np.arange(p + r))
        chunks["segment"].append(np.full(p + r, len(bounds) - 1))
        chunks["logit_rows"].append(np.arange(start + p - 1, start + p + r - 1))  # logits at t predict token t + 1
        chunks["targets"].append(targets)
        for name in wanted:
            dtype, absent = _PER_TOKEN[name]
            value, shape = values.get(name, absent), (r, widths[name]) if name in widths else (r,)
            chunks[name].append(np.full(shape, value, dtype) if np.isscalar(value)
                                else np.asarray(value, dtype).reshape(shape))
    columns = {name: np.concatenate(parts) for name, parts in chunks.items()}
    columns["input_ids"], columns["position_ids"] = columns["input_ids"][None], columns["position_ids"][None]
    columns["cu_seqlens"] = np.asarray(cu, np.int64)
    return MicroBatch(**_on_device(columns, device), bounds=tuple(bounds), num_samples=len(samples))


def _on_device(columns: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch's host arrays as tensors on ``device``. The arrays of one dtype travel as one
    buffer: on CUDA one pinned, non-blocking copy per dtype, where a tensor per list from pageable
    memory was a dozen copies that each made the host wait, while the device sat idle at the step's
    start. (Built from numpy arrays a sequence at a time: ``torch.tensor`` on token-long Python lists
    took 18 ms of the 2-core dev box for 8 x 2048 tokens, this 2 ms.)"""
    by_dtype = defaultdict(list)
    for name, a in columns.items():
        by_dtype[a.dtype].append((name, a))
    out = {}
    for named in by_dtype.values():
        flat = torch.from_numpy(np.concatenate([a.ravel() for _, a in named]))
        flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
        for (name, a), part in zip(named, flat.split([a.size for _, a in named])):
            out[name] = part.view(a.shape)
    return out


def trained_mask(mb: MicroBatch) -> torch.Tensor:
    """[T] 1 on every token the step trains: the policy loss's (``loss_mask``), a hinted reply's
    (``hinted_weight`` > 0) and a replayed reference reply's (``replay_mask``); what the step's
    aggregation denominator counts."""
    out = mb.loss_mask
    if mb.hinted_weight is not None:
        out = out + (mb.hinted_weight > 0).to(out.dtype)
    if mb.replay_mask is not None:
        out = out + mb.replay_mask.to(out.dtype)
    return out


def sample_metrics(samples: list[Sample], weight_version: int, batches: list[MicroBatch]) -> dict:
    """Step metrics that depend only on the samples and their packing."""
    lag = [weight_version - s.oldest_version for s in samples]
    return {
        "samples": len(samples), "micro_batches": len(batches),
        "tokens": sum(mb.num_tokens for mb in batches),
        "trained_tokens": float(sum(float(mb.loss_mask.sum()) for mb in batches)),
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "advantage_mean": sum(s.advantage for s in samples) / len(samples),
        "staleness_mean": sum(lag) / len(lag), "staleness_max": max(lag),
    }
