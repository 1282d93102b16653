"""The built-in trainer: an HF causal LM trained with torch (CPU, or one GPU with bf16 autocast).

The trainer holds its *own* copy of the model, loaded from the directory the engine serves, so a
train step never touches the module that is decoding; new weights reach the engine only through
``export_weights`` and the weight sync.

One ``train_step`` is one optimizer step on a list of samples:

1. Samples are packed, in order, into micro-batches of at most ``train.micro_batch_tokens``
   prompt+response tokens. A micro-batch is one row of concatenated sequences with positions
   restarting per sequence and a block-diagonal causal mask, so every sequence sees exactly what
   it would see alone (no padding waste, no cross-talk). Only the logits that predict response
   tokens are materialised (``logits_to_keep``), which bounds the ``[tokens, vocab]`` tensor.
   The mask is dense, so attention in a micro-batch of several sequences costs O(L^2) in its
   total length L (a micro-batch of one sequence uses the model's own causal path); on CPU, many
   short samples train faster with a smaller ``train.micro_batch_tokens``.
2. Before any update, the current weights recompute every response token's logprob: this is
   ``pi_old`` (PPO ratio 1 at the start). The engine's logprobs from the sample are the rollout
   reference for TIS/IcePop, and the gap between the two is logged. With ``kl_coef > 0`` the
   reference policy's logprobs come from the base with LoRA disabled, or a frozen copy.
3. The aggregation denominator is computed for the whole step first, then each micro-batch's loss
   is divided by it and back-propagated, so the accumulated gradient does not depend on how the
   samples were split (``clawrl.losses.aggregate``).
4. A non-finite loss or gradient skips the step (no optimizer step, no new version); after
   ``train.max_bad_steps`` in a row the trainer sets ``paused_reason``.

Advantages by method (``cfg.method``): ``rl`` trains each sample's scalar advantage; ``opd`` and
``combine`` add on-policy distillation from ``Sample.extra["opd"]`` (the teacher's logprobs of the
sampled tokens under the hinted prompt, ``clawrl.teacher``):

- ``A_opd = clamp(teacher_logprobs - rollout_logprobs, +-opd.adv_clip)`` per token. The student side is
  the *rollout* logprobs, not the trainer's recomputed pi_old: both sides then come from the same
  engine and numerics (bf16 serving vs fp32 training on GPU), so the gap is the hint's effect alone;
  the rollout/trainer mismatch is the PPO ratio's business (TIS/IcePop), as for RL. The teacher scores
  at temperature 1, so the gap is exact for turns served at temperature 1 (the OpenAI default).
- ``combine_advantages``: ``A = w_rl * A_rl + w_opd * A_opd`` (``opd``: 0 and 1; ``combine``:
  ``combine.w_rl``, ``combine.w_opd``). A sample with a judged reward (``extra["rl_signal"]``, true
  unless the buffer says otherwise) contributes the RL term, one with teacher logprobs the OPD term,
  one with both, both; tokens with neither are dropped from the loss mask (no zero-advantage
  dilution). The result goes through the same PPO clip as RL advantages.
- With ``opd.topk > 0`` and ``opd.topk_coef > 0``, ``opd.topk_coef`` times a top-k KL between the
  student and the teacher's top-k distribution (K bins plus the tail; on temperature-1 logits like the
  teacher's) is added over the OPD samples' tokens, aggregated with the same global denominator.
  ``opd.topk_kl=reverse`` is ``topk_distill_loss`` (mode-seeking; its gradient on a token is scaled by
  the student's own probability of it, so it cannot raise a token the student never says);
  ``forward`` is KL(teacher || student), which pulls the student onto what the teacher would say
  (on the embedded model it taught the never-sampled opener "Sure!", but only at learning rates
  that also broke the rest of the reply: BENCHMARKS.md, "Methods compared").
"""
from __future__ import annotations

import copy
import logging
import math
import random
import threading
import time
from dataclasses import dataclass

