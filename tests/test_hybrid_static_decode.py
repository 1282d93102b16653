"""The static decoder (engines/static_decode.py) on hybrid linear-attention models (Qwen3-Next,
Qwen3.5; ``HybridStep``), on CPU where it runs eagerly: its step's logits are the ragged path's
(HybridForward) as slots join, leave (the last slot moving into the hole) and share a batch bucket
with padding rows; through the engine, batched greedy equals solo and the ragged engine, a request
copied back out of its slot resumes through the prefix cache, and a weight swap between two steps
is read by the next one."""
from __future__ import annotations

import asyncio

import pytest
import torch

from clawrl.engines.base import SamplingParams
from clawrl.engines.hybrid import HybridForward
from clawrl.engines.loading import load_model
from clawrl.engines.ragged import Segment
from clawrl.engines.static_decode import HybridStep, StaticDecoder
from clawrl.engines.torch_engine import TorchEngine
from hybrid_testing import HYBRID_ARCHS, make_hybrid_dir
from test_hybrid import engine_run as hybrid_engine_run
from test_hybrid import hf_greedy, ids_of

CAPACITY = 256
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_static")
    return {a: make_hybrid_dir(root / a, a) for a in HYBRID_ARCHS} | {
        "qwen3_next_b": make_hybrid_dir(root / "b", "qwen3_next", seed=1)}


@pytest.fixture(scope="module")
def loaded(dirs):
    return {k: load_model(str(d), device="cpu", dtype="float32") for k, d in dirs.items()}


def engine_run(lm, fn, static: bool, **cfg):
    """``fn(engine)`` on a TorchEngine with the static decoder forced on (CAPACITY tokens a slot) or off."""
    async def checked(eng):
        assert (eng.decoder is not None) == static
        return await fn(eng)
    return hybrid_engine_run(lm, checked, {"static_decode": static, "static_capacity": CAPACITY}, **cfg)


def count_admissions(eng: TorchEngine) -> list:
    """The owners the engine's static decoder admits, recorded as it admits them."""
    admitted, admit = [], eng.decoder.admit

    def recording(owner, *args, **kw):
        admitted.append(owner)
        admit(owner, *args, **kw)
    eng.decoder.admit = recording
    return admitted


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_static_step_logits_equal_the_ragged_decode_as_slots_join_and_leave(loaded, arch):
    lm = loaded[arch]
    runner = HybridForward(lm.model, "torch")
    vocab = lm.model.config.vocab_size
    dec = StaticDecoder(runner, slots=8, capacity=CAPACITY, graphs=False)
    assert isinstance(dec.model_step, HybridStep)
    g = torch.Generator().manual_seed(3)
    live, refs = [], {}  # live: names in the decoder's slot order; refs: name -> state advanced on the ragged path

    def admit(name: str, n: int) -> None:
        prompt = ids_of(n, vocab, seed=n)
        mine, ref = runner.new_kv(64, CAPACITY), runner.new_kv(64, CAPACITY)
        runner.forward([Segment(mine, prompt, []), Segment(ref, prompt, [])])
        dec.admit(name, mine)
        live.append(name)
        refs[name] = ref

    released = None
    with torch.no_grad():
        admit("a", 5)
        admit("b", 23)
        for step in range(24):
            if step == 3:
                admit("c", 70)  # 3 live: batch bucket 4, one padding row
            if step == 6:
                admit("d", 40)
                admit("e", 9)  # 5 live: bucket 8, three padding rows
            if step == 10:
                released = runner.new_kv(8, CAPACITY)
                dec.release("b", into=released)  # "e" (the last slot) moves into b's hole
                live[live.index("b")] = live.pop()
                assert dec.members == live and released.length == refs["b"].length
            if step == 13:
                admit("f", 31)  # into the freed slot, which padding rows have written since
            tokens = [int(t) for t in torch.randint(3, vocab, (len(live),), generator=g)]
            got = dec.step(tokens).clone()
            want = runner.forward([Segment(refs[name], [t], [0]) for name, t in zip(live, tokens)])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            if released is not None:  # the copied-back state carries on on the ragged path, as b's reference does
                t = int(torch.randint(3, vocab, (1,), generator=g))
                a_, b_ = (runner.forward([Segment(s, [t], [0])]) for s in (released, refs["b"]))
                torch.testing.assert_close(a_, b_, atol=1e-4, rtol=0)
    assert dec.lengths == [refs[name].length for name in live]


