"""The torch trainer on tiny random hybrid linear-attention models (Qwen3-Next, Qwen3.5 text; CPU):
a packed micro-batch gives every sample the logprobs it has alone (no recurrent state leaks from one
sequence into the next), and every loss -- rl (GRPO), opd, top-k distillation, combine -- and LoRA
train them."""
from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from clawrl.engines.delta_rule import DeltaRuleUnavailable
from clawrl.engines.loading import load_model
from engine_testing import make_model_dir
from hybrid_testing import HYBRID_ARCHS, make_hybrid_dir
from test_opd_training import combine_batch, with_teacher
from test_trainer import make_samples, on_policy, trainer_for


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_train")
    return {a: make_hybrid_dir(root / a, a, std=0.1) for a in HYBRID_ARCHS}


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_packed_sequences_score_as_they_do_alone(dirs, arch):
    trainer = trainer_for(dirs[arch])
    samples = make_samples(trainer.vocab_size, n=4, seed=1)
    packed = trainer.logprobs(samples)  # one micro-batch of four sequences
    hf = load_model(str(dirs[arch]), device="cpu").model
    for s, lps in zip(samples, packed):
        ids = s.prompt_ids + s.response_ids
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, len(s.prompt_ids) - 1: -1].float(), -1)
        exact = lp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(lps, exact.tolist())) < 1e-4


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_an_rl_step_moves_logprobs_with_the_advantage(dirs, advantage):
    trainer = trainer_for(dirs["qwen3_next"], "train.lr=3e-3")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, advantage=advantage))
    before = [sum(x) for x in trainer.logprobs(samples)]
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok and result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert result.metrics["rollout_logprob_gap_max"] < 1e-5
    after = [sum(x) for x in trainer.logprobs(samples)]
    for b, a in zip(before, after):
        assert (a - b) * advantage > 0.02


def test_the_update_does_not_depend_on_the_micro_batch_split(dirs):
    samples = make_samples(400, n=4, seed=3)
    params = {}
    for budget in (10_000, 20):
        trainer = trainer_for(dirs["qwen3_5"], f"train.micro_batch_tokens={budget}", "train.lr=1e-3",
                              "train.aggregation=seq-mean-token-mean", dtype=torch.float64)
        on_policy(trainer, samples)
        assert trainer.train_step(samples, weight_version=0).ok
        params[budget] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for name, p in params[10_000].items():
        torch.testing.assert_close(params[20][name], p, atol=1e-7, rtol=0, msg=name)


def test_opd_and_forward_topk_steps_train(dirs):
    trainer = trainer_for(dirs["qwen3_5"], "method=opd", "opd.topk=2", "opd.topk_kl=forward", "train.lr=3e-3")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2, seed=4))
    for s in samples:
        s.rl_signal = False
        n = len(s.response_ids)
        with_teacher(s, [1.0] * n, topk=([[3, 4]] * n, [[-0.1, -3.0]] * n))
    before = [sum(x) for x in trainer.logprobs(samples)]
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok and result.metrics["topk_kl"] > 0 and result.metrics["samples_opd_only"] == 2
    after = [sum(x) for x in trainer.logprobs(samples)]
    assert all(a > b for a, b in zip(after, before))


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_combine_with_lora_trains_adapters_and_exports_the_merged_model(dirs, arch):
    trainer = trainer_for(dirs[arch], "method=combine", "combine.w_rl=1.0", "combine.w_opd=0.5",
                          "train.lora.enabled=true", "train.lora.r=4", "train.lr=1e-2", "train.kl_coef=0.1")
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    samples = combine_batch(trainer)
    before = trainer.logprobs(samples)
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok and (result.metrics["samples_both"], result.metrics["samples_rl_only"]) == (1, 1)
    after = trainer.logprobs(samples)
    moved = [sum(a) - sum(b) for a, b in zip(after, before)]
    assert moved[0] > 0 and moved[1] < 0 and moved[2] > 0  # +1 & hint, -1, hint only
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
    exported = trainer.export_weights()
    served = load_model(str(dirs[arch]), device="cpu").model
    assert set(exported) == set(served.state_dict())
    served.load_state_dict(exported)
    s = samples[0]
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_compile_scope_auto_compiles_a_hybrid_by_parts_and_an_attention_model_whole(dirs, tmp_path):
    """train.compile_scope=auto (the default): a hybrid's layers are compiled by parts, since its
    pure-torch delta rule loops over chunks that a whole-layer graph would unroll; the attention-only
    model gets each layer compiled whole (the scope measured fastest on the GPU)."""
    hybrid = trainer_for(dirs["qwen3_next"], "train.compile=on")
    assert hybrid.hybrid and 0 < hybrid.compiled != hybrid.model.config.num_hidden_layers
    dense = trainer_for(make_model_dir(tmp_path / "dense", "qwen3", seed=0), "train.compile=on")
    assert not dense.hybrid and dense.compiled == dense.model.config.num_hidden_layers


def test_fla_kernels_asked_for_on_cpu_are_refused(dirs):
    with pytest.raises(DeltaRuleUnavailable, match="CUDA"):
        trainer_for(dirs["qwen3_next"], "model.linear_attention=fla")


