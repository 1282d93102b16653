"""The torch trainer's speed-ups keep its numbers (CPU, small random Qwen3): packed sequences
attend one at a time exactly as a block mask (and as each sequence alone) does, pi_old taken from
the loss's forward gives the same step as its own pass, and bf16 parameters with float32 masters
take the float32 trainer's step within bf16 tolerance, keep updates below bf16's precision, and
checkpoint their masters."""
from __future__ import annotations

import pytest
import torch

from clawrl.trainers import compiled_layers, packed_attention
from clawrl.trainers.batching import build_micro_batch
from test_trainer import make_samples, model_dir, on_policy, trainer_for  # noqa: F401 (fixture)


def test_packed_attention_equals_the_block_mask_and_each_sequence_alone(model_dir):
    trainer = trainer_for(model_dir, dtype=torch.float64)
    assert trainer.packed
    samples = make_samples(trainer.vocab_size, n=3, seed=5)
    mb = build_micro_batch(samples, trainer.device)
    with torch.no_grad():
        packed = trainer._logits(trainer.model, mb)
        trainer.packed = False  # the block-masked path, on the same model
        masked = trainer._logits(trainer.model, mb)
        trainer.packed = True
        alone = torch.cat([trainer._logits(trainer.model, build_micro_batch([s], trainer.device)) for s in samples])
    torch.testing.assert_close(packed, masked, atol=1e-10, rtol=0)
    torch.testing.assert_close(packed, alone, atol=1e-10, rtol=0)
    # sequences really do not see each other: changing the first one's prompt leaves the others' logits
    samples[0].prompt_ids = [t + 1 for t in samples[0].prompt_ids]
    with torch.no_grad():
        changed = trainer._logits(trainer.model, build_micro_batch(samples, trainer.device))
    first = len(samples[0].response_ids)
    assert not torch.allclose(changed[:first], packed[:first])
    torch.testing.assert_close(changed[first:], packed[first:], atol=1e-10, rtol=0)


def test_varlen_offsets_are_built_once_per_micro_batch_shape():
    """The varlen kernel's sequence offsets are made once per set of lengths and reused by every layer
    (each layer building its own waited on the device)."""
    cpu = torch.device("cpu")
    cu = packed_attention._cu_seqlens([3, 5, 2], cpu)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 8, 10]
    assert packed_attention._cu_seqlens([3, 5, 2], cpu) is cu
    assert packed_attention._cu_seqlens([5, 3, 2], cpu).tolist() == [0, 5, 8, 10]


def test_a_model_that_drops_the_bounds_falls_back_to_the_block_mask(model_dir, monkeypatch, caplog):
    trainer = trainer_for(model_dir, dtype=torch.float64)
    samples = make_samples(trainer.vocab_size, n=3, seed=6)
    mb = build_micro_batch(samples, trainer.device)
    with torch.no_grad():
        reference = trainer._logits(trainer.model, mb)
    forward = trainer.model.forward

    def dropping(*args, **kwargs):  # a model whose layers do not pass keywords down
        kwargs.pop(packed_attention.SEGMENTS, None)
        return forward(*args, **kwargs)
    monkeypatch.setattr(trainer.model, "forward", dropping)
    with torch.no_grad(), caplog.at_level("WARNING"):
        fallback = trainer._logits(trainer.model, mb)
    assert not trainer.packed and "back to block-masked attention" in caplog.text
    torch.testing.assert_close(fallback, reference, atol=1e-10, rtol=0)


