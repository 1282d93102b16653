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
   reference policy's logprobs come from the base with LoRA disabled, or a frozen copy. With
   ``train.replay_coef > 0`` that reference first writes its own reply to each distinct prompt of
   the step, trained as a sequence of its own with token NLL (``clawrl.trainers.replay``).
3. The aggregation denominator is computed for the whole step first, then each micro-batch's loss
   is divided by it and back-propagated, so the accumulated gradient does not depend on how the
   samples were split (``clawrl.losses.aggregate``).
4. A non-finite loss or gradient skips the step (no optimizer step, no new version); after
   ``train.max_bad_steps`` in a row the trainer sets ``paused_reason``.

Per-token advantages come from the run's method (``cfg.method``, ``clawrl.methods``): ``rl`` trains
each sample's scalar advantage, ``opd`` the teacher's logprob gap on the sampled tokens under the
hinted prompt (``Sample.teacher``), ``combine`` both (``clawrl.methods.signals`` explains the rule).
When the method carries the teacher's top-k (``Method.topk``: ``opd.topk > 0`` and ``opd.topk_coef >
0``), ``opd.topk_coef`` times a top-k KL between the student and the teacher's top-k distribution (K
bins plus the tail; on temperature-1 logits like the teacher's) is added over the OPD samples' tokens,
aggregated with the same global denominator. ``opd.topk_kl=reverse`` is ``topk_distill_loss``
(mode-seeking; its gradient on a token is scaled by the student's own probability of it, so it cannot
raise a token the student never says); ``forward`` is KL(teacher || student), which pulls the student
onto what the teacher would say (on the embedded model it taught the never-sampled opener "Sure!", but
only at learning rates that also broke the rest of the reply: BENCHMARKS.md, "Methods compared").
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import threading
import time

import torch

from clawrl.config import ClawrlConfig
from clawrl.engines.hybrid import is_hybrid
from clawrl.engines.loading import load_model, resolve_device, resolve_dtype
from clawrl.losses import aggregation_denominator, token_logprobs
from clawrl.losses.logits import DEFAULT_CHUNK
from clawrl.methods.registry import load_method
from clawrl.samples import Sample
from clawrl.trainers.base import StepResult, Trainer, TrainerError
from clawrl.trainers import compiled_layers, fused_clip, linear_attention, packed_attention
from clawrl.trainers.batching import (MicroBatch, build_micro_batch, check_sample, pack, sample_metrics,
                                     trained_mask)
from clawrl.trainers.master_weights import MasterWeights
from clawrl.trainers.objective import FullLogits, Objective, StepStats, host_floats, pi_old
from clawrl.trainers.replay import attach_replays

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; the trainer trains exactly one
PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # train.param_dtype, besides "auto"
__all__ = ["TorchTrainer", "pack"]


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a train-mode forward can differ from an eval-mode one: a dropout module with p > 0, or
    a config dropout rate (attention dropout is applied functionally, from the config)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    return any(k.endswith("dropout") and isinstance(v, (int, float)) and v > 0 for k, v in rates.items())


