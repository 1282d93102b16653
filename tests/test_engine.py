"""Behaviour of the built-in TorchEngine on a small random-weight Qwen3 model (CPU)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from clawrl.config import EngineConfig
from clawrl.engines.base import ContextLengthExceeded, EngineError, SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine
from engine_testing import make_model_dir

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    return make_model_dir(root / "a", "qwen3", seed=0), make_model_dir(root / "b", "qwen3", seed=1)


@pytest.fixture(scope="module")
def loaded(model_dirs):
    return load_model(str(model_dirs[0]), device="cpu")


@contextlib.asynccontextmanager
async def running(loaded_model, **cfg):
    eng = TorchEngine(loaded_model, EngineConfig(**cfg))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 5, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def vocab(loaded_model) -> int:
    return loaded_model.model.config.vocab_size


def test_greedy_generation_matches_hf_forward(loaded):
    p = prompts(1, vocab(loaded))[0]
    res = run(_generate_one(loaded, p, GREEDY))
    assert res.token_ids == hf_greedy(loaded.model, p, 16)
    assert res.finish_reason == "length" and res.weight_versions == [0] * 16


async def _generate_one(loaded_model, prompt, params, **cfg):
    async with running(loaded_model, **cfg) as eng:
        return await eng.generate(prompt, params)


def test_stream_chunks_concatenate_to_generate_result(loaded):
    p = prompts(1, vocab(loaded), seed=3)[0]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, top_logprobs=3, ignore_eos=True)

    async def go():
        async with running(loaded) as eng:
            chunks = [c async for c in eng.stream(p, params)]
            whole = await eng.generate(p, params)
            return chunks, whole

    chunks, whole = run(go())
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert [x for c in chunks for x in c.logprobs] == pytest.approx(whole.logprobs, abs=1e-5)
    assert [x for c in chunks for x in c.top_logprobs] == [
        [(i, pytest.approx(v, abs=1e-5)) for i, v in row] for row in whole.top_logprobs]
    assert chunks[-1].finish_reason == whole.finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_batched_greedy_equals_solo_except_near_ties(loaded):
    ps = prompts(6, vocab(loaded), seed=11)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

    async def go():
        async with running(loaded, prefill_chunk_tokens=32) as eng:
            solo = [await eng.generate(p, params) for p in ps]
            await eng.flush_cache()
            batched = await asyncio.gather(*(eng.generate(p, params) for p in ps))
            return solo, batched

    solo, batched = run(go())
    gaps = []
    for p, s, b in zip(ps, solo, batched):
        if s.token_ids == b.token_ids:
            assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)
            continue
        j = next(i for i, (x, y) in enumerate(zip(s.token_ids, b.token_ids)) if x != y)
        top2 = hf_logits(loaded.model, p + s.token_ids[:j])[-1].topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    print(f"batched vs solo: {len(gaps)} of {len(ps)} diverged; top-2 gaps at divergence: {gaps}")
    assert all(g < 1e-4 for g in gaps), gaps


def test_logprobs_equal_score_and_hf_forward(loaded):
    p = prompts(1, vocab(loaded), seed=5)[0]
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)

    async def go():
        async with running(loaded) as eng:
            res = await eng.generate(p, params)
            await eng.flush_cache()
            sc = await eng.score(p, res.token_ids, top_k=4, temperature=0.7)
            return res, sc

    res, sc = run(go())
    assert sc.logprobs == pytest.approx(res.logprobs, abs=1e-4)
    ref = torch.log_softmax(hf_logits(loaded.model, p + res.token_ids) / 0.7, dim=-1)
    rows = ref[len(p) - 1: len(p) - 1 + len(res.token_ids)]
    expected = rows.gather(1, torch.tensor(res.token_ids)[:, None])[:, 0].tolist()
    assert res.logprobs == pytest.approx(expected, abs=1e-4)
    assert sc.topk_ids == rows.topk(4).indices.tolist()
    assert sc.weight_version == 0


def test_prefix_cache_hit_reuses_kv_with_identical_logprobs(loaded):
    system = prompts(1, vocab(loaded), seed=8, lo=120, hi=121)[0]
    turn1 = system + [5, 6, 7]
    turn2 = system + [9, 10, 11, 12]

    async def go():
        async with running(loaded, prefill_chunk_tokens=16) as eng:
            cold = await eng.generate(turn2, GREEDY)
            await eng.flush_cache()
            first = await eng.generate(turn1, GREEDY)
            steps_before = eng.steps
            hit = await eng.generate(turn2, GREEDY)
            return cold, first, hit, eng.steps - steps_before

    cold, first, hit, steps = run(go())
    assert cold.cached_prompt_tokens == 0 and first.cached_prompt_tokens == 0
    assert hit.cached_prompt_tokens == len(system)
    assert steps == 1 + GREEDY.max_new_tokens - 1  # 4 new prompt tokens fit one step, then decoding
    assert hit.token_ids == cold.token_ids
    assert hit.logprobs == pytest.approx(cold.logprobs, abs=1e-4)


def test_chunked_prefill_keeps_other_requests_decoding(loaded):
    long_prompt = prompts(1, vocab(loaded), seed=9, lo=400, hi=401)[0]
    short = prompts(1, vocab(loaded), seed=10)[0]
    order = []

    async def consume(eng, name, prompt, n):
        async for c in eng.stream(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)):
            order.extend([name] * len(c.token_ids))

    async def go():
        async with running(loaded, prefill_chunk_tokens=16) as eng:
            short_task = asyncio.create_task(consume(eng, "short", short, 12))
            await asyncio.sleep(0)
            await asyncio.gather(short_task, consume(eng, "long", long_prompt, 2))

    run(go())
    # 400 prompt tokens at 16 per step take 25 steps: the short request decodes meanwhile
    assert order[:12] == ["short"] * 12 and order[12:] == ["long"] * 2


def test_top_k_one_and_tiny_top_p_equal_greedy(loaded):
    p = prompts(1, vocab(loaded), seed=12)[0]

    async def go():
        async with running(loaded) as eng:
            g = await eng.generate(p, GREEDY)
            k1 = await eng.generate(p, SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1, ignore_eos=True))
            p0 = await eng.generate(p, SamplingParams(max_new_tokens=16, temperature=1.3, top_p=1e-6, ignore_eos=True))
            return g, k1, p0

    g, k1, p0 = run(go())
    assert k1.token_ids == g.token_ids and p0.token_ids == g.token_ids
    # logprobs are of the full tempered distribution, not of the truncated one (which would be 0)
    assert all(lp < 0 for lp in k1.logprobs)


def test_same_seed_gives_same_tokens_even_when_batched(loaded):
    ps = prompts(4, vocab(loaded), seed=13)
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    other = SamplingParams(max_new_tokens=16, temperature=1.0, seed=99, ignore_eos=True)

    async def go():
        async with running(loaded) as eng:
            alone = await eng.generate(ps[0], seeded)
            batch = await asyncio.gather(eng.generate(ps[0], seeded), *(eng.generate(p, other) for p in ps[1:]))
            unseeded = [await eng.generate(ps[0], SamplingParams(max_new_tokens=16, ignore_eos=True))
                        for _ in range(3)]
            return alone, batch[0], unseeded

    alone, batched, unseeded = run(go())
    assert batched.token_ids == alone.token_ids
    assert len({tuple(u.token_ids) for u in unseeded}) > 1  # no seed: fresh randomness each time


def test_stop_string_ends_generation_and_is_reported(loaded):
    tok = loaded.tokenizer
    p = prompts(1, vocab(loaded), seed=14)[0]
    free = run(_generate_one(loaded, p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)))
    text = tok.decode(free.token_ids)
    pieces = [tok.decode([t]) for t in free.token_ids]
    k = next(i for i in range(4, len(pieces)) if pieces[i].isascii() and pieces[i].strip())
    stop = pieces[k].strip()
    cut = next(j for j in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:j]))
    res = run(_generate_one(loaded, p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                                        stop=("never-matches-this", stop))))
    assert stop in text
    assert res.finish_reason == "stop" and res.matched_stop == stop
    assert res.token_ids == free.token_ids[:cut]  # kept as sampled, including the stop's tokens


def test_stop_token_ids_eos_and_ignore_eos(loaded):
    p = prompts(1, vocab(loaded), seed=15)[0]
    free = run(_generate_one(loaded, p, GREEDY))
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    res = run(_generate_one(loaded, p, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                        stop_token_ids=(stop_id,))))
    assert res.finish_reason == "stop" and res.matched_stop == stop_id
    assert res.token_ids == free.token_ids[: first + 1]
    # the same id as the model's eos: stops unless ignore_eos
    loaded.eos_token_ids.append(stop_id)
    try:
        as_eos = run(_generate_one(loaded, p, SamplingParams(max_new_tokens=16, temperature=0.0)))
        ignored = run(_generate_one(loaded, p, GREEDY))
    finally:
        loaded.eos_token_ids.remove(stop_id)
    assert as_eos.token_ids == res.token_ids and as_eos.matched_stop == stop_id
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_context_length_exceeded_is_raised_before_any_work(loaded):
    async def go():
        async with running(loaded, max_context=64) as eng:
            with pytest.raises(ContextLengthExceeded):
                eng.stream(list(range(3, 60)), SamplingParams(max_new_tokens=8))
            with pytest.raises(ContextLengthExceeded):
                await eng.generate(list(range(3, 70)), SamplingParams(max_new_tokens=1))
            with pytest.raises(EngineError, match="outside the vocabulary"):
                await eng.generate([3, 10 ** 6], SamplingParams(max_new_tokens=1))
            with pytest.raises(EngineError, match="empty"):
                await eng.generate([], SamplingParams(max_new_tokens=1))
            ok = await eng.generate(list(range(3, 56)), SamplingParams(max_new_tokens=8, ignore_eos=True))
            return eng.steps, ok

    steps, ok = run(go())
    # the refused requests ran no step (a static decoder launches one step past the last token: it
    # reads a step's tokens while the next one runs)
    assert len(ok.token_ids) == 8 and steps in (8, 9)


def test_abort_and_closing_the_stream_end_requests(loaded):
    p = prompts(1, vocab(loaded), seed=16)[0]
    params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)

    async def go():
        async with running(loaded) as eng:
            got = []
            async for c in eng.stream(p, params, request_id="r1"):
                if not got:
                    assert await eng.abort("r1")
                got.append(c)
            assert not await eng.abort("r1") and not await eng.abort("unknown")
            it = eng.stream(p, params, request_id="r2")
            await it.__anext__()
            await it.aclose()
            dropped = eng.stream(p, params, request_id="r3")  # never iterated
            del dropped
            assert not await eng.abort("r3")  # already gone: dropping it aborted it
            for _ in range(300):
                if (await eng.health())["running"] == 0:
                    break
                await asyncio.sleep(0.01)
            return got, await eng.health()

    got, health = run(go())
    assert got[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in got) < 400
    assert health["running"] == 0 and health["waiting"] == 0


def test_pause_holds_requests_until_resume(loaded):
    p = prompts(1, vocab(loaded), seed=17)[0]

    async def go():
        async with running(loaded) as eng:
            await eng.pause()
            task = asyncio.create_task(eng.generate(p, GREEDY))
            await asyncio.sleep(0.3)
            during = (task.done(), eng.steps, await eng.health())
            await eng.resume()
            res = await asyncio.wait_for(task, 30)
            return during, res

    (done, steps, health), res = run(go())
    assert not done and steps == 0 and health["paused"] and health["waiting"] == 1
    assert res.finish_reason == "length" and len(res.token_ids) == 16


def test_max_batch_size_queues_the_rest(loaded):
    ps = prompts(5, vocab(loaded), seed=18)

    async def go():
        async with running(loaded, max_batch_size=2) as eng:
            await eng.pause()
            tasks = [asyncio.create_task(eng.generate(p, GREEDY)) for p in ps]
            await asyncio.sleep(0.2)
            await eng.resume()
            await asyncio.sleep(0)
            seen = []
            while not all(t.done() for t in tasks):
                seen.append((await eng.health())["running"])
                await asyncio.sleep(0.005)
            return [t.result() for t in tasks], seen

    results, seen = run(go())
    assert all(r.finish_reason == "length" for r in results)
    assert max(seen) <= 2


def test_update_weights_mid_generation_switches_version_once(model_dirs):
    a = load_model(str(model_dirs[0]), device="cpu")
    b = load_model(str(model_dirs[1]), device="cpu")
    new_state = {k: v.clone() for k, v in b.model.state_dict().items()}
    p = prompts(1, vocab(a), seed=19)[0]
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)

    async def go():
        async with running(a, prefill_chunk_tokens=8) as eng:
            before = await eng.generate(p, GREEDY)
            versions = []
            async for c in eng.stream(p, params):
                versions += c.weight_versions
                if len(versions) >= 5 and eng.weight_version == 0:
                    await eng.update_weights(new_state, 1)
            after = await eng.generate(p, GREEDY)
            return before, versions, after, await eng.health()

    before, versions, after, health = run(go())
    switch = versions.index(1)
    assert 0 < switch < len(versions) and versions == [0] * switch + [1] * (len(versions) - switch)
    assert before.token_ids == hf_greedy(load_model(str(model_dirs[0]), device="cpu").model, p, 16)
    assert after.token_ids == hf_greedy(b.model, p, 16) != before.token_ids
    assert after.weight_versions == [1] * 16 and after.cached_prompt_tokens == 0  # cache was flushed
    assert health["weight_version"] == 1


def test_update_weights_rejects_bad_state_and_keeps_serving(model_dirs):
    a = load_model(str(model_dirs[0]), device="cpu")
    p = prompts(1, vocab(a), seed=20)[0]
    name, w = next(iter(a.model.state_dict().items()))

    async def go():
        async with running(a) as eng:
            before = await eng.generate(p, GREEDY)
            with pytest.raises(EngineError, match="unknown parameter 'nope'"):
                await eng.update_weights({name: torch.zeros_like(w), "nope": torch.zeros(1)}, 1)
            with pytest.raises(EngineError, match="shape"):
                await eng.update_weights({name: torch.zeros_like(w), "lm_head.weight": torch.zeros(3, 3)}, 1)
            after = await eng.generate(p, GREEDY)
            return before, after, await eng.health()

    before, after, health = run(go())
    assert after.token_ids == before.token_ids and after.weight_versions == [0] * 16
    assert health["weight_version"] == 0


def test_score_top_k_and_prefix_reuse(loaded):
    p = prompts(1, vocab(loaded), seed=21, lo=60, hi=61)[0]
    resp = prompts(1, vocab(loaded), seed=22, lo=10, hi=11)[0]

    async def go():
        async with running(loaded, prefill_chunk_tokens=16) as eng:
            cold = await eng.score(p, resp, top_k=2)
            warm = await eng.score(p, resp, top_k=2)
            empty = await eng.score(p, [])
            return cold, warm, empty, eng.prefix_cache.tokens

    cold, warm, empty, cached = run(go())
    ref = torch.log_softmax(hf_logits(loaded.model, p + resp), -1)[len(p) - 1: -1]
    assert cold.logprobs == pytest.approx(ref.gather(1, torch.tensor(resp)[:, None])[:, 0].tolist(), abs=1e-4)
    assert warm.logprobs == pytest.approx(cold.logprobs, abs=1e-4) and warm.topk_ids == cold.topk_ids
    assert empty.logprobs == [] and cached >= len(p)


def test_engine_reports_health_and_model_info(loaded):
    async def go():
        async with running(loaded, max_batch_size=3) as eng:
            return await eng.health(), eng.model_info()

    health, info = run(go())
    assert health["ok"] and health["running"] == 0 and health["weight_version"] == 0
    assert info.architecture == "Qwen3ForCausalLM" and info.max_context == 4096
    assert info.eos_token_ids == sorted(loaded.eos_token_ids) and info.extra["ragged"]


def test_shutdown_engine_refuses_new_requests(loaded):
    async def go():
        eng = TorchEngine(loaded, EngineConfig())
        await eng.start()
        await eng.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            eng.stream([3, 4], GREEDY)

    run(go())


def test_sglang_backend_without_sglang_is_a_clear_error(model_dirs):
    import dataclasses

    from clawrl.config import ConfigError, compose
    from clawrl.engines import make_engine

    # not installed, or installed from requirements-sglang.txt without its GPU dependencies
    with pytest.raises(EngineError, match="^SGLang is (not installed; pip install sglang|installed but does not import)"):
        make_engine(compose(["engine.backend=sglang", f"model.path={model_dirs[0]}"]))
    with pytest.raises(ConfigError, match="engine.backend='vllm': must be one of torch, sglang"):
        compose(["engine.backend=vllm"])
    # a config built in code skips composition: make_engine still refuses the name itself
    cfg = compose([])
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, backend="vllm"))
    with pytest.raises(EngineError, match="unknown engine.backend 'vllm'"):
        make_engine(cfg)


def test_prefix_hit_on_kv_written_during_batched_decoding(loaded):
    ps = prompts(3, vocab(loaded), seed=23)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)

    async def go():
        async with running(loaded) as eng:
            first = await asyncio.gather(*(eng.generate(p, params) for p in ps))  # decoded as one batch
            follow = ps[1] + first[1].token_ids + [7, 8, 9]
            hit = await eng.generate(follow, GREEDY)
            await eng.flush_cache()
            cold = await eng.generate(follow, GREEDY)
            return first, hit, cold

    first, hit, cold = run(go())
    # every position whose KV was computed: all but the last token, or all of them where a static
    # decoder's step past the last token (see test_context_length...) fed the last one too
    assert hit.cached_prompt_tokens - (len(ps[1]) + len(first[1].token_ids) - 1) in (0, 1)
    assert cold.cached_prompt_tokens == 0
    assert hit.token_ids == cold.token_ids
    assert hit.logprobs == pytest.approx(cold.logprobs, abs=1e-4)


def test_event_loop_stays_responsive_during_a_long_prefill(loaded):
    long_prompt = prompts(1, vocab(loaded), seed=24, lo=4000, hi=4001)[0]

    async def go():
        async with running(loaded, prefill_chunk_tokens=4096) as eng:  # the whole prompt in one step
            task = asyncio.create_task(eng.generate(long_prompt, SamplingParams(max_new_tokens=1)))
            lags, loop = [], asyncio.get_running_loop()
            t0 = loop.time()
            while not task.done():
                before = loop.time()
                await asyncio.sleep(0.005)
                lags.append(loop.time() - before - 0.005)
                await eng.health()
            return loop.time() - t0, max(lags), await task

    took, worst_lag, res = run(go())
    print(f"prefill of 4000 tokens took {took:.2f} s; worst event-loop lag {worst_lag * 1000:.0f} ms")
    assert len(res.token_ids) == 1
    assert worst_lag < 0.25 and worst_lag < took


def test_embedded_model_batched_greedy_equals_solo_except_near_ties(tiny_model_dir):
    from clawrl.chat import render_prompt

    lm = load_model(str(tiny_model_dir), device="cpu")
    questions = ["What is 7+5?", "What is 12+30?", "Say hello.", "What is the capital of France?",
                 "Write one line about cats.", "What is 9+9?", "Name a color.", "What is 41+17?"]
    ps = [render_prompt(lm.tokenizer, q) for q in questions]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)

    async def go():
        async with running(lm) as eng:
            solo = [await eng.generate(p, params) for p in ps]
            await eng.flush_cache()
            return solo, await asyncio.gather(*(eng.generate(p, params) for p in ps))

    solo, batched = run(go())
    gaps = []
    for p, s, b in zip(ps, solo, batched):
        if s.token_ids == b.token_ids:
            continue
        j = next((i for i, (x, y) in enumerate(zip(s.token_ids, b.token_ids)) if x != y), None)
        assert j is not None, "one stopped early while the other went on"
        top2 = hf_logits(lm.model, p + s.token_ids[:j])[-1].topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    print(f"clawrl-tiny batched vs solo: {len(gaps)} of {len(ps)} diverged; top-2 gaps: {gaps}")
    assert all(g < 1e-4 for g in gaps), gaps


def test_score_spanning_a_weight_swap_is_wholly_the_new_version(model_dirs):
    a = load_model(str(model_dirs[0]), device="cpu")
    b = load_model(str(model_dirs[1]), device="cpu")
    new_state = {k: v.clone() for k, v in b.model.state_dict().items()}
    # alone (nobody decoding) a step prefills 8 x prefill_chunk_tokens = 64: 1000 tokens take 16 steps
    p = prompts(1, vocab(a), seed=25, lo=1000, hi=1001)[0]
    resp = prompts(1, vocab(a), seed=26, lo=8, hi=9)[0]

    async def go():
        async with running(a, prefill_chunk_tokens=8) as eng:
            task = asyncio.create_task(eng.score(p, resp))
            while eng.steps < 5:
                await asyncio.sleep(0.001)
            assert not task.done()
            await eng.update_weights(new_state, 1)
            return await task

    sc = run(go())
    ref = torch.log_softmax(hf_logits(b.model, p + resp), -1)[len(p) - 1: -1]
    assert sc.weight_version == 1
    assert sc.logprobs == pytest.approx(ref.gather(1, torch.tensor(resp)[:, None])[:, 0].tolist(), abs=1e-4)


def test_prompt_alone_is_prefilled_in_larger_chunks(loaded):
    """Chunking keeps others decoding; with nobody decoding a step takes 8 x prefill_chunk_tokens."""
    long_prompt = prompts(1, vocab(loaded), seed=27, lo=400, hi=401)[0]

    async def go():
        async with running(loaded, prefill_chunk_tokens=16) as eng:
            await eng.generate(long_prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
            return eng.steps

    assert run(go()) == 4  # ceil(400 / 128)


def test_cancelled_generate_aborts_its_request(loaded):
    p = prompts(1, vocab(loaded), seed=28)[0]

    async def go():
        async with running(loaded) as eng:
            task = asyncio.create_task(eng.generate(p, SamplingParams(max_new_tokens=4000, ignore_eos=True)))
            while eng.steps < 3:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(2000):  # the abort reaches the scheduler between steps
                if (await eng.health())["running"] == 0:
                    break
                await asyncio.sleep(0.001)
            return await eng.health(), eng.steps

    health, steps = run(go())
    assert health["running"] == 0 and steps < 3000
