"""The static-arena decoder (engines/static_decode.py) on CPU, where it runs eagerly: its logits
match the ragged forward and HF, its slots stay dense as sequences leave, a weight update between
steps takes effect in place, and the whole engine behaviour suite of test_engine.py passes with
every eligible request decoding through it (a tiny slot capacity, so long requests still take the
ragged path beside it)."""
from __future__ import annotations

import asyncio

import pytest
import torch

import clawrl.engines.torch_engine as torch_engine
from clawrl.config import EngineConfig
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.ragged import RaggedForward, Segment
from clawrl.engines.static_decode import StaticDecoder, batch_buckets, width_bucket
from engine_testing import make_model_dir

import test_engine
from test_engine import *  # noqa: F401,F403  (the engine suite, re-run below with the static decoder)

CAPACITY = 96


@pytest.fixture(autouse=True)
def static_decoder_on(monkeypatch):
    """Every TorchEngine made in this module decodes through a StaticDecoder of CAPACITY tokens."""
    init = torch_engine.TorchEngine.__init__

    def patched(self, loaded, cfg, static_decode=True, static_capacity=CAPACITY):
        init(self, loaded, cfg, static_decode=static_decode, static_capacity=static_capacity)
        assert self.decoder is not None and not self.decoder.graphs

    monkeypatch.setattr(torch_engine.TorchEngine, "__init__", patched)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_model(str(make_model_dir(tmp_path_factory.mktemp("static") / "q", "qwen3", seed=3)), device="cpu",
                      dtype="float32")


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(5, 30, (n,), generator=g)]


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3] and batch_buckets(1) == [1]
    assert width_bucket(1, 4096) == 128 and width_bucket(257, 4096) == 384 and width_bucket(640, 4096) == 640
    assert width_bucket(769, 4096) == 896 and width_bucket(5000, 8192) == 5120
    assert width_bucket(700, 600) == 600  # never past the slot


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_static_step_matches_ragged_forward_and_hf(tmp_path, arch):
    lm = load_model(str(make_model_dir(tmp_path / arch, arch, seed=4)), device="cpu", dtype="float32")
    rf = RaggedForward(lm.model)
    prompts = _prompts(3, lm.model.config.vocab_size, seed=5)
    dec = StaticDecoder(rf, slots=4, capacity=64, graphs=False)
    with torch.no_grad():
        kvs = [rf.new_kv(8, 64) for _ in prompts]
        rf.forward([Segment(kv, p, []) for kv, p in zip(kvs, prompts)])
        for i, kv in enumerate(kvs):
            dec.admit(i, kv)
        seqs = [list(p) for p in prompts]
        for step in range(5):
            nxt = [(7 * step + 11 * i) % 500 + 3 for i in range(3)]
            got = dec.step(nxt).clone()
            for i, t in enumerate(nxt):
                seqs[i].append(t)
                ref = lm.model(torch.tensor([seqs[i]])).logits[0, -1].float()
                torch.testing.assert_close(got[i], ref, atol=1e-4, rtol=0)
    assert dec.lengths == [len(s) for s in seqs]


def test_slots_stay_dense_and_copy_back(qwen):
    rf = RaggedForward(qwen.model)
    prompts = _prompts(3, qwen.model.config.vocab_size, seed=6)
    dec = StaticDecoder(rf, slots=3, capacity=64, graphs=False)
    with torch.no_grad():
        kvs = [rf.new_kv(8, 64) for _ in prompts]
        rf.forward([Segment(kv, p, []) for kv, p in zip(kvs, prompts)])
        names = ["r0", "r1", "r2"]  # owners are matched by identity
        for name, kv in zip(names, kvs):
            dec.admit(name, kv)
        dec.step([5, 6, 7])
        back = rf.new_kv(8, 64)
        dec.release(names[0], into=back)  # r2 moves into slot 0
        assert dec.members == ["r2", "r1"] and dec.lengths == [len(prompts[2]) + 1, len(prompts[1]) + 1]
        assert back.length == len(prompts[0]) + 1
        # the copied-back KV continues exactly like a fresh prefill of the same tokens
        fresh = rf.new_kv(8, 64)
        ref = rf.forward([Segment(fresh, prompts[0] + [5, 9], [len(prompts[0]) + 1])])
        cont = rf.forward([Segment(back, [9], [0])])
        torch.testing.assert_close(cont, ref, atol=1e-4, rtol=0)
        # the moved sequence still decodes right from its new slot
        got = dec.step([8, 8])
        want = qwen.model(torch.tensor([prompts[2] + [7, 8]])).logits[0, -1].float()
        torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="one token per member"):
        dec.step([1])


