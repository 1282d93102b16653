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


def build_micro_batch(samples: list[Sample], device: torch.device, topk: int = 0) -> MicroBatch:
    """Packs ``samples`` in order; then, for each that carries a hinted reply (``hinted_sequence``),
    one more sequence of its prompt and that reply, whose tokens train only through the hinted NLL
    term (``hinted_weight`` > 0, ``loss_mask`` 0); then, for each that carries the reference's reply
    (``Sample.replay``), one more of its prompt and that reply, trained only through the replay term
    (``replay_mask`` 1, ``loss_mask`` 0; with the reference's top-k, ``replay_topk_*``).
    ``cu_seqlens``' first ``len(samples)`` sequences are the samples'."""
    ids, pos, seg, rows, targets, temps, adv, mask, rollout, cu = [], [], [], [], [], [], [], [], [], [0]
    bounds = []
    has_rl, has_opd, teacher, top_ids, top_lps, top_mask, hinted_w, replay = [], [], [], [], [], [], [], []

    def add(prompt: list[int], response: list[int]) -> int:
        p, r = len(prompt), len(response)
        start = len(ids)
        bounds.append((start, start + p + r))
        ids.extend([int(t) for t in prompt] + [int(t) for t in response])
        pos.extend(range(p + r))
        seg.extend([len(bounds) - 1] * (p + r))
        rows.extend(range(start + p - 1, start + p + r - 1))  # logits at t predict token t + 1
        targets.extend(int(t) for t in response)
        cu.append(cu[-1] + r)
        return r

    for s in samples:
        r = add(s.prompt_ids, s.response_ids)
        temps += [sample_temperature(s)] * r
        adv += [float(s.advantage)] * r
        mask += [1.0] * r if s.loss_mask is None else [float(m) for m in s.loss_mask]
        rollout += [float(x) for x in s.rollout_logprobs]
        lps, k_ids, k_lps = teacher_signal(s, topk)
        has_rl += [s.rl_signal] * r
        has_opd += [lps is not None] * r
        teacher += lps if lps is not None else [math.nan] * r
        top_ids += k_ids if k_ids is not None else [[0] * topk] * r
        top_lps += k_lps if k_lps is not None else [[0.0] * topk] * r
        top_mask += [float(k_ids is not None)] * r
        hinted_w += [0.0] * r
        replay += [0.0] * r

    def add_not_sampled(prompt: list[int], response: list[int], hinted_weight: float, replay_flag: float) -> None:
        """A sequence whose tokens train only through a term of their own (the hinted NLL, the replay's
        NLL or KL): no policy-gradient signal on them, since they are not the student's own sample."""
        r = add(prompt, response)
        for values, fill in ((temps, 1.0), (adv, 0.0), (mask, 0.0), (rollout, 0.0), (has_rl, False),
                             (has_opd, False), (teacher, math.nan), (top_ids, [0] * topk), (top_lps, [0.0] * topk),
                             (top_mask, 0.0), (hinted_w, hinted_weight), (replay, replay_flag)):
            values.extend([fill] * r)

    for s in samples:
        hinted = hinted_sequence(s)
        if hinted is not None:
            add_not_sampled(s.prompt_ids, hinted[0], hinted[1], 0.0)
    replays = [s for s in samples if s.replay is not None]
    replay_k = next((len(s.replay.topk_ids[0]) for s in replays if s.replay.topk_ids), 0)
    replay_ids, replay_lps = [[0] * replay_k] * len(targets), [[0.0] * replay_k] * len(targets)
    for s in replays:
        add_not_sampled(s.prompt_ids, [int(x) for x in s.replay.ids], 0.0, 1.0)
        if replay_k:
            if s.replay.topk_ids is None or len(s.replay.topk_ids) != len(s.replay.ids) or any(
                    len(row) != replay_k for row in s.replay.topk_ids):
                raise ValueError(f"sample {s.sample_id}: the reference reply's top-k is not {len(s.replay.ids)} rows "
                                 f"of {replay_k}, like the step's other replays")
            replay_ids += [[int(i) for i in row] for row in s.replay.topk_ids]
            replay_lps += [[float(x) for x in row] for row in s.replay.topk_logprobs]

    long, f32 = torch.long, torch.float32
    columns = {"input_ids": ([ids], long), "position_ids": ([pos], long), "segment": (seg, long),
               "logit_rows": (rows, long), "targets": (targets, long), "temperature": (temps, f32),
               "advantages": (adv, f32), "loss_mask": (mask, f32), "rollout_logprobs": (rollout, f32),
               "cu_seqlens": (cu, long), "has_rl": (has_rl, torch.bool), "has_opd": (has_opd, torch.bool),
               "teacher_logprobs": (teacher, f32)}
    if topk > 0:
        columns.update(topk_ids=(top_ids, long), topk_logprobs=(top_lps, f32), topk_mask=(top_mask, f32))
    if any(hinted_w):
        columns["hinted_weight"] = (hinted_w, f32)
    if any(replay):
        columns["replay_mask"] = (replay, f32)
    if replay_k:
        columns.update(replay_topk_ids=(replay_ids, long), replay_topk_logprobs=(replay_lps, f32))
    return MicroBatch(**_on_device(columns, device), bounds=tuple(bounds), num_samples=len(samples))


_NUMPY = {torch.long: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def _on_device(columns: dict[str, tuple[list, torch.dtype]], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch's host lists as tensors on ``device``. Each list goes through numpy (a third of
    ``torch.tensor``'s time on a Python list), and the lists of one dtype travel as one buffer: on
    CUDA one pinned, non-blocking copy per dtype, where a tensor per list from pageable memory was a
    dozen copies that each made the host wait, while the device sat idle at the step's start."""
    arrays = defaultdict(list)
    for name, (values, dtype) in columns.items():
        arrays[dtype].append((name, np.asarray(values, dtype=_NUMPY[dtype])))
    out = {}
    for dtype, named in arrays.items():
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
