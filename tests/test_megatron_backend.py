"""The megatron-core backend on CPU with gloo: conversion, and parity with the torch backend.

Parity runs one logprob pass and one train step on the same batch in the torch trainer and in
``tp * pp * dp`` megatron ranks (``clawrl.trainers.megatron.parity``), in float32: logprobs within
1e-5, gradients within 1e-4 of the largest, and the weights after one Adam step identical up to
float32 rounding.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from clawrl.config import compose  # noqa: E402
from clawrl.trainers.megatron import convert  # noqa: E402
from clawrl.trainers.megatron.parity import check_parallel  # noqa: E402
from engine_testing import make_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    # biases on q/k/v, grouped-query attention (4 heads, 2 kv heads), untied head
    return make_model_dir(tmp_path_factory.mktemp("qwen2"), arch="qwen2")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_conversion_round_trips_exactly(tmp_path, arch, tp, pp):
    model_dir = make_model_dir(tmp_path / arch, arch=arch)
    arch_info = convert.read_arch(model_dir)
    hf = convert.HFTensors(model_dir)
    shards = {(s, r): convert.load_stage(arch_info, hf.get, s, pp, tp, r) for s in range(pp) for r in range(tp)}
    rebuilt = {}
    for entry in convert.plan(arch_info, pp):
        full = convert.unshard(entry, [shards[(entry.stage, r)][entry.name] for r in range(tp)])
        rebuilt.update(dict(convert.hf_tensors(entry, arch_info, full)))
    expected = {k for k in hf._where if not (arch_info.tied and k == "lm_head.weight")}
    assert set(rebuilt) == expected
    for name, tensor in rebuilt.items():
        assert torch.equal(tensor, hf.get(name)), name
    if tp == 2:  # each rank really holds half of a sharded matrix
        qkv = shards[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
        heads_dim = (arch_info.heads + 2 * arch_info.kv_heads) * arch_info.head_dim
        assert qkv.shape[0] == heads_dim // 2


def test_unsupported_models_are_refused_in_one_line():
    base = dict(num_attention_heads=4, hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=256)
    with pytest.raises(convert.ConversionError, match="model_type 'gpt2' is not supported"):
        convert.arch_from_config({**base, "model_type": "gpt2"})
    with pytest.raises(convert.ConversionError, match="rope type 'yarn'"):
        convert.arch_from_config({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})


def _check(model_dir, *overrides, world=None):
    cfg = compose([*overrides, "train.micro_batch_tokens=40"])
    report = check_parallel(cfg, str(model_dir), world)
    print("\n".join(report.lines()))
    return report


@pytest.mark.slow
def test_check_parallel_cli_reports_tp2_parity_on_the_tiny_model(tiny_model_dir):
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "clawrl.cli", "check-parallel", f"model.path={tiny_model_dir}"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "layout: tp=2 pp=1 dp=1 (2 ranks)" in out.stdout and "parity: OK" in out.stdout
    logprob = float(re.search(r"logprobs\s+max \|diff\| (\S+)", out.stdout).group(1))
    grads = float(re.search(r"gradients\s+max rel\s+(\S+)", out.stdout).group(1))
    assert logprob <= 1e-5 and grads <= 1e-4


def test_check_parallel_cli_refuses_a_layout_that_does_not_divide_the_model(tiny_model_dir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "clawrl.cli", "check-parallel", f"model.path={tiny_model_dir}",
                          "cluster.tp=3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "clawrl: cluster.tp=3 does not divide the 4 attention heads of " \
                                                   "clawrl-tiny"


@pytest.mark.slow
def test_pipeline_parallel_2_with_activation_recomputation_matches_the_torch_backend(tiny_model_dir):
    report = _check(tiny_model_dir, "cluster.pp=2", "train.gradient_checkpointing=true")
    assert report.ok, report.lines()


@pytest.mark.slow
@pytest.mark.parametrize("scope, compiled", [("parts", (10, 10)), ("layer", (2, 2))])
def test_train_compile_on_compiles_the_megatron_layers_with_parity(tiny_model_dir, scope, compiled):
    """train.compile=on (inductor on CPU here): both backends compile each layer's two norms, q/k norms
    and MLP (parts), or each layer whole around its eager attention (layer), and still agree at tp=2.
    Whole layers are two differently written graphs, each fused its own way: their float32 logprobs
    differ by a little more float rounding than the eager bound of 1e-5 allows (1.3e-5 measured), so
    that bound is 3e-5 here; the gradients and the step stay within the usual bounds."""
    report = _check(tiny_model_dir, "train.compile=on", f"train.compile_scope={scope}", "cluster.tp=2")
    slack = 3.0 if scope == "layer" else 1.0
    assert dataclasses.replace(report, logprob_max_abs=report.logprob_max_abs / slack,
                               loss_abs=report.loss_abs / slack).ok, report.lines()
    assert report.compiled == compiled  # the tiny model's 2 layers, 5 parts each
    assert f"compiled   torch {compiled[0]} modules, megatron {compiled[1]}" in report.lines()


@pytest.mark.slow
def test_tp2_combine_with_topk_distillation_qkv_bias_and_grouped_query_attention(qwen2_dir):
    report = _check(qwen2_dir, "cluster.tp=2", "method=combine", "opd.topk=4")
    assert report.ok, report.lines()
    assert report.topk_kl is not None and report.topk_kl[0] == pytest.approx(report.topk_kl[1], abs=1e-5)


@pytest.mark.slow
def test_data_parallel_2_with_the_distributed_optimizer_moves_weights_like_one_device(qwen2_dir):
    report = _check(qwen2_dir, "cluster.distributed_optimizer=true", world=2)
    assert "dp=2" in report.layout
    assert report.logprob_max_abs <= 1e-5 and report.ok, report.lines()


def _resume_rank(rank, world, port, cfg, model_path, samples, out):
    import os

    import torch.distributed as dist

    from clawrl.trainers.megatron.ranks import MegatronRanks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ranks = MegatronRanks(cfg, model_path)
        assert ranks.train_step(samples[:3], 0)["ok"]
        saved = ranks.state_dict()
        saved = [saved]
        dist.broadcast_object_list(saved, src=0)  # the driver would hand it back the same way
        assert ranks.train_step(samples[3:], 1)["ok"]
        after_two = ranks.hf_state()
        ranks.load_state_dict(saved[0])
        assert ranks.step == 1
        assert ranks.train_step(samples[3:], 1)["ok"]
        again = ranks.hf_state()
        if rank == 0:
            torch.save({"after_two": after_two, "again": again, "saved": saved[0]}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("overrides,world", [(["cluster.tp=2"], 2), (["cluster.distributed_optimizer=true"], 2)])
def test_checkpoint_restores_weights_and_adam_state_exactly(qwen2_dir, tmp_path, overrides, world):
    import torch.multiprocessing as mp

    from clawrl.trainers.megatron.parity import free_port, synthetic_batch

    cfg = compose([*overrides, "train.lr=1e-3", "train.micro_batch_tokens=40"])
    samples = synthetic_batch(convert.read_arch(qwen2_dir).vocab, n=6, pad_id=0)
    out = tmp_path / "resume.pt"
    mp.start_processes(_resume_rank, args=(world, free_port(), cfg, str(qwen2_dir), samples, str(out)), nprocs=world,
                       join=True, start_method="spawn")
    result = torch.load(out, weights_only=False)
    assert result["saved"]["kind"] == "megatron" and result["saved"]["step"] == 1
    # the second step after restoring equals the second step without the detour, bit for bit
    # (it would not, were the Adam moments or the weights not restored)
    for name, tensor in result["after_two"].items():
        assert torch.equal(tensor, result["again"][name]), name


def test_the_torch_adam_fallback_is_switched_to_its_fused_form_with_the_same_update():
    """Without transformer-engine or apex megatron steps with torch's for-each Adam; on a GPU the
    backend switches it to the fused form (one kernel; CPU has the fused form too, so it runs here):
    the same weights after three steps when it is switched between steps, its moments and step
    counts carried over."""
    from clawrl.trainers.megatron.ranks import MegatronRanks

    torch.manual_seed(0)
    start = [torch.randn(7, 3), torch.randn(4)]
    runs = {}
    for fused in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        inner = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
        chained = type("Chained", (), {"chained_optimizers": [type("Part", (), {"optimizer": inner})()]})()
        for step in range(3):
            if fused and step == 1:
                MegatronRanks._fuse_adam(chained)
                assert all(g["fused"] and not g["foreach"] for g in inner.param_groups)
            for p, t in zip(params, start):
                p.grad = torch.sin(t * (step + 1))
            inner.step()
        runs[fused] = [p.detach() for p in params]
    for plain, fused in zip(runs[False], runs[True]):
        torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-6)


def test_the_clip_goes_into_the_fused_adam_as_its_grad_scale_with_the_same_update():
    """Where megatron's inner optimizers are the fused Adam, the backend clips through its grad_scale
    instead of megatron's pass over the gradients: the same norm and weights as clip_grad_norm then a
    step (a clip small enough to act; the for-each Adam takes megatron's own clip)."""
    from clawrl.trainers.megatron.ranks import MegatronRanks

    class Chained:  # megatron's ChainedOptimizer as the backend calls it: the norm, the clip, the parts
        def __init__(self, inner):
            self.chained_optimizers = [type("Part", (), {"optimizer": inner})()]
            self.params = inner.param_groups[0]["params"]

        def get_grad_norm(self):
            return float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in self.params])))

        def clip_grad_norm(self, clip):
            return float(torch.nn.utils.clip_grad_norm_(self.params, clip))

    torch.manual_seed(0)
    start = [torch.randn(7, 3), torch.randn(4)]
    runs, norms = {}, {}
    for fused in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        inner = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=fused or None)
        chained = Chained(inner)
        for step in range(3):
            for p, t in zip(params, start):
                p.grad = 3 * torch.sin(t * (step + 1))
            norms[fused, step] = MegatronRanks.clip(chained, 0.5)
            assert hasattr(inner, "grad_scale") == fused
            inner.step()
        runs[fused] = [p.detach() for p in params]
    assert all(norms[True, k] == pytest.approx(norms[False, k]) and norms[True, k] > 1 for k in range(3))
    for plain, fused in zip(runs[False], runs[True]):
        torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-6)
    assert MegatronRanks.clip(chained, 0) == pytest.approx(chained.get_grad_norm())  # no clip: the norm alone