def test_a_state_copied_back_from_its_slot_survives_the_ragged_decode_pool(loaded):
    """A request that decoded on the ragged path before taking a slot is still a member of the
    runner's decode pool if no ragged decode ran since; syncing that pool later (the engine does
    before caching) must not write its stale rows over the state the slot copied back."""
    lm = loaded["qwen3_5"]
    runner, other = HybridForward(lm.model, "torch"), HybridForward(lm.model, "torch")  # other: the reference's
    dec = StaticDecoder(runner, slots=2, capacity=CAPACITY, graphs=False)
    prompt = ids_of(25, lm.model.config.vocab_size, seed=12)
    with torch.no_grad():
        mine, ref = runner.new_kv(64, CAPACITY), runner.new_kv(64, CAPACITY)
        runner.forward([Segment(mine, prompt, []), Segment(ref, prompt, [])])
        runner.forward([Segment(mine, [4], [0])])  # a ragged decode step: mine joins the pool
        other.forward([Segment(ref, [4], [0])])
        runner.sync()  # as the engine does before admitting
        dec.admit("r", mine)
        for t in (5, 6, 7):
            dec.step([t])
            other.forward([Segment(ref, [t], [0])])
        dec.release("r", into=mine)
        runner.sync()  # as the engine does before caching it
        got = runner.forward([Segment(mine, [8], [0])])
        want = other.forward([Segment(ref, [8], [0])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_engine_batched_greedy_equals_solo_and_the_ragged_engine(loaded, arch):
    lm = loaded[arch]
    vocab = lm.model.config.vocab_size
    prompts = [ids_of(n, vocab, seed=20 + n) for n in (5, 23, 70, 9, 14, 40)]
    seen = {}

    async def both(eng):
        admitted = count_admissions(eng)
        solo = [await eng.generate(p, GREEDY) for p in prompts]
        batched = await asyncio.gather(*(eng.generate(p, GREEDY) for p in prompts))  # 6 requests, 4 slots
        seen["admitted"], seen["health"] = len(admitted), await eng.health()
        return solo, batched

    async def ragged(eng):
        return [await eng.generate(p, GREEDY) for p in prompts]

    solo, batched = engine_run(lm, both, True, max_batch_size=4, prefill_chunk_tokens=16, prefix_cache_tokens=0)
    reference = engine_run(lm, ragged, False, prefill_chunk_tokens=16, prefix_cache_tokens=0)
    assert seen["admitted"] == 2 * len(prompts)  # every request decoded in a slot
    assert seen["health"]["static_decode"]["decoding"] == 0 and seen["health"]["static_decode"]["slots"] == 4
    for s, b, r, p in zip(solo, batched, reference, prompts):
        assert s.token_ids == b.token_ids == r.token_ids == hf_greedy(lm.model, p, GREEDY.max_new_tokens)
        assert max(abs(x - y) for x, y in zip(s.logprobs, r.logprobs)) < 1e-4
        assert max(abs(x - y) for x, y in zip(b.logprobs, r.logprobs)) < 1e-4


def test_a_request_copied_back_from_its_slot_resumes_through_the_prefix_cache(loaded):
    lm = loaded["qwen3_next"]
    vocab = lm.model.config.vocab_size
    first = ids_of(40, vocab, seed=7)

    async def turns(eng):
        admitted = count_admissions(eng) if eng.decoder is not None else []
        a = await eng.generate(first, GREEDY)
        # the next turn extends the first request's whole sequence (its last token was never fed)
        b = await eng.generate(first + a.token_ids + ids_of(6, vocab, seed=8), GREEDY)
        return a, b, len(admitted)

    a, b, admitted = engine_run(lm, turns, True, prefix_cache_tokens=4096)
    ra, rb, _ = engine_run(lm, turns, False, prefix_cache_tokens=4096)
    assert admitted == 2
    # resumed from the slot's copied-back state, which holds a's last token too: the step after it was
    # launched (feeding it) before that token was read back, while the ragged path never feeds it
    assert b.cached_prompt_tokens == len(first) + len(a.token_ids)
    assert rb.cached_prompt_tokens == len(first) + len(a.token_ids) - 1
    assert (a.token_ids, b.token_ids) == (ra.token_ids, rb.token_ids)
    assert b.token_ids == hf_greedy(lm.model, b.prompt_ids, GREEDY.max_new_tokens)
    assert max(abs(x - y) for x, y in zip(b.logprobs, rb.logprobs)) < 1e-4


def test_a_weight_swap_between_static_steps_is_read_by_the_next_step(dirs):
    lm = load_model(str(dirs["qwen3_next"]), device="cpu", dtype="float32")  # its own copy: the swap mutates it
    other = load_model(str(dirs["qwen3_next_b"]), device="cpu", dtype="float32")
    runner = HybridForward(lm.model, "torch")
    dec = StaticDecoder(runner, slots=2, capacity=CAPACITY, graphs=False)
    prompt = ids_of(30, lm.model.config.vocab_size, seed=9)
    with torch.no_grad():
        mine, ref = runner.new_kv(64, CAPACITY), runner.new_kv(64, CAPACITY)
        runner.forward([Segment(mine, prompt, []), Segment(ref, prompt, [])])
        dec.admit("r", mine)
        before = dec.step([5]).clone()
        runner.forward([Segment(ref, [5], [0])])
        params = dict(lm.model.named_parameters())
        for name, value in other.model.state_dict().items():
            params[name].copy_(value)  # in place, as TorchEngine._update_weights does
        dec.check_weights()
        after = dec.step([6]).clone()
        want = runner.forward([Segment(ref, [6], [0])])  # the same state, read with the new weights
    torch.testing.assert_close(after, want, atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-2
    # a parameter whose storage was replaced (not copied into) moved under the graphs: they are dropped
    dec._graphs[(1, 128)] = None
    dec.check_weights()
    assert dec._graphs
    lm.model.model.norm.weight.data = lm.model.model.norm.weight.data.clone()
    dec.check_weights()
    assert not dec._graphs


def test_an_engine_weight_swap_mid_stream_serves_the_new_weights_from_the_slot(dirs, loaded):
    lm = load_model(str(dirs["qwen3_next"]), device="cpu", dtype="float32")
    other = loaded["qwen3_next_b"]
    prompt = ids_of(20, lm.model.config.vocab_size, seed=11)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    old_only = hf_greedy(lm.model, prompt, params.max_new_tokens)

    async def swap(eng):
        out, swapped = [], False
        async for chunk in eng.stream(prompt, params):
            out.append(chunk)
            if not swapped and sum(len(c.token_ids) for c in out) >= 5:
                await eng.update_weights(other.model.state_dict(), version=1)
                swapped = True
        return out

    chunks = engine_run(lm, swap, True)
    ids = [t for c in chunks for t in c.token_ids]
    versions = [v for c in chunks for v in c.weight_versions]
    k = versions.index(1)
    assert 5 <= k < 40 and set(versions[k:]) == {1}
    assert ids[:k] == old_only[:k]  # the old weights, decoded in the slot
    assert ids[k:] != old_only[k:]  # the slot's step read the swapped parameters