def test_pi_old_from_the_loss_forward_gives_the_same_step(model_dir):
    samples = make_samples(400, n=5, seed=7)
    results, weights = {}, {}
    for reuse in (True, False):
        trainer = trainer_for(model_dir, "train.lr=1e-3", "train.micro_batch_tokens=30", "train.kl_coef=0",
                              dtype=torch.float64)
        assert trainer.pi_old_from_loss_forward  # no dropout, no KL reference
        trainer.pi_old_from_loss_forward = reuse
        on_policy(trainer, samples)
        results[reuse] = trainer.train_step(samples, weight_version=0)
        assert results[reuse].ok and results[reuse].metrics["micro_batches"] > 1
        weights[reuse] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for key in ("loss", "entropy", "rollout_logprob_gap_max", "ratio_mean", "grad_norm"):
        assert results[True].metrics[key] == pytest.approx(results[False].metrics[key], rel=1e-9, abs=1e-12), key
    for name, p in weights[False].items():
        torch.testing.assert_close(weights[True][name], p, atol=1e-12, rtol=0, msg=name)


def test_dropout_or_a_kl_reference_keeps_the_separate_pi_old_pass(model_dir):
    assert not trainer_for(model_dir, "train.kl_coef=0.1").pi_old_from_loss_forward
    assert not trainer_for(model_dir, "train.lora.enabled=true", "train.lora.dropout=0.1").pi_old_from_loss_forward


def test_bf16_parameters_with_float32_masters_step_like_float32(model_dir, tmp_path):
    samples = make_samples(400, n=4, seed=8)
    fp32 = trainer_for(model_dir, "train.lr=1e-3", "train.param_dtype=float32")
    bf16 = trainer_for(model_dir, "train.lr=1e-3", "train.param_dtype=bfloat16")
    assert fp32.masters is None and bf16.masters is not None
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in bf16.masters.master} == {torch.float32}
    on_policy(fp32, samples)
    a, b = fp32.train_step(samples, 0), bf16.train_step(samples, 0)
    assert a.ok and b.ok
    assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], rel=0.05, abs=2e-3)
    assert b.metrics["grad_norm"] == pytest.approx(a.metrics["grad_norm"], rel=0.05)
    named = dict(fp32.model.named_parameters())
    for (name, p), m in zip(bf16._trainable_named().items(), bf16.masters.master):
        torch.testing.assert_close(m, named[name].detach(), atol=2e-2, rtol=0, msg=name)  # bf16's rounding of w
        torch.testing.assert_close(p.detach(), m.to(torch.bfloat16), atol=0, rtol=0, msg=name)  # published


def test_updates_below_bf16_precision_accumulate_in_the_masters_and_checkpoint(model_dir):
    trainer = trainer_for(model_dir, "train.lr=1e-6", "train.param_dtype=bfloat16", "train.grad_clip=0")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=4, seed=9))
    start = [m.detach().clone() for m in trainer.masters.master]
    start_bf16 = [p.detach().clone() for p in trainer.params]
    for _ in range(3):
        assert trainer.train_step(samples, trainer.step).ok
    total = sum(s.numel() for s in start)
    # AdamW's first steps move nearly every weight by about lr: the masters hold those moves ...
    moved = sum(int((m.detach() != s).sum()) for m, s in zip(trainer.masters.master, start))
    assert moved > 0.9 * total
    # ... which most bf16 weights (|w| >> 256 * lr) cannot represent: a bf16 optimizer would lose them
    kept = sum(int((p.detach() == s).sum()) for p, s in zip(trainer.params, start_bf16))
    assert kept > 0.5 * total
    state = trainer.state_dict()
    assert {w.dtype for w in state["weights"].values()} == {torch.float32}
    fresh = trainer_for(model_dir, "train.lr=1e-6", "train.param_dtype=bfloat16", "train.grad_clip=0")
    fresh.load_state_dict(state)
    for m, n in zip(fresh.masters.master, trainer.masters.master):
        torch.testing.assert_close(m, n, atol=0, rtol=0)
    a, b = trainer.train_step(samples, 3), fresh.train_step(samples, 3)
    assert a.ok and b.ok and a.metrics["loss"] == b.metrics["loss"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_logprobs_keep_no_float32_copy_and_match_the_plain_path(temperature):
    from clawrl.losses import token_logprobs

    torch.manual_seed(0)
    logits = (torch.randn(37, 101) * 3).to(torch.bfloat16).requires_grad_()
    targets, weights = torch.randint(0, 101, (37,)), torch.randn(37)
    chunked = token_logprobs(logits, targets, temperature=temperature, chunk_size=8)
    assert chunked.grad_fn is not None and "Chunked" in type(chunked.grad_fn).__name__
    (chunked * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    plain = token_logprobs(logits.float(), targets, temperature=temperature)  # the float32 copy, autograd
    (plain * weights).sum().backward()
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad.float(), logits.grad.float(), atol=1e-2, rtol=1e-2)  # bf16 gradients
    assert grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, temperature=0.0)