def _queued_rank(rank, port, cfg, model_path, samples, out):
    import os

    import torch.distributed as dist

    from clawrl.trainers.megatron.ranks import MegatronRanks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        result = {}
        for fused in (False, True):
            ranks = MegatronRanks(cfg, model_path)
            if fused:  # what a GPU gets; CPU has the fused Adam too
                MegatronRanks._fuse_adam(ranks.optimizer)
            step = ranks.train_step(samples, 0)
            result[fused] = {"ok": step["ok"], "grad_norm": step["metrics"]["grad_norm"], "weights": ranks.hf_state()}
        inner = ranks.optimizer.chained_optimizers[0].optimizer
        moments = [inner.state[p]["exp_avg"].clone() for g in inner.param_groups for p in g["params"]]
        loss = ranks.objective.loss
        # an infinite loss whose gradients are finite: only the loss's own check can stop the step
        ranks.objective.loss = lambda *a: (lambda out: (out[0] + float("inf"), out[1]))(loss(*a))
        step = ranks.train_step(samples, 1)
        after = [inner.state[p]["exp_avg"] for g in inner.param_groups for p in g["params"]]
        result["inf"] = {"step": step, "weights": ranks.hf_state(), "moments_kept": all(
            torch.equal(a, b) for a, b in zip(after, moments)), "counts": {int(inner.state[p]["step"])
                                                                          for g in inner.param_groups
                                                                          for p in g["params"]}}
        torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_one_rank_queues_its_fused_step_with_the_same_update_and_undoes_it_on_a_non_finite_loss(qwen2_dir, tmp_path):
    """One rank with the fused Adam: the norm, the clip and the step are queued before the host reads
    the loss (``_queue_step``). The same norm and weights as megatron's own norm, clip and step (a
    clip small enough to act); and an infinite loss with finite gradients leaves weights, moments and
    step counts as they were, reported as a skipped step."""
    import torch.multiprocessing as mp

    from clawrl.trainers.megatron.parity import free_port, synthetic_batch

    cfg = compose(["train.lr=1e-3", "train.grad_clip=0.05"])
    samples = synthetic_batch(convert.read_arch(qwen2_dir).vocab, n=3, pad_id=0)
    out = tmp_path / "queued.pt"
    mp.start_processes(_queued_rank, args=(free_port(), cfg, str(qwen2_dir), samples, str(out)), nprocs=1,
                       join=True, start_method="spawn")
    result = torch.load(out, weights_only=False)
    plain, queued = result[False], result[True]
    assert plain["ok"] and queued["ok"] and queued["grad_norm"] > 0.05
    assert queued["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(queued["weights"][name], tensor, atol=1e-6, rtol=1e-5)
    skipped = result["inf"]
    assert not skipped["step"]["ok"] and skipped["step"]["skipped_reason"] == "nonfinite_loss"
    assert skipped["moments_kept"] and skipped["counts"] == {1}
    for name, tensor in queued["weights"].items():
        assert torch.equal(skipped["weights"][name], tensor), name


def _compiled_rank(rank, port, cfg, model_path, batches, out):
    import os

    import torch.distributed as dist

    from clawrl.trainers.megatron.ranks import MegatronRanks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ranks = MegatronRanks(cfg, model_path)
        torch._dynamo.utils.counters.clear()
        oks = [ranks.train_step(batches[0], 0)["ok"]]
        with torch._dynamo.config.patch(error_on_recompile=True):  # other lengths, another sample count
            oks.append(ranks.train_step(batches[1], 1)["ok"])
        torch.save({"ok": oks, "compiled": ranks.compiled,
                    "breaks": dict(torch._dynamo.utils.counters["graph_break"])}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_megatron_layer_compiled_whole_is_one_graph(qwen2_dir, tmp_path):
    """train.compile_scope=layer on megatron's local spec: no graph break in a layer. Megatron calls its
    core attention (``SdpaCoreAttention``, the packed operator) and its output projection inside
    activation-offloading contexts, where dynamo cannot resume after a break: one break there had left
    most of each layer eager (``one_graph``). Other lengths compile nothing new."""
    import torch.multiprocessing as mp

    from clawrl.trainers.megatron.parity import free_port, synthetic_batch

    cfg = compose(["train.compile=on", "train.compile_scope=layer", "train.lr=1e-3"])
    vocab = convert.read_arch(qwen2_dir).vocab
    batches = [synthetic_batch(vocab, n=4, pad_id=0), synthetic_batch(vocab, n=3, pad_id=0, seed=5)]
    out = tmp_path / "compiled.pt"
    mp.start_processes(_compiled_rank, args=(free_port(), cfg, str(qwen2_dir), batches, str(out)), nprocs=1,
                       join=True, start_method="spawn")
    result = torch.load(out, weights_only=False)
    assert result["ok"] == [True, True] and result["compiled"] == convert.read_arch(qwen2_dir).layers
    assert not result["breaks"], result["breaks"]

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_table_rotates_exactly_as_megatrons_own_rotary_embedding(dtype):
    """cos and sin computed once per forward (rope_table) give megatron's rotation bit for bit, with
    its yarn scale and a partial rotary dimension; frequencies that are not a table go to megatron's
    function unchanged."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from clawrl.trainers.megatron import rope_table

    rope_table.install()
    rope_table.install()  # idempotent: one wrapper
    wrapped = attention.apply_rotary_pos_emb
    assert wrapped.takes_cos_sin_table and wrapped is not rope_utils.apply_rotary_pos_emb
    torch.manual_seed(0)
    t = torch.randn(12, 1, 4, 16).to(dtype)
    for rot, mscale in ((16, 1.0), (8, 0.7)):
        freqs = torch.randn(12, 1, 1, rot) * 3
        megatrons = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)
        assert torch.equal(wrapped(t, rope_table.table(freqs), None, None, mscale), megatrons)
    config = type("Config", (), {"apply_rope_fusion": False, "multi_latent_attention": False, "mrope_section": None,
                                 "rotary_interleaved": False})()
    assert torch.equal(wrapped(t, freqs, config, None, 0.7, cp_group=object()), megatrons)  # passed through
    assert rope_table.usable(config)
    config.rotary_interleaved = True
    assert not rope_table.usable(config)


def test_foreach_norm_and_scale_replace_megatrons_per_tensor_fallbacks():
    """Without apex or transformer-engine the backend swaps in for-each kernels for megatron's
    gradient norm (its own fallback syncs the host once per tensor) and clip scaling: same results."""
    from megatron.core.optimizer import clip_grads

    from clawrl.trainers.megatron import foreach_kernels

    assert foreach_kernels.install() and clip_grads.l2_norm_impl is foreach_kernels.l2_norm
    assert foreach_kernels.install()  # idempotent
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2).to(torch.bfloat16)]
    flag = torch.zeros(1, dtype=torch.int32)
    norm, per_tensor = foreach_kernels.l2_norm(2048, flag, [grads], False)
    expected = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]))
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected)
    assert float(foreach_kernels.l2_norm(2048, flag, [[]], False)[0]) == 0.0
    copies = [torch.empty_like(g) for g in grads[:2]]
    foreach_kernels.scale(2048, flag, [grads[:2], copies], 0.5)
    for g, c in zip(grads[:2], copies):
        torch.testing.assert_close(c, g * 0.5)
    before = [g.clone() for g in grads[:2]]
    foreach_kernels.scale(2048, flag, [grads[:2], grads[:2]], 2.0)  # in place, as clipping calls it
    for g, b in zip(grads[:2], before):
        torch.testing.assert_close(g, b * 2.0)