def test_the_trainer_runs_the_layers_on_the_undecorated_torch_delta_rule_and_puts_them_back(dirs):
    """On a CPU the trainer takes the torch kernels; ``torch_kernels`` swaps HF's fla-or-torch
    wrappers for the torch functions they wrap only while its block runs."""
    from clawrl.trainers.linear_attention import KERNEL_FUNCTIONS, kernel_bindings, torch_kernels

    trainer = trainer_for(dirs["qwen3_5"])
    assert trainer.linear_kernels == "torch"
    model = trainer.model
    (module,) = {sys.modules[type(m).__module__] for m in model.modules() if hasattr(m, "A_log")}
    wrapped = {name: getattr(module, name) for name in KERNEL_FUNCTIONS}
    ids = torch.tensor([make_samples(trainer.vocab_size, seed=8)[0].prompt_ids])
    with torch.no_grad():
        outside = model(input_ids=ids).logits
        with torch_kernels(kernel_bindings(model)):
            for name, fn in wrapped.items():
                assert getattr(module, name) is inspect.unwrap(fn) and inspect.unwrap(fn) is not fn
            inside = model(input_ids=ids).logits
    assert all(getattr(module, name) is fn for name, fn in wrapped.items())
    torch.testing.assert_close(inside, outside)


def test_recomputation_in_the_backward_runs_on_the_torch_kernels_too(dirs, monkeypatch):
    """With ``train.gradient_checkpointing`` the backward runs each layer's forward again. The torch
    kernels must hold there too: on fla (an H100 run) the recomputation saved other tensors than the
    forward and torch's checkpoint refused the step. Here HF's kernel functions are replaced by
    wrappers that raise, standing for fla's refusal, around the same torch functions."""
    import functools

    from clawrl.trainers.linear_attention import KERNEL_FUNCTIONS, kernel_bindings, torch_kernels

    probe = load_model(str(dirs["qwen3_next"]), device="cpu").model
    (module,) = {sys.modules[type(m).__module__] for m in probe.modules() if hasattr(m, "A_log")}

    def refusing(fn):
        @functools.wraps(fn)  # __wrapped__: what the trainer unwraps to
        def kernel(*args, **kwargs):
            raise RuntimeError("the fla kernel ran")
        return kernel
    for name in KERNEL_FUNCTIONS:
        monkeypatch.setattr(module, name, refusing(getattr(module, name)))
    installed = {name: getattr(module, name) for name in KERNEL_FUNCTIONS}
    trainer = trainer_for(dirs["qwen3_next"], "train.gradient_checkpointing=true", "train.lr=1e-3")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2, seed=5))
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok and result.metrics["grad_norm"] > 0
    assert {name: getattr(module, name) for name in KERNEL_FUNCTIONS} == installed  # put back after the step
    with torch_kernels(kernel_bindings(probe)):  # blocks nest: leaving the inner one keeps the outer's
        with torch_kernels(kernel_bindings(probe)):
            pass
        assert all(getattr(module, n) is inspect.unwrap(installed[n]) for n in KERNEL_FUNCTIONS)
    assert {name: getattr(module, name) for name in KERNEL_FUNCTIONS} == installed


def test_auto_trains_on_torch_where_fla_refuses_its_backward(monkeypatch, caplog):
    """fla 0.6 raises in its gated chunk backward with Triton 3.4-3.7.0 on Hopper (its issue #640),
    the H200 image's case: ``auto`` trains on torch and says why, ``fla`` is refused up front."""
    from clawrl.trainers import linear_attention

    triton = types.SimpleNamespace(__version__="3.6.0")
    flags = types.SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=False)
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.utils", flags)
    monkeypatch.setattr(linear_attention, "resolve", lambda choice, device: types.SimpleNamespace(name="fla"))
    cuda = torch.device("cuda")
    assert "Triton 3.6.0" in linear_attention.fla_backward_refusal()
    with caplog.at_level("WARNING", logger=linear_attention.__name__):
        assert linear_attention.training_kernels("auto", cuda) == "torch"
    assert "#640" in caplog.text
    with pytest.raises(DeltaRuleUnavailable, match="cannot train here.*Triton 3.6.0"):
        linear_attention.training_kernels("fla", cuda)
    assert linear_attention.training_kernels("torch", cuda) == "torch"
    flags.TRITON_ABOVE_3_7_1 = True  # a fixed Triton: fla trains
    assert linear_attention.fla_backward_refusal() is None
    assert linear_attention.training_kernels("auto", cuda) == linear_attention.training_kernels("fla", cuda) == "fla"
    flags.TRITON_ABOVE_3_7_1, flags.IS_NVIDIA_HOPPER = False, False  # not Hopper
    assert linear_attention.training_kernels("auto", cuda) == "fla"


def test_lora_can_adapt_the_linear_attention_projections(dirs):
    """The default LoRA targets (q/k/v/o_proj) reach only the full-attention layers, one in four;
    naming the Gated DeltaNet projections adapts those too (Qwen3.5's names here)."""
    targets = "[q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj]"
    trainer = trainer_for(dirs["qwen3_5"], "train.lora.enabled=true", f"train.lora.target_modules={targets}",
                          "train.lr=1e-2")
    names = [n for n, _ in trainer.model.named_parameters() if "lora_A" in n]
    assert any("linear_attn.in_proj_qkv" in n for n in names) and any("linear_attn.out_proj" in n for n in names)
    samples = on_policy(trainer, make_samples(trainer.vocab_size, seed=6))
    before = [sum(x) for x in trainer.logprobs(samples)]
    assert trainer.train_step(samples, 0).ok
    after = [sum(x) for x in trainer.logprobs(samples)]
    assert all(a > b for a, b in zip(after, before))