def test_one_pass_logprobs_and_entropy_equal_the_two_functions():
    from clawrl.losses import token_entropy, token_logprobs
    from clawrl.losses.logits import token_logprobs_and_entropy

    torch.manual_seed(1)
    logits = (torch.randn(29, 97) * 2).to(torch.bfloat16)
    logits[3, 5] = float("-inf")  # a banned token: no NaN in either
    logits.requires_grad_()
    targets = torch.randint(0, 97, (29,))
    targets[3] = 6
    lp, entropy = token_logprobs_and_entropy(logits, targets, chunk_size=7)
    assert not entropy.requires_grad and lp.requires_grad
    torch.testing.assert_close(lp, token_logprobs(logits.detach().float(), targets), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, token_entropy(logits.detach().float()), atol=1e-5, rtol=0)
    lp.sum().backward()
    assert torch.isfinite(logits.grad.float()).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_vocabulary_passes_equal_the_chunked_ones(temperature, monkeypatch):
    """``fused=True`` (train.compile's compiled kernels over the logits, inductor on CPU here): the same
    logprobs, entropies and bf16 gradient as the eager chunked passes, banned tokens included; without
    a gradient too, on bf16 and float32 logits."""
    from clawrl.losses import logits as logits_mod
    from clawrl.losses import token_entropy, token_logprobs
    from clawrl.losses.logits import token_logprobs_and_entropy

    compiled, used = logits_mod._fused, []
    monkeypatch.setattr(logits_mod, "_fused", lambda fn: used.append(fn.__name__) or compiled(fn))
    torch.manual_seed(3)
    base = torch.randn(45, 257) * 3
    base[4, :9] = float("-inf")
    targets, weights = torch.randint(0, 257, (45,)), torch.linspace(-1, 1, 45)
    targets[4] = 20
    out = {}
    for fused in (False, True):
        logits = base.to(torch.bfloat16).requires_grad_()
        lp, entropy = token_logprobs_and_entropy(logits, targets, chunk_size=16, fused=fused)
        scaled = token_logprobs(logits, targets, temperature=temperature, chunk_size=16, fused=fused)
        ((lp + scaled) * weights).sum().backward()
        assert logits.grad.dtype == torch.bfloat16 and not entropy.requires_grad
        out[fused] = [lp, entropy, scaled, logits.grad.float(),
                      token_logprobs(base, targets, temperature=temperature, fused=fused),
                      token_entropy(base, temperature=temperature, fused=fused),
                      *token_logprobs_and_entropy(base, targets, fused=fused)]  # no gradient: one pass for both
    # two forwards, two backwards, two metrics and one pass for both without a gradient
    assert sorted(used) == ["_row_grad"] * 2 + ["_row_stats"] * 5
    for name, eager, fused in zip(("logprobs", "entropy", "scaled", "grad", "fp32 logprobs", "fp32 entropy",
                                   "fp32 logprobs, one pass", "fp32 entropy, one pass"), out[False], out[True]):
        assert torch.isfinite(fused).all(), name
        torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4, msg=name)