class TorchTrainer(Trainer):
    """See the module docstring. ``device``/``dtype`` override the training device and the
    parameter dtype (default: ``model.device`` and ``train.param_dtype``); tests use float64."""

    def __init__(self, cfg: ClawrlConfig, model_path: str, *, device: str | None = None,
                 dtype: torch.dtype | None = None):
        train_cfg = cfg.train
        self.train_cfg = train_cfg
        loaded = load_model(model_path, device=device or cfg.model.device, dtype="float32")
        self.device = loaded.device
        # export_weights hands the engine tensors on its own device and dtype
        self.serve_device = resolve_device(cfg.model.device)
        self.serve_dtype = resolve_dtype(cfg.model.dtype, self.serve_device)
        self.param_dtype = dtype or self._param_dtype(train_cfg.param_dtype)
        # float32 parameters train under bf16 autocast on CUDA; on CPU the arithmetic stays in the
        # parameter dtype (exact tests); bf16 parameters need no autocast.
        self.autocast = self.device.type == "cuda" and self.param_dtype == torch.float32
        model = loaded.model.to(self.param_dtype)
        self.attention_before = getattr(model.config, "_attn_implementation", None) or "sdpa"
        # A hybrid linear-attention model (Qwen3-Next, Qwen3.5) trains one sequence per row: HF's
        # Gated DeltaNet layers take no sequence bounds (their conv and recurrent state would run
        # from one packed sequence into the next), so ``_hybrid_logits`` right-pads the micro-batch's
        # sequences into rows instead of packing them into one.
        self.hybrid = is_hybrid(model)
        self.linear_kernels = linear_attention.training_kernels(cfg.model.linear_attention, self.device) \
            if self.hybrid else None
        # HF's kernel functions to rebind over each train step and forward, found once (torch_kernels)
        self._torch_kernels = linear_attention.kernel_bindings(model) if self.linear_kernels == "torch" else None
        self.packed = False if self.hybrid else packed_attention.enable(model)  # before the reference copy
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.lora = train_cfg.lora.enabled
        self.ref_model = None
        if self.lora:
            model = self._wrap_lora(model, cfg)
        elif train_cfg.kl_coef > 0 or train_cfg.replay_coef > 0:
            # Full fine-tuning moves every weight, so the reference (the KL's, the replay's) must be its own
            # frozen copy.
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if train_cfg.gradient_checkpointing:
            # transformers renamed it (5.2x); the GPU image's 5.17 has the old name only
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable(**{"activation_checkpointing_kwargs" if enable.__name__.startswith("activation") else
                      "gradient_checkpointing_kwargs": {"use_reentrant": False}})
        model.config.use_cache = False
        # train.compile also fuses the passes over the [tokens, vocab] logits (clawrl.losses.logits)
        self.fused_logits = compiled_layers.wanted(train_cfg.compile, self.device)
        self.compiled = compiled_layers.compile_layers(model, train_cfg.compile_scope, self.hybrid) if (
            self.fused_logits) else 0
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # bf16 parameters step through float32 masters (master_weights explains why)
        self.masters = MasterWeights(self.params) if self.param_dtype == torch.bfloat16 else None
        stepped = self.masters.master if self.masters else self.params
        # one fused kernel per step on CUDA; on CPU the default (for-each) implementation
        self.optimizer = torch.optim.AdamW(stepped, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                                           fused=self.device.type == "cuda" or None)
        # One optimizer step per train step, so the weights that compute pi_old are those the loss's
        # forward runs with: without dropout (train mode == eval mode) and without a reference model
        # to run, pi_old is that forward's detached logprobs, and the separate no-grad pass is saved.
        self.method = load_method(cfg)
        self.objective = Objective(cfg, topk=self.method.topk)
        self.pi_old_from_loss_forward = not self.objective.needs_reference and not has_dropout(model)
        # train.replay_coef: the reference's replies end as the engine's do; sampled ones are seeded per step
        self.eos_ids, self.max_context, self.seed = frozenset(loaded.eos_token_ids), loaded.max_context, cfg.seed
        self.step = 0
        self.bad_steps = 0
        self.paused_reason = None
        self._lock = threading.Lock()  # train_step and export_weights never interleave
        log.info("torch trainer: %s on %s (%s params%s, %d trainable tensors, %s), micro-batches of %d tokens, "
                 "%s attention, pi_old %s",
                 loaded.path, self.device, str(self.param_dtype).removeprefix("torch."),
                 " with float32 masters" if self.masters else "", len(self.params),
                 f"LoRA r={train_cfg.lora.r}" if self.lora else "full fine-tuning", train_cfg.micro_batch_tokens,
                 "per-sequence (packed)" if self.packed else
                 "one row per sequence (hybrid linear attention)" if self.hybrid else "block-masked",
                 "from the loss's forward" if self.pi_old_from_loss_forward else "from its own no-grad pass")

    def _param_dtype(self, name: str) -> torch.dtype:
        if name == "auto":
            name = "bfloat16" if self.device.type == "cuda" else "float32"
        return PARAM_DTYPES[name]

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

    def _hybrid_logits(self, model, mb: MicroBatch) -> torch.Tensor:
        """``_logits`` for a hybrid model: its sequences right-padded into rows of one batch (padding
        after a sequence cannot reach its tokens: attention is causal, the recurrence runs forward),
        then the response-predicting positions' hidden states through the LM head."""
        seqs = [(a, b) for a, b in mb.bounds]
        width = max(b - a for a, b in seqs)
        dev = mb.input_ids.device
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
        attn = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
        for i, (a, b) in enumerate(seqs):
            ids[i, : b - a] = mb.input_ids[0, a:b]
            attn[i, : b - a] = 1
        pos = torch.arange(width, device=dev).expand(len(seqs), -1)
        # each kept row (a position of the packed row) as (sequence, position within it)
        starts = torch.tensor([a for a, _ in seqs], device=dev)
        row_seq = torch.searchsorted(starts, mb.logit_rows, right=True) - 1
        row_pos = mb.logit_rows - starts[row_seq]
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with self._linear_kernels(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            hidden = base.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state
            logits = base.lm_head(hidden[row_seq, row_pos])
        if bool((mb.temperature != 1.0).any()):
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / mb.temperature[:, None]
        return logits

    def _logits(self, model, mb: MicroBatch) -> torch.Tensor:
        """Logits ``[T, V]`` of the response-predicting positions, scaled by temperature, in the
        model's output dtype: bf16 ones are never copied whole into float32 (``clawrl.losses.logits``
        works on float32 chunks of them)."""
        if self.hybrid:
            return self._hybrid_logits(model, mb)
        extra, mask = {}, None  # one sequence: the model's own causal attention (no [L, L] mask to hold)
        if self.packed:
            extra[packed_attention.SEGMENTS] = packed_attention.bounds_arg(mb.bounds)
        elif len(mb.bounds) > 1:
            seg = mb.segment
            causal = torch.ones(len(seg), len(seg), dtype=torch.bool, device=seg.device).tril()
            mask = (causal & (seg[:, None] == seg[None, :]))[None, None]
        bare = packed_attention.bare_calls()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mask,
                        logits_to_keep=mb.logit_rows, use_cache=False, **extra)
        if self.packed and len(mb.bounds) > 1 and packed_attention.bare_calls() > bare:
            # the model does not pass keywords down to its attention: its sequences saw each other
            log.warning("%s does not pass %s to its attention; back to block-masked attention",
                        type(model).__name__, packed_attention.SEGMENTS)
            packed_attention.disable(self.model, self.attention_before)
            self.packed = False
            return self._logits(model, mb)
        logits = out.logits[0]
        if bool((mb.temperature != 1.0).any()):  # rare (greedy or T=1 is the rule); divided in float32
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / mb.temperature[:, None]
        return logits

    def _attach_replays(self, samples: list[Sample]) -> float:
        """The frozen reference's own replies to the step's prompts (``clawrl.trainers.replay``) on the
        samples; returns the seconds it took."""
        started = time.perf_counter()
        train_cfg = self.train_cfg
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.step)
        batched = not self.hybrid  # padding would enter a linear-attention layer's recurrent state
        self.model.eval()
        # the reference: under LoRA the base with the adapter off, else the frozen copy
        reference = self.model.disable_adapter() if self.lora else contextlib.nullcontext()
        with reference, torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            attach_replays(self.model if self.lora else self.ref_model, samples, self.eos_ids,
                           train_cfg.replay_max_tokens, self.max_context, train_cfg.replay_temperature, generator,
                           train_cfg.replay_topk, batched)
        return time.perf_counter() - started

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if self.lora:
            with self.model.disable_adapter():
                return token_logprobs(self._logits(self.model, mb), mb.targets, chunk_size=DEFAULT_CHUNK,
                                      fused=self.fused_logits)
        return token_logprobs(self._logits(self.ref_model, mb), mb.targets, chunk_size=DEFAULT_CHUNK,
                              fused=self.fused_logits)

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
                    lps = token_logprobs(self._logits(self.model, mb), mb.targets, chunk_size=DEFAULT_CHUNK,
                                         fused=self.fused_logits).tolist()
                    cu = mb.cu_seqlens.tolist()
                    # the samples' own sequences come first (a hinted reply's sequence follows them)
                    out += [lps[a:b] for a, b in zip(cu[:-1], cu[1:])][:mb.num_samples]
            return out

    # ---------------------------------------------------------------- the step

    def _linear_kernels(self):
        """The pure-torch delta rule for a hybrid's HF layers where ``linear_kernels`` is torch
        (linear_attention.py), else nothing."""
        return linear_attention.torch_kernels(self._torch_kernels) if self._torch_kernels else contextlib.nullcontext()

    def train_step(self, samples: list[Sample], weight_version: int) -> StepResult:
        # the kernels held over the backward too: recomputation (gradient checkpointing) runs forwards there
        with self._lock, self._linear_kernels():
            return self._train_step(samples, weight_version)

    def _train_step(self, samples: list[Sample], weight_version: int) -> StepResult:
        if self.paused_reason:
            return StepResult(False, {}, "paused")
        if not samples:
            return StepResult(False, {}, "no_trainable_tokens")
        for s in samples:
            check_sample(s, self.vocab_size)
        started = time.perf_counter()
        train_cfg, mode = self.train_cfg, self.objective.loss_cfg.aggregation
        replay_s = self._attach_replays(samples) if train_cfg.replay_coef > 0 else None
        batches = [build_micro_batch([samples[i] for i in g], self.device, self.objective.topk)
                   for g in pack(samples, train_cfg.micro_batch_tokens)]
        method_metrics = self.method.advantages(batches)
        metrics = {**sample_metrics(samples, weight_version, batches), **method_metrics}
        if replay_s is not None:
            metrics["replay_seconds"] = replay_s
        denominator = sum(aggregation_denominator(trained_mask(mb), mb.cu_seqlens, mode) for mb in batches)
        if denominator <= 0:
            return StepResult(False, metrics, "no_trainable_tokens")

        # pi_old (and the reference) under the weights as they are, before any gradient: from their own
        # no-grad pass, or (pi_old_from_loss_forward) from the loss's forward of each micro-batch below.
        olds: list[torch.Tensor | None] = [None] * len(batches)
        refs: list[torch.Tensor | None] = [None] * len(batches)
        gaps, entropies = [], []
        if not self.pi_old_from_loss_forward:
            self.model.eval()
            with torch.no_grad():
                for i, mb in enumerate(batches):
                    ops = FullLogits(self._logits(self.model, mb), mb.temperature, self.fused_logits)
                    olds[i], entropy, gap = pi_old(ops, mb)
                    entropies.append(entropy)
                    gaps.append(gap)
                    refs[i] = self._reference_logprobs(mb) if self.objective.needs_reference else None
        trained = float(sum(float(mb.loss_mask.sum()) for mb in batches))

        # The step queues end to end without waiting on the device: the metrics stay device scalars,
        # and a non-finite loss or gradient norm is caught after the fact (_clip_and_step), where the
        # host reads them all at once.
        self.model.train()
        self._zero_grad()
        stats = StepStats()
        for mb, old, ref in zip(batches, olds, refs):
            ops = FullLogits(self._logits(self.model, mb), mb.temperature, self.fused_logits)
            if old is None:  # pi_old is this forward's own logprobs, detached (the loss reads the same ones)
                old, entropy, gap = pi_old(ops, mb)
                entropies.append(entropy)
                gaps.append(gap)
            loss, sums = self.objective.loss(ops, mb, old, ref, denominator)
            loss.backward()
            if self.masters:
                self.masters.accumulate()
            stats.add(loss, sums)
        grad_norm, stepped = self._clip_and_step(torch.isfinite(stats.loss))
        entropy, gap, grad_norm = host_floats([torch.stack(entropies).sum(), torch.stack(gaps).max(), grad_norm])
        metrics["entropy"] = entropy / max(trained, 1.0)
        metrics["rollout_logprob_gap_max"] = gap
        metrics.update(stats.metrics(trained))
        metrics["grad_norm"] = grad_norm
        if not math.isfinite(metrics["loss"]):
            return self._skip(metrics, "nonfinite_loss")
        if not math.isfinite(grad_norm):
            return self._skip(metrics, "nonfinite_grad")
        if not stepped:  # the fused step was queued, and skipped itself where the loss or norm was not finite
            self.optimizer.step()
        if self.masters:
            self.masters.publish()
        self._zero_grad()
        self.step += 1
        self.bad_steps = 0
        metrics.update(step=self.step, lr=self.optimizer.param_groups[0]["lr"],
                       step_seconds=time.perf_counter() - started)
        return StepResult(True, metrics, None)

    def _clip_and_step(self, finite_loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The gradients' norm (a device scalar) and whether the optimizer has stepped already.

        The fused AdamW (CUDA) takes the clip as its ``grad_scale`` (it divides each gradient by
        ``max(norm / train.grad_clip, 1)`` as it reads it, which is the clip's own scaling, saving
        the pass that rewrites every gradient) and skips the update, weight decay included, where
        ``found_inf`` is set: the step is queued before the host knows whether the loss and the norm
        were finite. Otherwise ``clip_grad_norm_`` scales the gradients and the caller steps once
        both are known to be finite."""
        clip = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else float("inf")
        stepped = self.masters.master if self.masters else self.params
        if not fused_clip.fused_adam(self.optimizer):
            return torch.nn.utils.clip_grad_norm_(stepped, clip), False
        norm = fused_clip.arm([self.optimizer], [p.grad for p in stepped if p.grad is not None],
                              self.train_cfg.grad_clip, finite_loss)
        self.optimizer.step()
        return norm, True

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters:
            self.masters.zero_grad()

    def _skip(self, metrics: dict, reason: str) -> StepResult:
        self._zero_grad()
        self.bad_steps += 1
        log.warning("train step skipped: %s (%d in a row, limit train.max_bad_steps=%d)",
                    reason, self.bad_steps, self.train_cfg.max_bad_steps)
        if self.bad_steps >= self.train_cfg.max_bad_steps:
            self.paused_reason = (f"{self.bad_steps} train steps in a row had a non-finite loss or gradient "
                                  f"(train.max_bad_steps={self.train_cfg.max_bad_steps})")
            log.error("training paused: %s", self.paused_reason)
        metrics["bad_steps"] = self.bad_steps
        return StepResult(False, metrics, reason)

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
        """Trainable parameters by name, in ``self.params``' order (the float32 masters', if any)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def _trained_weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: the float32 masters where there are some (a bf16 copy would lose
        the updates still below bf16's precision), else the parameters."""
        named = self._trainable_named()
        if not self.masters:
            return named
        return dict(zip(named, self.masters.master))

    def state_dict(self) -> dict:
        with self._lock:
            rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            return {
                "kind": "lora" if self.lora else "full",
                "weights": {n: p.detach().to("cpu", copy=True) for n, p in self._trained_weights().items()},
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
                if self.masters:
                    self.masters.load(weights, list(params))
            if state.get("optimizer") is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            else:  # an older checkpoint (only the newest keeps it): AdamW starts again
                self.optimizer = torch.optim.AdamW(self.masters.master if self.masters else self.params,
                                                   lr=self.train_cfg.lr, weight_decay=self.train_cfg.weight_decay,
                                                   fused=self.device.type == "cuda" or None)
                log.warning("checkpoint of step %d has no optimizer state (only the newest checkpoint keeps it): "
                            "AdamW restarts with zero moments from its weights", int(state["step"]))
            self.step = int(state["step"])
            self.bad_steps = int(state.get("bad_steps", 0))
            rng = state.get("rng") or {}
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if "python" in rng:
                random.setstate(rng["python"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