import torch

from clawrl.config import ClawrlConfig
from clawrl.engines.loading import load_model, resolve_device, resolve_dtype
from clawrl.losses import (PolicyLossConfig, aggregate, aggregation_denominator, combine_advantages, kl_penalty,
                           opd_advantages, policy_loss, token_entropy, token_logprobs, topk_distill_loss,
                           topk_forward_kl, topk_logprobs)
from clawrl.samples import Sample
from clawrl.trainers.base import StepResult, Trainer, TrainerError

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; the trainer trains exactly one
TOPK_KL = ("reverse", "forward")


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
    """(teacher logprobs, top-k ids, top-k logprobs) from ``extra["opd"]``; Nones where absent. A
    top-k of another K than ``topk`` (stored under other settings) is not used."""
    opd = s.extra.get("opd")
    if not opd:
        return None, None, None
    teacher = [float(x) for x in opd["teacher_logprobs"]]
    if len(teacher) != len(s.response_ids):
        raise ValueError(f"sample {s.sample_id}: {len(teacher)} teacher logprobs for {len(s.response_ids)} "
                         "response tokens")
    ids, lps = opd.get("topk_ids"), opd.get("topk_logprobs")
    if topk <= 0 or not ids or len(ids) != len(teacher) or any(len(row) != topk for row in ids):
        return teacher, None, None
    return teacher, ids, lps


