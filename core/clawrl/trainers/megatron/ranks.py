"""``MegatronRanks``: what every trainer rank runs, in lockstep (SPMD).

Every rank receives the same command with the same arguments (the driver's control channel
broadcasts them) and calls the same method; collectives inside keep them in step. Rank 0's return
value is the answer. The process group (``torch.distributed``'s default world) must exist before
construction: ``clawrl.cluster.rank_main`` forms it under torchrun, tests form it themselves.

One train step, for a batch of samples that every rank sees whole:

1. Every rank packs the whole batch the same way: the samples are dealt to data-parallel ranks
   (balanced by tokens), then each rank's share is packed into micro-batches of at most
   ``train.micro_batch_tokens`` tokens. The method's advantages (``cfg.method``, built on every rank
   from the config: ``clawrl.methods``), metrics and the aggregation denominator
   are computed over the whole batch, so they are identical everywhere and equal the torch
   backend's.
2. A forward-only pass through megatron's pipeline schedule gives pi_old (and the reference) on
   the last stage; then forward/backward (1F1B with PP) with the shared ``Objective`` on
   vocab-parallel logits. The schedule divides each micro-batch loss by the number of
   micro-batches and DDP averages gradients over data-parallel ranks; the loss is scaled by both
   so the accumulated gradient is exactly the gradient of the global loss.
3. The megatron optimizer (DDP with the distributed optimizer by default) steps unless the loss or
   the global gradient norm is not finite.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Iterator

import torch
import torch.distributed as dist

from clawrl.cluster.groups import init_model_parallel
from clawrl.config import ClawrlConfig
from clawrl.losses import aggregation_denominator
from clawrl.losses.vocab_parallel import (vocab_parallel_token_entropy, vocab_parallel_token_logprobs,
                                          vocab_parallel_topk_logprobs)
from clawrl.methods.registry import load_method
from clawrl.samples import Sample
from clawrl.trainers.batching import (MicroBatch, build_micro_batch, check_sample, pack, sample_metrics,
                                     trained_mask)
from clawrl.trainers import compiled_layers, fused_clip
from clawrl.trainers.megatron import convert, foreach_kernels, one_graph
from clawrl.trainers.megatron.model import build_gpt, layer_spec_kind, packed_forward, transformer_config
from clawrl.trainers.objective import FullLogits, Objective, StepStats, VocabOps, host_floats, pi_old

log = logging.getLogger(__name__)
# megatron-core warns once per import, in every rank, that apex/transformer-engine are missing; the
# backend says which layer spec it uses in its own start line instead.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")


class ShardLogits:
    """``VocabOps`` over this rank's vocabulary shard ``[T, V/tp]`` (already temperature-scaled)."""

    def __init__(self, logits: torch.Tensor, temperature: torch.Tensor, vocab_start: int, group):
        self.logits, self.temperature, self.vocab_start, self.group = logits, temperature, vocab_start, group
        self._logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # (targets, their logprobs)

    def logprobs(self, targets: torch.Tensor) -> torch.Tensor:
        """Memoised per ``targets``: pi_old taken from the loss's forward and the loss itself read
        the same logprobs, and the pass over the ``[T, V/tp]`` logits runs once."""
        if self._logprobs is None or self._logprobs[0] is not targets:
            self._logprobs = (targets, vocab_parallel_token_logprobs(self.logits, targets, self.vocab_start, self.group))
        return self._logprobs[1]

    def entropy(self) -> torch.Tensor:
        return vocab_parallel_token_entropy(self.logits, self.group)

    def logprobs_and_entropy(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two passes over the shard (the vocabulary-parallel functions are separate), entropy detached."""
        with torch.no_grad():
            entropy = self.entropy()
        return self.logprobs(targets), entropy

    def topk_logprobs_t1(self, ids: torch.Tensor) -> torch.Tensor:
        unscaled = self.logits * self.temperature.to(self.logits.dtype)[:, None]
        return vocab_parallel_topk_logprobs(unscaled, ids, self.vocab_start, self.group)


def deal_to_ranks(samples: list[Sample], ranks: int) -> list[list[int]]:
    """Sample indices per data-parallel rank: longest first onto the least-loaded rank (by tokens),
    each rank's share kept in batch order. Deterministic, so every rank computes the same split."""
    order = sorted(range(len(samples)), key=lambda i: -(len(samples[i].prompt_ids) + len(samples[i].response_ids)))
    load, shares = [0] * ranks, [[] for _ in range(ranks)]
    for i in order:
        r = min(range(ranks), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += len(samples[i].prompt_ids) + len(samples[i].response_ids)
    return [sorted(s) for s in shares]


class MegatronRanks:
    """See the module docstring. ``dtype`` overrides the parameter dtype (default: float32 on CPU,
    bfloat16 with float32 main weights on CUDA)."""

    def __init__(self, cfg: ClawrlConfig, model_path: str | None = None, dtype: torch.dtype | None = None):
        model_path = model_path or cfg.model.path
        if not model_path:
            raise RuntimeError("MegatronRanks needs a model directory (model.path; the driver resolves the default)")

        if not dist.is_initialized():
            raise RuntimeError("MegatronRanks needs torch.distributed initialised (torchrun or a test harness)")
        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            from clawrl.trainers.megatron import cpu_shims

            cpu_shims.install()
        foreach_kernels.install()
        self.cfg, self.train_cfg = cfg, cfg.train
        cluster = cfg.cluster
        self.arch = convert.read_arch(model_path)
        self.ps = ps = init_model_parallel(cluster.tp, cluster.pp)
        self.tp, self.pp = cluster.tp, cluster.pp
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        if self.cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            torch.manual_seed(cfg.seed)
            model_parallel_cuda_manual_seed(cfg.seed)
        else:
            from clawrl.trainers.megatron.cpu_shims import seed_cpu

            seed_cpu(cfg.seed, self.tp_rank)
        self.dtype = dtype or (torch.bfloat16 if self.cuda else torch.float32)
        self.config = transformer_config(self.arch, self.tp, self.pp, self.dtype, self.cuda,
                                         recompute=cfg.train.gradient_checkpointing)
        self.te = layer_spec_kind() == "transformer-engine"
        self.gpt = self._load_gpt(model_path)
        # train.compile (auto: on a GPU only): each layer, whole or its norms and MLP (train.compile_scope;
        # transformer-engine's spec, never run here, its parts only), and the passes over the logits at
        # tp=1 (FullLogits). BENCHMARKS.md has what each saves.
        self.fused_logits = compiled_layers.wanted(cfg.train.compile, self.device)
        if self.fused_logits:
            one_graph.install()
        self.compiled = compiled_layers.compile_megatron_layers(
            self.gpt, "parts" if self.te else cfg.train.compile_scope) if self.fused_logits else 0
        self.ref_gpt = None
        self.method = load_method(cfg)
        self.objective = Objective(cfg, topk=self.method.topk)
        if self.objective.needs_reference:
            # Full fine-tuning moves every weight: the KL reference is a frozen copy of the start.
            self.ref_gpt = self._load_gpt(model_path).eval().requires_grad_(False)
        # As in the torch trainer: one optimizer step per train step and no dropout (the config sets
        # none), so the weights that compute pi_old are those the loss's forward runs; without a KL
        # reference that needs its own pass anyway, pi_old is that forward's detached logprobs.
        self.pi_old_from_loss_forward = self.ref_gpt is None
        self.model, self.optimizer = self._wrap_for_training(self.gpt)
        self.vocab_start = self.tp_rank * (self.arch.vocab // self.tp)
        self.coords = self._all_coords()
        self.step = 0
        self.bad_steps = 0
        self.paused_reason: str | None = None
        self.keep_grads_once, self.kept_grads = False, None
        self._sender = None  # weight-sync sender on rank 0, kept while its group works
        if dist.get_rank() == 0:
            log.info("megatron trainer: %s, %s spec, tp=%d pp=%d dp=%d, %s, %s optimizer", model_path,
                     layer_spec_kind(), self.tp, self.pp, self.dp, str(self.dtype).removeprefix("torch."),
                     "distributed" if cluster.distributed_optimizer else "replicated")

    # ---------------------------------------------------------------- setup

    def _load_gpt(self, model_path: str):
        gpt = build_gpt(self.arch, self.config, self.first_stage, self.last_stage)
        state = convert.load_stage(self.arch, convert.HFTensors(model_path).get, self.pp_rank, self.pp, self.tp,
                                   self.tp_rank, te_names=self.te)
        missing, unexpected = gpt.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise convert.ConversionError(f"weights do not fit the megatron model: missing {missing[:3]}, "
                                          f"unexpected {list(unexpected)[:3]}")
        return gpt.to(self.device)

    def _wrap_for_training(self, gpt):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        distributed = self.cfg.cluster.distributed_optimizer
        ddp = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=distributed),
            module=gpt)
        train = self.train_cfg
        opt_cfg = OptimizerConfig(optimizer="adam", lr=train.lr, weight_decay=train.weight_decay, adam_beta1=0.9,
                                  adam_beta2=0.999, adam_eps=1e-8, clip_grad=train.grad_clip,
                                  bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                                  use_distributed_optimizer=distributed)
        optimizer = get_megatron_optimizer(opt_cfg, [ddp])
        if self.cuda:
            self._fuse_adam(optimizer)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = ddp.no_sync
        return ddp, optimizer

    @staticmethod
    def _fuse_adam(optimizer) -> None:
        """Without transformer-engine or apex, megatron steps with torch's Adam in its default for-each
        form: a dozen kernels over every float32 main weight and moment. Torch's fused form (what the
        torch trainer steps with) is one kernel, with the same update; its ``fused`` is read from each
        parameter group at every step, and it keeps each step count on the device (a restored
        for-each state keeps them on the host)."""
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(part, "optimizer", None)
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                for group in inner.param_groups:
                    group.update(fused=True, foreach=False)
                    for p in group["params"]:
                        state = inner.state.get(p, {})
                        if "step" in state and state["step"].device != p.device:
                            state["step"] = state["step"].to(p.device, torch.float32)

    @staticmethod
    def clip(optimizer, clip: float) -> float:
        """The gradients' norm, taken once, and the clip to ``clip`` (0: none) applied. Where each inner
        optimizer is torch's fused Adam (``_fuse_adam``, on a GPU), the clip goes in as its
        ``grad_scale``: it divides each gradient by ``max(norm / clip, 1)`` as it reads it, which is
        megatron's clip without its pass rewriting every float32 main gradient (3.8 ms of an H200
        step at 8 x 2048). A non-finite norm clips nothing that is kept: the step is skipped."""
        if clip <= 0:
            return float(optimizer.get_grad_norm())
        inners = [getattr(part, "optimizer", None) for part in getattr(optimizer, "chained_optimizers", [optimizer])]
        if not inners or not all(fused_clip.fused_adam(o) for o in inners):
            return float(optimizer.clip_grad_norm(clip))  # returns the norm it clipped by
        norm = float(optimizer.get_grad_norm())
        scale = fused_clip.grad_scale(torch.tensor(norm if math.isfinite(norm) else 0.0), clip)
        for inner in inners:
            inner.grad_scale = scale
        return norm

    def _all_coords(self) -> list[tuple[int, int, int]]:
        """(pp, tp, dp) of every global rank, so any rank can find a parameter's owner."""
        coords = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (self.pp_rank, self.tp_rank, self.dp_rank))
        return coords

    def _rank_of(self, pp: int, tp: int, dp: int) -> int:
        return self.coords.index((pp, tp, dp))

    # ---------------------------------------------------------------- batches

    def _batches(self, samples: list[Sample]) -> list[list[MicroBatch]]:
        """Micro-batches of every data-parallel rank (identical on every rank).

        With transformer-engine's spec, attention applies its own causal mask and ignores the
        block-diagonal one ``packed_forward`` passes, so packed sequences would see each other:
        there, every sample is a micro-batch of its own (no packing) until the THD packed path
        has run on a machine with transformer-engine."""
        out = []
        for share in deal_to_ranks(samples, self.dp):
            mine = [samples[i] for i in share]
            groups = [[i] for i in range(len(mine))] if self.te else pack(mine, self.train_cfg.micro_batch_tokens)
            out.append([build_micro_batch([mine[i] for i in g], self.device, self.objective.topk) for g in groups])
        return out

    @staticmethod
    def _idle_batch(like: MicroBatch) -> MicroBatch:
        """A data-parallel rank with no sample still joins the collectives: one micro-batch that
        trains nothing (its loss mask is zero)."""
        from dataclasses import replace

        return replace(like, loss_mask=torch.zeros_like(like.loss_mask), hinted_weight=None)

    def _run(self, model, batches: list[MicroBatch], loss_fn, forward_only: bool) -> list[dict]:
        """Megatron's schedule (1F1B with PP) over ``batches``; ``loss_fn(logits, mb)`` runs on the
        last stage and returns ``(loss, info)``; the infos come back in micro-batch order."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, module):
            mb = next(data_iterator)
            gpt = module.module if hasattr(module, "module") else module
            out = packed_forward(gpt, mb.input_ids, mb.position_ids, mb.segment, mb.logit_rows, mb.bounds)
            if not self.last_stage:
                return out, None
            return out, lambda logits: loss_fn(logits, mb)

        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
            seq_length=max(mb.num_tokens for mb in batches), micro_batch_size=1, forward_only=forward_only) or []

    def _ops(self, logits: torch.Tensor, mb: MicroBatch) -> VocabOps:
        """``VocabOps`` over the last stage's logits of ``mb``. With the vocabulary in one shard (tp=1),
        the torch trainer's ``FullLogits`` on the model's own (bf16 on a GPU) logits: chunked passes that
        keep no float32 ``[T, V]`` copy (10 GB for 16k tokens of a 150k vocabulary); split over TP
        ranks, ``ShardLogits`` on float32 shards, whose sums cross the ranks."""
        if self.tp == 1:
            unit = not bool((mb.temperature != 1.0).any())
            return FullLogits(logits if unit else self._scaled_logits(logits, mb), mb.temperature, self.fused_logits)
        return ShardLogits(self._scaled_logits(logits, mb), mb.temperature, self.vocab_start, self.tp_group)

    def _scaled_logits(self, logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if bool((mb.temperature != 1.0).any()):
            logits = logits / mb.temperature.to(logits.dtype)[:, None]
        return logits

    # ---------------------------------------------------------------- commands

    def logprobs(self, samples: list[Sample]) -> list[list[float]] | None:
        """Per-response-token logprobs of each sample under the current weights, in sample order
        (every data-parallel rank scores its share; rank 0 returns them all)."""
        for s in samples:
            check_sample(s, self.arch.vocab)
        shares = deal_to_ranks(samples, self.dp)
        batches = self._batches(samples)
        mine = batches[self.dp_rank] or [self._idle_batch(next(b for bs in batches for b in bs))]
        self.model.eval()
        with torch.no_grad():
            infos = self._run(self.model, mine, lambda logits, mb: (
                logits.sum() * 0, {"lp": self._ops(logits, mb).logprobs(mb.targets).cpu(),
                                   "cu": mb.cu_seqlens.tolist(), "n": mb.num_samples}), forward_only=True)
        local = []
        if self.last_stage and self.tp_rank == 0 and batches[self.dp_rank]:
            for info in infos:
                lps, cu = info["lp"].tolist(), info["cu"]
                local += [lps[a:b] for a, b in zip(cu[:-1], cu[1:])][:info["n"]]  # not a hinted reply's
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.pp_rank, self.tp_rank, self.dp_rank, local))
        out: list = [None] * len(samples)
        for pp, tp, dp, values in gathered:
            if pp == self.pp - 1 and tp == 0 and values:
                for i, v in zip(shares[dp], values):
                    out[i] = v
        return out if dist.get_rank() == 0 else None

    def train_step(self, samples: list[Sample], weight_version: int) -> dict:
        """One optimizer step; returns ``StepResult`` fields (``ok``, ``metrics``, ``skipped_reason``)."""
        if self.paused_reason:
            return {"ok": False, "metrics": {}, "skipped_reason": "paused"}
        if not samples:
            return {"ok": False, "metrics": {}, "skipped_reason": "no_trainable_tokens"}
        for s in samples:
            check_sample(s, self.arch.vocab)
        started = time.perf_counter()
        mode = self.objective.loss_cfg.aggregation
        per_rank = self._batches(samples)
        everything = [mb for bs in per_rank for mb in bs]
        method_metrics = self.method.advantages(everything)  # sets advantages and masks, over the whole batch
        metrics = {**sample_metrics(samples, weight_version, everything), **method_metrics,
                   "micro_batches": max(len(bs) for bs in per_rank)}
        denominator = sum(aggregation_denominator(trained_mask(mb), mb.cu_seqlens, mode) for mb in everything)
        if denominator <= 0:
            return {"ok": False, "metrics": metrics, "skipped_reason": "no_trainable_tokens"}
        mine = per_rank[self.dp_rank] or [self._idle_batch(everything[0])]
        trained = float(sum(float(mb.loss_mask.sum()) for mb in everything))

        # pi_old (and the reference) on the last stage, before any gradient: from their own no-grad
        # pass, or (pi_old_from_loss_forward) from the loss's forward of each micro-batch below.
        def old_info(ops: VocabOps, mb: MicroBatch) -> dict:
            old, entropy_sum, gap = pi_old(ops, mb)
            return {"old": old, "entropy_sum": entropy_sum, "gap": gap}

        old_infos: list[dict] = []
        self.model.eval()
        with torch.no_grad():
            if not self.pi_old_from_loss_forward:
                old_infos = self._run(self.model, mine, lambda logits, mb: (logits.sum() * 0, old_info(
                    self._ops(logits, mb), mb)), forward_only=True)
            ref_infos = (self._run(self.ref_gpt, mine, lambda logits, mb: (logits.sum() * 0, {"old": self._ops(
                logits, mb).logprobs(mb.targets)}), forward_only=True) if self.ref_gpt is not None else [])
        olds = [i["old"] for i in old_infos] or [None] * len(mine)
        refs = [i["old"] for i in ref_infos] or [None] * len(olds)

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = StepStats()
        scale = float(len(mine) * self.dp)  # undo the schedule's 1/micro-batches and DDP's 1/dp
        position = iter(range(len(mine)))

        def train_pass(logits, mb):
            k = next(position)
            ops = self._ops(logits, mb)
            old = olds[k]
            if old is None:  # pi_old is this forward's own logprobs, detached
                old_infos.append(old_info(ops, mb))
                old = old_infos[-1]["old"]
            loss, sums = self.objective.loss(ops, mb, old, refs[k], denominator)
            stats.add(loss, sums)
            return loss * scale, {}

        self._run(self.model, mine, train_pass, forward_only=False)
        if self.keep_grads_once:
            # parity checks read the reduced gradients before the optimizer touches them
            self.kept_grads = {n: t.cpu() for n, t in self.iter_hf_weights(grads=True)}
            self.keep_grads_once = False

        self.optimizer.prepare_grads()
        queued = self._queue_step(stats)  # one rank: the norm, the clip and the step, before any host read

        # Metrics live on the last stage's first TP rank of each data-parallel rank: sum them.
        # (the device scalars read in one transfer)
        entropy_sum, gap = host_floats([sum(i["entropy_sum"] for i in old_infos),
                                        torch.stack([i["gap"] for i in old_infos]).max() if old_infos else 0.0])
        stats.read()
        local = (stats.loss, stats.sums, entropy_sum, gap)
        owner = self.last_stage and self.tp_rank == 0 and bool(per_rank[self.dp_rank])
        gathered = [local if owner else None]
        if dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local if owner else None)
        total, entropy_sum, gap = StepStats(), 0.0, 0.0
        for item in gathered:
            if item is not None:
                part = StepStats()
                part.add(item[0], item[1])
                total.merge(part)
                entropy_sum += item[2]
                gap = max(gap, item[3])
        metrics["entropy"] = entropy_sum / max(trained, 1.0)
        metrics["rollout_logprob_gap_max"] = gap
        metrics.update(total.metrics(trained))
        if queued is not None:
            metrics["grad_norm"] = float(queued)
        if not math.isfinite(total.loss):  # a queued step skipped itself (found_inf)
            return self._skip(metrics, "nonfinite_loss")
        if queued is None:
            metrics["grad_norm"] = self.clip(self.optimizer, self.train_cfg.grad_clip)
        if not math.isfinite(metrics["grad_norm"]):
            return self._skip(metrics, "nonfinite_grad")
        if queued is None:
            self.optimizer.step_with_ready_grads()
        self.step += 1
        self.bad_steps = 0
        metrics.update(step=self.step, lr=self.train_cfg.lr, step_seconds=time.perf_counter() - started)
        return {"ok": True, "metrics": metrics, "skipped_reason": None}

    def _queue_step(self, stats: StepStats) -> torch.Tensor | None:
        """On a world of one rank whose inner optimizers are all the fused Adam: the gradients' norm
        (a device scalar, returned), the clip as the Adam's ``grad_scale``, and the step, all queued
        without waiting for the device, as the torch trainer steps. The Adam skips its update where
        ``found_inf`` is set: a loss or norm that is not finite, which the host learns afterwards and
        reports as a skipped step. With one rank, no gradient is shared or split, so the norm over the
        inner optimizers' main gradients is megatron's ``get_grad_norm``, without its host read. None
        elsewhere: the caller clips and steps after reading the norm (``clip``)."""
        inners = [getattr(part, "optimizer", None)
                  for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        if dist.get_world_size() > 1 or not inners or not all(fused_clip.fused_adam(o) for o in inners):
            return None
        grads = [p.grad for o in inners for g in o.param_groups for p in g["params"] if p.grad is not None]
        norm = fused_clip.arm(inners, grads, self.train_cfg.grad_clip, torch.isfinite(torch.as_tensor(
            stats.loss, device=self.device)))
        self.optimizer.step_with_ready_grads()
        return norm

    def _skip(self, metrics: dict, reason: str) -> dict:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.bad_steps += 1
        if self.bad_steps >= self.train_cfg.max_bad_steps:
            self.paused_reason = (f"{self.bad_steps} train steps in a row had a non-finite loss or gradient "
                                  f"(train.max_bad_steps={self.train_cfg.max_bad_steps})")
        metrics["bad_steps"] = self.bad_steps
        return {"ok": False, "metrics": metrics, "skipped_reason": reason, "paused_reason": self.paused_reason}

    def clear_pause(self) -> None:
        self.paused_reason = None

    # ---------------------------------------------------------------- weights

    def iter_hf_weights(self, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one Megatron parameter at a time: the owning stage gathers that
        parameter's TP shards, and its first rank sends the HF tensors to global rank 0, which
        yields them. A collective: every rank must exhaust it; only rank 0 yields anything.
        ``grads``: the reduced gradients instead of the weights (parity checks; data parallel 1)."""
        me = dist.get_rank()
        params = dict(self.gpt.named_parameters())
        for entry in convert.plan(self.arch, self.pp, te_names=self.te):
            owner = self._rank_of(entry.stage, 0, 0)
            tensors: list[tuple[str, torch.Tensor]] = []
            if entry.stage == self.pp_rank and self.dp_rank == 0:
                param = params[entry.name]
                local = (param.main_grad if grads else param).detach().to(self.dtype)
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                dist.all_gather(shards, local.contiguous(), group=self.tp_group)
                if self.tp_rank == 0:
                    tensors = list(convert.hf_tensors(entry, self.arch, convert.unshard(entry, shards)))
            if owner == 0:
                if me == 0:
                    yield from tensors
                continue
            for name in entry.hf_names:
                if me == owner:
                    tensor = dict(tensors)[name].contiguous()
                    shape = torch.tensor([tensor.dim(), *tensor.shape] + [0] * (4 - tensor.dim()), dtype=torch.long)
                    dist.send(shape.to(self.device), dst=0)
                    dist.send(tensor, dst=0)
                elif me == 0:
                    shape = torch.zeros(5, dtype=torch.long, device=self.device)
                    dist.recv(shape, src=owner)
                    dims = shape.tolist()[1:1 + int(shape[0])]
                    tensor = torch.empty(dims, dtype=self.dtype, device=self.device)
                    dist.recv(tensor, src=owner)
                    yield name, tensor

    def hf_state(self) -> dict[str, torch.Tensor] | None:
        """The whole HF state on rank 0 (tests and ``check-parallel`` only: it is a full copy)."""
        out = {name: t.cpu() for name, t in self.iter_hf_weights()}
        return out if dist.get_rank() == 0 else None

    def send_weights(self, version: int, endpoint) -> None:
        """Stream the weights to the engine(s) behind ``endpoint`` (``clawrl.weight_transport``):
        every rank joins the per-parameter gathers; rank 0 sends HF-named buckets as they fill."""
        tensors = self.iter_hf_weights()
        if dist.get_rank() != 0:
            for _ in tensors:
                pass
            return
        if self._sender is None or self._sender.endpoint != endpoint:
            if self._sender is not None:
                self._sender.close()
            self._sender = endpoint.open_sender()  # clawrl's receiver, or SGLang's weights-update group
        try:
            self._sender.send(version, tensors)
        except Exception:
            for _ in tensors:  # the other ranks are still gathering: finish the collective walk
                pass
            raise

    # ---------------------------------------------------------------- checkpoints

    def _optimizers(self) -> list:
        """The distributed optimizers inside megatron's ChainedOptimizer (one per parameter group kind)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _layout(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "world": dist.get_world_size(),
                "distributed_optimizer": self.cfg.cluster.distributed_optimizer}

    def state_dict(self) -> dict | None:
        """Every rank's own shard (weights, optimizer), gathered on rank 0 in the ``Trainer`` state
        shape: ``weights`` keyed ``rank<r>/<megatron name>`` and the rest under ``optimizer``."""
        weights = {f"rank{dist.get_rank()}/{k}": v.detach().cpu().clone()
                   for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        # Each rank's own optimizer shard as it is: the inner torch optimizer's state (Adam moments
        # and steps of the main-parameter shards this rank owns) and, for bf16 models, the float32
        # main parameters. Plain and exact for the same layout; megatron's resharding formats are
        # not used (they do not round-trip with the torch Adam fallback in 0.16).
        optimizer = []
        for part in self._optimizers():
            entry = {"inner": part.optimizer.state_dict()}
            main = getattr(part, "shard_fp32_from_float16_groups", None)
            if main:
                entry["main"] = [[t.detach().cpu().clone() for t in group] for group in main]
            optimizer.append(entry)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (weights, optimizer))
        if dist.get_rank() != 0:
            return None
        return {"kind": "megatron", "layout": self._layout(),
                "weights": {k: v for w, _ in gathered for k, v in w.items()},
                "optimizer": [o for _, o in gathered], "step": self.step, "bad_steps": self.bad_steps,
                "rng": {"torch": torch.get_rng_state()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s result (every rank takes its own part). The layout must be
        the one the checkpoint was written with (resharding is not supported)."""
        if state.get("kind") != "megatron":
            raise ValueError(f"checkpoint holds {state.get('kind')} weights, not a megatron trainer's")
        if state.get("layout") != self._layout():
            raise ValueError(f"checkpoint layout {state.get('layout')} differs from this run's {self._layout()}; "
                             "resume with the same cluster.tp, cluster.pp and number of ranks")
        prefix = f"rank{dist.get_rank()}/"
        mine = {k[len(prefix):]: v for k, v in state["weights"].items() if k.startswith(prefix)}
        missing, unexpected = self.gpt.load_state_dict({k: v.to(self.device) for k, v in mine.items()}, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint shard does not fit rank {dist.get_rank()}: missing {missing[:3]}, "
                             f"unexpected {list(unexpected)[:3]}")
        if state.get("optimizer") is None:  # an older checkpoint (only the newest keeps it)
            reload = getattr(self.optimizer, "reload_model_params", None)
            if reload is not None:  # float32 main parameters from the loaded weights, not the initial ones
                reload()
            if dist.get_rank() == 0:
                log.warning("checkpoint of step %d has no optimizer state (only the newest checkpoint keeps "
                            "it): the optimizer restarts with zero moments from its weights", int(state["step"]))
            self.step, self.bad_steps = int(state["step"]), int(state.get("bad_steps", 0))
            return
        with torch.no_grad():
            for part, entry in zip(self._optimizers(), state["optimizer"][dist.get_rank()]):
                part.optimizer.load_state_dict(entry["inner"])  # its parameter groups' settings too
                for group, saved in zip(getattr(part, "shard_fp32_from_float16_groups", None) or [],
                                        entry.get("main", [])):
                    for target, value in zip(group, saved):
                        target.copy_(value.to(target.device))
        if self.cuda:
            self._fuse_adam(self.optimizer)
        self.step, self.bad_steps = int(state["step"]), int(state.get("bad_steps", 0))