def test_admit_refuses_when_full(qwen):
    rf = RaggedForward(qwen.model)
    dec = StaticDecoder(rf, slots=1, capacity=16, graphs=False)
    kv = rf.new_kv(8, 64)
    with torch.no_grad():
        rf.forward([Segment(kv, list(range(3, 13)), [])])
    a, b = object(), object()
    dec.admit(a, kv)
    with pytest.raises(RuntimeError, match="no free decode slot"):
        dec.admit(b, kv)
    big = rf.new_kv(8, 64)
    with torch.no_grad():
        rf.forward([Segment(big, list(range(3, 23)), [])])
    dec.release(a)
    with pytest.raises(RuntimeError, match="do not fit"):
        dec.admit(b, big)
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(rf, 1, 16, graphs=True)


def test_attention_choice_is_checked_and_falls_back_to_sdpa_off_gpu(qwen, caplog):
    rf = RaggedForward(qwen.model)
    with pytest.raises(ValueError, match="'triton' or 'sdpa'"):
        StaticDecoder(rf, 1, 16, graphs=False, attention="flash")
    dec = StaticDecoder(rf, 1, 16, graphs=False, attention="triton")  # this model is on the CPU
    assert dec.attention == "sdpa" and "using sdpa" in caplog.text


def test_engine_batched_greedy_equals_solo_and_logprobs_equal_score(qwen):
    ps = _prompts(6, qwen.model.config.vocab_size, seed=7)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)

    async def go():
        eng = torch_engine.TorchEngine(qwen, EngineConfig(max_batch_size=4, prefill_chunk_tokens=16))
        await eng.start()
        try:
            solo = [await eng.generate(p, greedy) for p in ps]
            batched = await asyncio.gather(*(eng.generate(p, greedy) for p in ps))  # 6 requests, 4 slots
            scores = [await eng.score(p, r.token_ids) for p, r in zip(ps, batched)]
            return solo, batched, scores, await eng.health()
        finally:
            await eng.shutdown()

    solo, batched, scores, health = asyncio.run(go())
    assert [r.token_ids for r in solo] == [r.token_ids for r in batched]
    for r, s in zip(batched, scores):
        assert s.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    assert health["static_decode"]["decoding"] == 0 and health["static_decode"]["capacity"] == CAPACITY


def test_weight_update_between_static_steps_takes_effect(tmp_path, qwen):
    other = load_model(str(make_model_dir(tmp_path / "b", "qwen3", seed=9)), device="cpu", dtype="float32")
    p = _prompts(1, qwen.model.config.vocab_size, seed=8)[0]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    lm = load_model(str(make_model_dir(tmp_path / "a", "qwen3", seed=3)), device="cpu", dtype="float32")

    async def go():
        eng = torch_engine.TorchEngine(lm, EngineConfig())
        await eng.start()
        try:
            out, swapped = [], False
            async for chunk in eng.stream(p, params):
                out.append(chunk)
                if not swapped and sum(len(c.token_ids) for c in out) >= 5:
                    await eng.update_weights(other.model.state_dict(), version=1)
                    swapped = True
            return out
        finally:
            await eng.shutdown()

    old_only = asyncio.run(test_engine._generate_one(lm, p, params))  # before the swap mutates lm
    chunks = asyncio.run(go())
    ids = [t for c in chunks for t in c.token_ids]
    versions = [v for c in chunks for v in c.weight_versions]
    k = versions.index(1)
    assert 5 <= k < 40 and set(versions[k:]) == {1}
    assert ids[:k] == old_only.token_ids[:k]  # the old weights, decoded in the arena
    assert ids[k:] != old_only.token_ids[k:]  # the graph/arena step read the swapped parameters


def test_suite_ran_with_static_decoder():
    """The star-import above brought test_engine's tests into this module: they must be here."""
    names = [n for n in globals() if n.startswith("test_")]
    assert sum(n in dir(test_engine) for n in names) >= 20


def test_fused_weights_follow_in_place_updates_and_refuse_when_replaced(tmp_path):
    lm = load_model(str(make_model_dir(tmp_path / "f", "qwen3", seed=11)), device="cpu", dtype="float32")
    rf = RaggedForward(lm.model)
    q = lm.model.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == rf.fused[0].qkv_w.data_ptr()  # the parameter is a view of the fused tensor
    with torch.no_grad():
        q.mul_(2.0)  # in place, as update_weights copies
    assert torch.equal(rf.fused[0].qkv_w[: q.shape[0]], q) and not rf.check_weights()
    q.data = q.data.clone()  # storage replaced: the fused tensor no longer sees it
    assert rf.check_weights() and q.data_ptr() == rf.fused[0].qkv_w.data_ptr()
    seq = list(range(3, 20))
    with torch.no_grad():
        got = rf.forward([Segment(rf.new_kv(8, 64), seq, [len(seq) - 1])])
        want = lm.model(torch.tensor([seq])).logits[0, -1].float()
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)