def build_micro_batch(samples: list[Sample], device: torch.device, topk: int = 0) -> MicroBatch:
    ids, pos, seg, rows, targets, temps, adv, mask, rollout, cu = [], [], [], [], [], [], [], [], [], [0]
    has_rl, has_opd, teacher, top_ids, top_lps, top_mask = [], [], [], [], [], []
    for k, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        start = len(ids)
        ids += [int(t) for t in s.prompt_ids] + [int(t) for t in s.response_ids]
        pos += range(p + r)
        seg += [k] * (p + r)
        rows += range(start + p - 1, start + p + r - 1)  # logits at t predict token t + 1
        targets += [int(t) for t in s.response_ids]
        temps += [sample_temperature(s)] * r
        adv += [float(s.advantage)] * r
        mask += [1.0] * r if s.loss_mask is None else [float(m) for m in s.loss_mask]
        rollout += [float(x) for x in s.rollout_logprobs]
        cu.append(cu[-1] + r)
        lps, k_ids, k_lps = teacher_signal(s, topk)
        has_rl += [bool(s.extra.get("rl_signal", True))] * r
        has_opd += [lps is not None] * r
        teacher += lps if lps is not None else [math.nan] * r
        top_ids += k_ids if k_ids is not None else [[0] * topk] * r
        top_lps += k_lps if k_lps is not None else [[0.0] * topk] * r
        top_mask += [float(k_ids is not None)] * r

    def t(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    return MicroBatch(
        input_ids=t([ids], torch.long), position_ids=t([pos], torch.long), segment=t(seg, torch.long),
        logit_rows=t(rows, torch.long), targets=t(targets, torch.long), temperature=t(temps),
        advantages=t(adv), loss_mask=t(mask), rollout_logprobs=t(rollout), cu_seqlens=t(cu, torch.long),
        has_rl=t(has_rl, torch.bool), has_opd=t(has_opd, torch.bool), teacher_logprobs=t(teacher),
        topk_ids=t(top_ids, torch.long) if topk > 0 else None, topk_logprobs=t(top_lps) if topk > 0 else None,
        topk_mask=t(top_mask) if topk > 0 else None,
    )


class TorchTrainer(Trainer):
    """See the module docstring. ``device``/``dtype`` override the training device and the
    parameter dtype (default: ``model.device``, float32 master weights); tests use float64."""

    def __init__(self, cfg: ClawrlConfig, model_path: str, *, device: str | None = None,
                 dtype: torch.dtype | None = None):
        train_cfg = cfg.train
        self.train_cfg = train_cfg
        loaded = load_model(model_path, device=device or cfg.model.device, dtype="float32")
        self.device = loaded.device
        # export_weights hands the engine tensors on its own device and dtype
        self.serve_device = resolve_device(cfg.model.device)
        self.serve_dtype = resolve_dtype(cfg.model.dtype, self.serve_device)
        self.param_dtype = dtype or torch.float32
        # bf16 autocast on CUDA; on CPU the arithmetic stays in the parameter dtype (exact tests).
        self.autocast = self.device.type == "cuda"
        model = loaded.model.to(self.param_dtype)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.lora = train_cfg.lora.enabled
        self.ref_model = None
        if self.lora:
            model = self._wrap_lora(model, cfg)
        elif train_cfg.kl_coef > 0:
            # Full fine-tuning moves every weight, so the KL reference must be its own frozen copy.
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if train_cfg.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        band = tuple(train_cfg.icepop_band) if train_cfg.icepop_band is not None else None
        # kl_in_reward: the KL is folded into the advantage instead of being a loss term.
        self.loss_cfg = PolicyLossConfig(
            eps_clip_low=train_cfg.eps_clip_low, eps_clip_high=train_cfg.eps_clip_high,
            dual_clip_c=train_cfg.dual_clip_c, kl_coef=0.0 if train_cfg.kl_in_reward else train_cfg.kl_coef,
            kl_estimator=train_cfg.kl_estimator, entropy_coef=train_cfg.entropy_coef, tis_cap=train_cfg.tis_cap,
            icepop_band=band, aggregation=train_cfg.aggregation)
        # (w_rl, w_opd) per method; see the module docstring
        self.method_weights = {"rl": (1.0, 0.0), "opd": (0.0, 1.0),
                               "combine": (cfg.combine.w_rl, cfg.combine.w_opd)}.get(cfg.method)
        if self.method_weights is None:
            raise TrainerError(f"unknown method '{cfg.method}'; the torch trainer trains rl, opd and combine")
        opd_cfg = cfg.opd
        self.topk = opd_cfg.topk if cfg.method != "rl" and opd_cfg.topk_coef > 0 else 0
        self.topk_coef, self.opd_clip = opd_cfg.topk_coef, opd_cfg.adv_clip
        if opd_cfg.topk_kl not in TOPK_KL:
            raise TrainerError(f"opd.topk_kl must be one of {', '.join(TOPK_KL)}, not {opd_cfg.topk_kl!r}")
        self.topk_kl = opd_cfg.topk_kl
        self.step = 0
        self.bad_steps = 0
        self.paused_reason = None
        self._lock = threading.Lock()  # train_step and export_weights never interleave
        log.info("torch trainer: %s on %s (%s params, %d trainable tensors, %s), micro-batches of %d tokens",
                 loaded.path, self.device, str(self.param_dtype).removeprefix("torch."), len(self.params),
                 f"LoRA r={train_cfg.lora.r}" if self.lora else "full fine-tuning", train_cfg.micro_batch_tokens)

    def _wrap_lora(self, model, cfg: ClawrlConfig):
        import peft

        lora_cfg = cfg.train.lora
        peft_cfg = peft.LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                                   target_modules=list(lora_cfg.target_modules), bias="none")
        with torch.random.fork_rng(devices=[]):  # adapter init from cfg.seed, global RNG untouched
            torch.manual_seed(cfg.seed)
            try:
                return peft.get_peft_model(model, peft_cfg, adapter_name=ADAPTER)
            except ValueError as e:
                raise TrainerError(f"train.lora.target_modules={list(lora_cfg.target_modules)}: "
                                   f"{str(e).splitlines()[0]}") from None

    # ---------------------------------------------------------------- forward

    def _logits(self, model, mb: MicroBatch) -> torch.Tensor:
        """Float32+ logits ``[T, V]`` of the response-predicting positions, scaled by temperature."""
        seg = mb.segment
        mask = None  # one sequence: the model's own causal attention (no [L, L] mask to hold)
        if int(seg[-1]) > 0:
            causal = torch.ones(len(seg), len(seg), dtype=torch.bool, device=seg.device).tril()
            mask = (causal & (seg[:, None] == seg[None, :]))[None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mask,
                        logits_to_keep=mb.logit_rows, use_cache=False)
        logits = out.logits[0].to(torch.promote_types(out.logits.dtype, torch.float32))
        if bool((mb.temperature != 1.0).any()):
            logits = logits / mb.temperature.to(logits.dtype)[:, None]
        return logits

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if self.lora:
            with self.model.disable_adapter():
                return token_logprobs(self._logits(self.model, mb), mb.targets)
        return token_logprobs(self._logits(self.ref_model, mb), mb.targets)

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token logprobs of each sample under the current weights (no update)."""
        with self._lock:
            for s in samples:
                check_sample(s, self.vocab_size)
            out: list[list[float]] = []
            self.model.eval()
            with torch.no_grad():
                for group in pack(samples, self.train_cfg.micro_batch_tokens):
                    mb = build_micro_batch([samples[i] for i in group], self.device)
                    lps = token_logprobs(self._logits(self.model, mb), mb.targets).tolist()
                    cu = mb.cu_seqlens.tolist()
                    out += [lps[a:b] for a, b in zip(cu[:-1], cu[1:])]
            return out

    # ---------------------------------------------------------------- the step

    def train_step(self, samples: list[Sample], weight_version: int) -> StepResult:
        with self._lock:
            return self._train_step(samples, weight_version)

    def _train_step(self, samples: list[Sample], weight_version: int) -> StepResult:
        if self.paused_reason:
            return StepResult(False, {}, "paused")
        if not samples:
            return StepResult(False, {}, "no_trainable_tokens")
        for s in samples:
            check_sample(s, self.vocab_size)
        started = time.perf_counter()
        train_cfg, mode = self.train_cfg, self.loss_cfg.aggregation
        batches = [build_micro_batch([samples[i] for i in g], self.device, self.topk)
                   for g in pack(samples, train_cfg.micro_batch_tokens)]
        opd_metrics = self._apply_method_advantages(batches)
        metrics = {**self._sample_metrics(samples, weight_version, batches), **opd_metrics}
        denominator = sum(aggregation_denominator(mb.loss_mask, mb.cu_seqlens, mode) for mb in batches)
        if denominator <= 0:
            return StepResult(False, metrics, "no_trainable_tokens")

        # pi_old (and the reference) under the weights as they are, before any gradient.
        self.model.eval()
        olds, refs, gaps, entropy_sum = [], [], [], 0.0
        with torch.no_grad():
            for mb in batches:
                logits = self._logits(self.model, mb)
                old = token_logprobs(logits, mb.targets)
                entropy_sum += float((token_entropy(logits) * mb.loss_mask).sum())
                olds.append(old)
                refs.append(self._reference_logprobs(mb) if train_cfg.kl_coef > 0 else None)
                gaps.append(((old - mb.rollout_logprobs).abs() * mb.loss_mask).max())
        trained = float(sum(float(mb.loss_mask.sum()) for mb in batches))
        metrics["entropy"] = entropy_sum / max(trained, 1.0)
        metrics["rollout_logprob_gap_max"] = float(torch.stack(gaps).max())

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, sums = 0.0, {}
        for mb, old, ref in zip(batches, olds, refs):
            logits = self._logits(self.model, mb)
            lp = token_logprobs(logits, mb.targets)
            entropy = token_entropy(logits) if train_cfg.entropy_coef != 0 else None
            advantages = mb.advantages
            if train_cfg.kl_in_reward and ref is not None:
                advantages = advantages - train_cfg.kl_coef * kl_penalty(old, ref, train_cfg.kl_estimator)
            loss, m = policy_loss(lp, old, advantages, mb.loss_mask, mb.cu_seqlens, self.loss_cfg,
                                  rollout_logprobs=mb.rollout_logprobs, ref_logprobs=ref, entropy=entropy,
                                  global_denominator=denominator)
            if mb.topk_mask is not None and bool((mb.topk_mask * mb.loss_mask).any()):
                distill_mask = mb.topk_mask * mb.loss_mask
                # the teacher's top-k is at temperature 1: undo the sample's temperature
                kl = self._topk_kl(logits * mb.temperature.to(logits.dtype)[:, None], mb.topk_ids, mb.topk_logprobs)
                loss = loss + self.topk_coef * aggregate(kl, distill_mask, mb.cu_seqlens, mode,
                                                         global_denominator=denominator)
                sums["topk_kl_sum"] = sums.get("topk_kl_sum", 0.0) + float((kl.detach() * distill_mask).sum())
                sums["topk_tokens"] = sums.get("topk_tokens", 0.0) + float(distill_mask.sum())
            if not torch.isfinite(loss):
                return self._skip(metrics, "nonfinite_loss")
            loss.backward()
            loss_total += float(loss.detach())
            weight = float(m["trained_tokens"])
            for k, v in m.items():
                if k == "pg_loss":
                    sums[k] = sums.get(k, 0.0) + float(v)
                elif k != "trained_tokens":
                    sums[k] = sums.get(k, 0.0) + float(v) * weight
        topk_kl, topk_tokens = sums.pop("topk_kl_sum", None), sums.pop("topk_tokens", 0.0)
        for k, v in sums.items():
            metrics[k] = v if k == "pg_loss" else v / max(trained, 1.0)
        if topk_kl is not None:
            metrics["topk_kl"] = topk_kl / max(topk_tokens, 1.0)
        metrics["rollout_logprob_gap_mean"] = metrics.pop("rollout_logprob_abs_gap")
        metrics["loss"] = loss_total

        clip = train_cfg.grad_clip if train_cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        metrics["grad_norm"] = grad_norm
        if not math.isfinite(grad_norm):
            return self._skip(metrics, "nonfinite_grad")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.bad_steps = 0
        metrics.update(step=self.step, lr=self.optimizer.param_groups[0]["lr"],
                       step_seconds=time.perf_counter() - started)
        return StepResult(True, metrics, None)

    def _topk_kl(self, logits: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """Per-token top-k KL in the direction ``opd.topk_kl`` names (module docstring)."""
        if self.topk_kl == "reverse":
            return topk_distill_loss(logits, ids, teacher)
        student = topk_logprobs(logits, ids)
        return topk_forward_kl(student, teacher)

    def _apply_method_advantages(self, batches: list[MicroBatch]) -> dict:
        """Per-token advantages for ``cfg.method`` (module docstring), in place: ``advantages``
        becomes the combined advantage and ``loss_mask`` drops tokens of samples with no signal."""
        w_rl, w_opd = self.method_weights
        counts = {"rl": 0, "opd": 0, "both": 0}
        opd_sum, opd_tokens = 0.0, 0.0
        for mb in batches:
            has_rl, has_opd = mb.has_rl & (w_rl > 0), mb.has_opd & (w_opd > 0)
            a_opd = opd_advantages(mb.teacher_logprobs, mb.rollout_logprobs, mb.loss_mask, clip=self.opd_clip)
            mb.advantages, trained = combine_advantages(mb.advantages, a_opd, w_rl, w_opd, has_rl, has_opd)
            mb.loss_mask = mb.loss_mask * trained.to(mb.loss_mask.dtype)
            opd_mask = mb.loss_mask * has_opd.to(mb.loss_mask.dtype)
            opd_sum += float((a_opd * opd_mask).sum())
            opd_tokens += float(opd_mask.sum())
            first = mb.cu_seqlens[:-1]  # one token per sequence (responses are never empty)
            for rl, opd in zip(has_rl[first].tolist(), has_opd[first].tolist()):
                if rl or opd:
                    counts["both" if rl and opd else "rl" if rl else "opd"] += 1
        return {"samples_rl_only": counts["rl"], "samples_opd_only": counts["opd"], "samples_both": counts["both"],
                "opd_advantage_mean": opd_sum / opd_tokens if opd_tokens else 0.0, "opd_tokens": opd_tokens}

    def _skip(self, metrics: dict, reason: str) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_steps += 1
        log.warning("train step skipped: %s (%d in a row, limit train.max_bad_steps=%d)",
                    reason, self.bad_steps, self.train_cfg.max_bad_steps)
        if self.bad_steps >= self.train_cfg.max_bad_steps:
            self.paused_reason = (f"{self.bad_steps} train steps in a row had a non-finite loss or gradient "
                                  f"(train.max_bad_steps={self.train_cfg.max_bad_steps})")
            log.error("training paused: %s", self.paused_reason)
        metrics["bad_steps"] = self.bad_steps
        return StepResult(False, metrics, reason)

    @staticmethod
    def _sample_metrics(samples: list[Sample], weight_version: int, batches: list[MicroBatch]) -> dict:
        lag = [weight_version - s.oldest_version for s in samples]
        return {
            "samples": len(samples), "micro_batches": len(batches),
            "tokens": sum(mb.num_tokens for mb in batches),
            "trained_tokens": float(sum(float(mb.loss_mask.sum()) for mb in batches)),
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "advantage_mean": sum(s.advantage for s in samples) / len(samples),
            "staleness_mean": sum(lag) / len(lag), "staleness_max": max(lag),
        }

    # ---------------------------------------------------------------- weights and state

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named weights for the engine. With LoRA, ``W + scale * B @ A`` is computed per adapted
        module into a new tensor, so the trainable adapter and the base stay as they are."""
        with self._lock, torch.no_grad():
            if not self.lora:
                state = self.model.state_dict()
            else:
                from peft.tuners.lora import LoraLayer

                base = self.model.get_base_model()
                deltas = {f"{name}.base_layer.weight": module.get_delta_weight(ADAPTER)
                          for name, module in base.named_modules()
                          if isinstance(module, LoraLayer) and ADAPTER in module.lora_A}
                state = {}
                for key, value in base.state_dict().items():
                    if ".lora_" in key:
                        continue
                    if key in deltas:
                        value = value + deltas[key]
                    state[key.replace(".base_layer.", ".")] = value
            return {k: v.detach().to(device=self.serve_device, dtype=self.serve_dtype, copy=True)
                    for k, v in state.items()}

    def _trainable_named(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict:
        with self._lock:
            rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            return {
                "kind": "lora" if self.lora else "full",
                "weights": {n: p.detach().to("cpu", copy=True) for n, p in self._trainable_named().items()},
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "bad_steps": self.bad_steps,
                "rng": rng,
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            kind = "lora" if self.lora else "full"
            if state.get("kind") != kind:
                raise TrainerError(f"checkpoint holds {state.get('kind')} weights but the trainer is set up for "
                                   f"{kind} training (train.lora.enabled={self.lora})")
            params = self._trainable_named()
            weights = state["weights"]
            if set(weights) != set(params):
                missing = sorted(set(params) - set(weights))[:3]
                extra = sorted(set(weights) - set(params))[:3]
                raise TrainerError(f"checkpoint weights do not match the model (missing {missing}, unexpected {extra})")
            with torch.no_grad():
                for name, p in params.items():
                    if weights[name].shape != p.shape:
                        raise TrainerError(f"checkpoint weight {name} has shape {tuple(weights[name].shape)}, "
                                           f"the model {tuple(p.shape)}")
                    p.copy_(weights[name].to(device=p.device, dtype=p.dtype))
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            self.bad_steps = int(state.get("bad_steps", 0))
            rng = state.get("rng") or {}
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if "python" in rng:
                random.setstate(rng["python"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