def test_full_logits_give_logprobs_and_entropy_in_one_pass_and_the_loss_reads_the_same_logprobs(monkeypatch):
    """``FullLogits.logprobs_and_entropy`` (pi_old and the entropy metric from the loss's forward, in
    both trainers): one chunked pass over bf16 logits, and ``logprobs`` then returns that tensor
    rather than passing over the ``[T, V]`` logits again."""
    from clawrl.losses import token_entropy, token_logprobs
    from clawrl.trainers import objective

    torch.manual_seed(2)
    logits = (torch.randn(23, 61) * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 61, (23,))
    ops = objective.FullLogits(logits, torch.ones(23))
    lp, entropy = ops.logprobs_and_entropy(targets)
    monkeypatch.setattr(objective, "token_logprobs", lambda *a, **k: pytest.fail("a second pass over the logits"))
    assert ops.logprobs(targets) is lp and lp.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(lp, token_logprobs(logits.detach().float(), targets), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, token_entropy(logits.detach().float()), atol=1e-5, rtol=0)
    again, entropy_again = ops.logprobs_and_entropy(targets)  # known logprobs: only the entropy is computed
    assert again is lp
    torch.testing.assert_close(entropy_again, entropy, atol=1e-5, rtol=0)


def test_layers_compiled_whole_take_the_same_step_and_new_lengths_compile_nothing(model_dir):
    """train.compile_scope=layer: the same numbers as eager; each layer is one graph (the packed
    attention is an operator inside it, not a graph break); and since the packed bounds reach it as a
    tensor, a second step with other lengths and another sample count reuses the first step's graphs."""
    first, second = make_samples(400, n=4, seed=11), make_samples(400, n=3, seed=12)
    torch._dynamo.utils.counters.clear()
    assert sorted(len(s.response_ids) for s in first) != sorted(len(s.response_ids) for s in second)
    results = {}
    for mode in ("off", "on"):
        trainer = trainer_for(model_dir, "train.lr=1e-3", f"train.compile={mode}", "train.compile_scope=layer")
        assert trainer.packed and trainer.compiled == (0 if mode == "off" else trainer.model.config.num_hidden_layers)
        on_policy(trainer, first)
        results[mode] = trainer.train_step(first, weight_version=0)
        assert results[mode].ok and results[mode].metrics["micro_batches"] == 1
        on_policy(trainer, second)
        with torch._dynamo.config.patch(error_on_recompile=mode == "on"):
            results[mode, 2] = trainer.train_step(second, weight_version=1)
        assert results[mode, 2].ok
    assert not torch._dynamo.utils.counters["graph_break"]
    for key in ("loss", "entropy", "grad_norm"):
        assert results["on"].metrics[key] == pytest.approx(results["off"].metrics[key], rel=1e-4), key
        assert results["on", 2].metrics[key] == pytest.approx(results["off", 2].metrics[key], rel=1e-3), key
    with pytest.raises(ValueError, match="train.compile_scope must be one of"):
        compiled_layers.compile_layers(trainer.model, "model")


def test_compiled_norms_and_mlp_take_the_same_step(model_dir):
    """train.compile=on with train.compile_scope=parts (inductor on CPU here) changes no number beyond
    float rounding; the parts are compiled in place, so parameter names and the exported weights stay
    the plain model's."""
    from clawrl.trainers import compiled_layers

    samples = make_samples(400, n=4, seed=10)
    results, weights, after = {}, {}, {}
    for mode in ("off", "on"):
        trainer = trainer_for(model_dir, "train.lr=1e-3", "train.micro_batch_tokens=30", f"train.compile={mode}",
                              "train.compile_scope=parts")
        layers = trainer.model.config.num_hidden_layers
        assert trainer.compiled == (0 if mode == "off" else 5 * layers)  # two norms, MLP, q/k norms (Qwen3)
        on_policy(trainer, samples)
        results[mode] = trainer.train_step(samples, weight_version=0)
        assert results[mode].ok and results[mode].metrics["micro_batches"] > 1
        weights[mode] = trainer.export_weights()
        after[mode] = torch.tensor([lp for lps in trainer.logprobs(samples) for lp in lps])
    for key in ("loss", "entropy", "grad_norm"):
        assert results["on"].metrics[key] == pytest.approx(results["off"].metrics[key], rel=1e-4), key
    assert weights["on"].keys() == weights["off"].keys()
    # Adam's first step moves a weight by about lr * sign(g): where g is near zero, float rounding of the
    # fused kernels may flip it, so the weights agree within 2 lr, and the policy they make within 1e-4
    for name, w in weights["off"].items():
        torch.testing.assert_close(weights["on"][name], w, atol=2e-3, rtol=0, msg=name)
    torch.testing.assert_close(after["on"], after["off"], atol=1e-4, rtol=0)
    assert not torch.allclose(after["off"], torch.tensor([lp for s in samples for lp in s.rollout_logprobs]))
    assert compiled_layers.wanted("auto", torch.device("cpu")) is False
    assert compiled_layers.wanted("auto", torch.device("cuda")) is True
    with pytest.raises(ValueError, match="train.compile must be one of"):
        compiled_layers.wanted("yes", torch.device("cpu"))


def _fused(trainer):
    """The trainer's optimizer as CUDA builds it (fused AdamW; fused also runs on CPU)."""
    cfg = trainer.train_cfg
    trainer.optimizer = torch.optim.AdamW(trainer.masters.master if trainer.masters else trainer.params, lr=cfg.lr,
                                          weight_decay=cfg.weight_decay, fused=True)
    return trainer


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_the_fused_step_clips_through_grad_scale_like_clip_grad_norm(model_dir, param_dtype):
    """The fused AdamW divides each gradient by max(norm / clip, 1) as it reads it: the same update as
    clip_grad_norm_ then a step, with no pass rewriting the gradients (clip small enough to act)."""
    samples = make_samples(400, n=5, seed=11)
    weights, metrics = {}, {}
    for fused in (False, True):
        trainer = trainer_for(model_dir, "train.lr=1e-3", "train.grad_clip=0.05", "train.micro_batch_tokens=30",
                              f"train.param_dtype={param_dtype}")
        if fused:
            _fused(trainer)
        on_policy(trainer, samples)
        for step in range(2):
            result = trainer.train_step(samples, step)
            assert result.ok
        metrics[fused] = result.metrics
        weights[fused] = [w.detach().clone() for w in (trainer.masters.master if trainer.masters else trainer.params)]
    assert metrics[True]["grad_norm"] > 0.05 * 10  # the clip acted
    assert metrics[True]["grad_norm"] == pytest.approx(metrics[False]["grad_norm"], rel=1e-5)
    assert metrics[True]["loss"] == pytest.approx(metrics[False]["loss"], rel=1e-5)
    for a, b in zip(weights[True], weights[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_non_finite_loss_leaves_the_fused_step_undone_and_is_reported(model_dir, monkeypatch):
    """The fused step is queued before the host reads the loss: found_inf must undo it whole (weights,
    moments and step count), and the step is reported skipped as before."""
    trainer = _fused(trainer_for(model_dir, "train.lr=1e-3", "train.param_dtype=bfloat16"))
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=3, seed=12))
    assert trainer.train_step(samples, 0).ok
    before = [m.detach().clone() for m in trainer.masters.master]
    moments = [trainer.optimizer.state[m]["exp_avg"].clone() for m in trainer.masters.master]
    loss = trainer.objective.loss
    # an infinite loss whose gradients are finite: only the loss's own check can stop the step
    monkeypatch.setattr(trainer.objective, "loss", lambda *a: (lambda out: (out[0] + float("inf"), out[1]))(loss(*a)))
    result = trainer.train_step(samples, 1)
    assert not result.ok and result.skipped_reason == "nonfinite_loss" and result.metrics["bad_steps"] == 1
    for m, b, mo in zip(trainer.masters.master, before, moments):
        assert torch.equal(m.detach(), b) and torch.equal(trainer.optimizer.state[m]["exp_avg"], mo)
        assert int(trainer.optimizer.state[m]["step"]) == 1
    assert all(m.grad is None for m in trainer.masters.master) and trainer.step == 1
