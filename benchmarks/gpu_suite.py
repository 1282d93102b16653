"""Decode and prefill of clawrl's engine against HF transformers, in the same run, on one GPU.

Decode: 1, 8 and 64 concurrent streams, a 512-token random prompt each and 256 new tokens, EOS
ignored. The HF baseline runs exactly as ``tools/gpu_baselines.py`` (the project's reference
probe) runs it: a Qwen3 config built from the same numbers, ``torch.manual_seed(0)``, the model
made on the device and cast to bf16, one ``generate(prompt[:2], max_new_tokens=8)`` warm-up, then
``generate(prompt, max_new_tokens=256, min_new_tokens=256, do_sample=True, temperature=1.0,
top_k=0)`` timed with a CUDA sync. clawrl serves the same model object with the same prompts and
the same sampling (temperature 1, no truncation), every request through its scheduler; the
greedy figure is printed beside it.

Prefill: the real OpenClaw request (``tests/fixtures/openclaw-2026.9.6/chat_turn1.json``, system
prompt plus 12 tools) rendered with the embedded model's chat template and tokenizer; clawrl cold
(prefix cache flushed, chunked as configured) and as a prefix-cache hit (the previous turn served
first) against HF's single forward of the whole prompt (``logits_to_keep=1``), CUDA-synced; and
cold again while 8 other streams decode, when the engine chunks it (``engine.prefill_chunk_tokens``)
so that they keep getting tokens (alone, a step takes 8 times that many prompt tokens).

Serving: 8 and 64 concurrent chats (about 512 prompt tokens, 256 new, temperature 1) through the
gateway -- uvicorn on the event loop ``clawrl serve`` gets, FastAPI, streamed chat completions
(SSE), the session linker and its SQLite turn store -- from a client in its own process
(``gpu_serving_client.py``), against the same prompt ids and sampling params through
``engine.stream`` directly, on the same engine in the same run: tokens per second, TTFT, and
where the server's time goes (its CPU seconds and how late the event loop wakes up). The random
model is first made to sample ids the embedded tokenizer has (``speak_tokenizer``), so there is
text to detokenise and stream; this part therefore runs last.

Every figure is the median of ``--repeat`` runs (at least 3 on a GPU: the first run at each batch
size is much slower than later ones, for HF too), engine and HF interleaved. The figures go into
``--out`` (default ``benchmarks/results/h200.json`` on a GPU), each beside its baseline, ratio,
commit and command, and a markdown table is printed. ``--shape tiny`` runs the whole suite in
seconds on a CPU, so the script cannot rot.

Train (``gpu_train.py``): clawrl's torch trainer against the probe's plain HF training loop on
the same weights and 8 x 2048 tokens a step, with MFU against the matmul ceiling measured in the run.

Sync (``gpu_sync.py``): the weights streamed from another process on the same GPU, through CUDA IPC
and through gloo, against a raw device-to-device copy.

Staleness (``gpu_staleness.py``): the share of judged samples dropped as stale while 8 simulated
users chat through ``openclaw-combine/run.sh`` and the trainer shares the GPU, at the default
``train.max_weight_lag``, against fixed-size train steps in the same run (only when asked for by
name: it starts two servers).

Hybrid (``gpu_hybrid.py``): a Qwen3-Next-style hybrid linear-attention model against the attention-only
shape of the same size, decode, prefill and training throughput (only when asked for by name).

    python benchmarks/gpu_suite.py --part decode|prefill|serving|train|sync|all|staleness|hybrid [--shape qwen3-1.7b|qwen3-0.6b|tiny]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import uvicorn
from tokenizers import Tokenizer
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from clawrl.config import EngineConfig, compose
from clawrl.embedded.build import build_tokenizer, default_model_path
from clawrl.embedded.tokenizer import render_chat, save_tokenizer, train_tokenizer
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import LoadedModel
from clawrl.engines.static_decode import ATTENTIONS
from clawrl.engines.torch_engine import TorchEngine
from clawrl.gateway.app import create_app
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.render import render_prompt
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

ROOT = Path(__file__).resolve().parents[1]
if str(Path(__file__).parent) not in sys.path:  # gpu_train, gpu_sync, gpu_staleness beside it, also when loaded by path
    sys.path.insert(0, str(Path(__file__).parent))
from gpu_models import hf_decode, random_model, served, sync  # noqa: E402 (beside this file)
CLIENT = Path(__file__).with_name("gpu_serving_client.py")
FIXTURE = ROOT / "tests" / "fixtures" / "openclaw-2026.9.6" / "chat_turn1.json"

# The numbers of tools/gpu_baselines.py (Qwen3-1.7B shape, tied), and a 0.6B shape to iterate on.
SHAPES = {
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
# Per shape: streams, prompt tokens, new tokens, prefill tokens (0: the whole OpenClaw request).
SIZES = {
    "qwen3-1.7b": ((1, 8, 64), 512, 256, 0),
    "qwen3-0.6b": ((1, 8, 64), 512, 256, 0),
    "tiny": ((1, 4), 32, 8, 600),
}
# Per shape: concurrent chats through the gateway, prompt tokens (about), new tokens.
SERVING = {
    "qwen3-1.7b": ((8, 64), 512, 256),
    "qwen3-0.6b": ((8, 64), 512, 256),
    "tiny": ((2, 4), 40, 8),
}


def build_model(shape: str, device: str) -> Qwen3ForCausalLM:
    """The model as gpu_baselines.py builds it (on CPU: fp32, since that is what CPUs run)."""
    return random_model(Qwen3ForCausalLM, Qwen3Config(**SHAPES[shape], max_position_embeddings=8192,
                                                      tie_word_embeddings=True, attn_implementation="sdpa"), device)


# ---------------------------------------------------------------- decode

async def clawrl_decode(eng: TorchEngine, prompts: list[list[int]], new: int, greedy: bool) -> float:
    params = SamplingParams(max_new_tokens=new, temperature=0.0 if greedy else 1.0, top_k=0, top_p=1.0,
                            ignore_eos=True)
    await eng.flush_cache()
    sync()
    t = time.perf_counter()
    results = await asyncio.gather(*(eng.generate(p, params) for p in prompts))
    sync()
    dt = time.perf_counter() - t
    assert all(len(r.token_ids) == new for r in results)
    return len(prompts) * new / dt


def random_prompts(vocab: int):
    """``n`` prompts of random ids, ``length`` each (the random-weights shapes have no text)."""
    return lambda n, length: torch.randint(0, vocab, (n, length)).tolist()


async def run_decode(model, lm, args, streams, prompt_len, new, repeat, prompts_for=None) -> dict:
    """clawrl against HF ``generate`` at each stream count; ``prompts_for(n, length)`` gives the
    prompts (default: random ids), all of one length, so HF needs no padding."""
    prompts_for = prompts_for or random_prompts(model.config.vocab_size)
    with torch.no_grad():  # gpu_baselines' warm-up
        model.generate(torch.tensor(prompts_for(2, prompt_len), device=lm.device), max_new_tokens=8,
                       do_sample=True, min_new_tokens=8)
    eng = TorchEngine(lm, EngineConfig(max_batch_size=max(streams), decode_attention=args.decode_attention))
    await eng.start()
    out = {}
    try:
        for n in streams:
            ids = prompts_for(n, prompt_len)
            prompt = torch.tensor(ids, device=lm.device)
            await clawrl_decode(eng, ids, new, greedy=False)  # warm-up: graph captures for these shapes
            sampled, greedy, hf = [], [], []
            for _ in range(repeat):
                sampled.append(await clawrl_decode(eng, ids, new, greedy=False))
                greedy.append(await clawrl_decode(eng, ids, new, greedy=True))
                hf.append(hf_decode(model, prompt, new))
            c, g, h = statistics.median(sampled), statistics.median(greedy), statistics.median(hf)
            out[f"streams_{n}"] = {
                "clawrl_tok_s": round(c, 1), "hf_tok_s": round(h, 1), "ratio": round(c / h, 3),
                "clawrl_greedy_tok_s": round(g, 1),
                "runs": {"clawrl": [round(x, 1) for x in sampled], "clawrl_greedy": [round(x, 1) for x in greedy],
                         "hf": [round(x, 1) for x in hf]},
            }
            print(f"decode {n:>3} streams: clawrl {c:9.1f} tok/s (greedy {g:9.1f}), HF generate {h:9.1f} tok/s, "
                  f"ratio {c / h:5.2f}  runs {out[f'streams_{n}']['runs']}", flush=True)
        out["engine"] = (await eng.health()).get("static_decode")
    finally:
        await eng.shutdown()
    return out


# ---------------------------------------------------------------- prefill

def openclaw_prompts(tokenizer_dir: str | None, limit: int) -> tuple[list[int], list[int]]:
    """Turn 1 of the OpenClaw fixture and a next turn with the same system prompt and tools."""
    if tokenizer_dir:
        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    else:
        try:
            tok = Tokenizer.from_file(str(default_model_path(build_if_missing=False) / "tokenizer.json"))
        except FileNotFoundError:
            tok = build_tokenizer(0)  # the embedded model's tokenizer, trained here (seconds)
    body = json.loads(FIXTURE.read_text())["body"]
    messages, tools = body["messages"], body.get("tools")
    if limit:  # a small stand-in: the system prompt's head, no tools (about 2 characters a token)
        messages = [{**m, "content": m["content"][: 2 * limit]} if m["role"] == "system" else m for m in messages]
        tools = None

    def render(msgs):
        return tok.encode(render_chat(msgs, tools, add_generation_prompt=True), add_special_tokens=False).ids

    first = render(messages)
    nxt = render([m for m in messages if m["role"] == "system"]
                 + [{"role": "user", "content": "Too long. One line, and no rhymes please."}])
    return first, nxt


def hf_prefill(model, ids: torch.Tensor) -> float:
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
    sync()
    return time.perf_counter() - t


async def clawrl_prefill(eng: TorchEngine, prompt: list[int]) -> tuple[float, int]:
    sync()
    t = time.perf_counter()
    r = await eng.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.0))
    sync()
    return time.perf_counter() - t, r.cached_prompt_tokens


async def prefill_beside_decoding(eng: TorchEngine, prompt: list[int], others: list[list[int]], new: int) -> float:
    """Cold prefill of ``prompt`` while ``others`` decode: chunked, so they keep getting tokens."""
    await eng.flush_cache()
    streams = [eng.stream(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)) for p in others]
    try:
        for st in streams:
            await st.__anext__()  # each has its first token: all are decoding now
        took, _ = await clawrl_prefill(eng, prompt)
    finally:
        for st in streams:
            await st.aclose()  # aborts it
    return took


async def run_prefill(model, lm, args, limit, repeat, others: list[list[int]], others_new: int) -> dict:
    first, nxt = openclaw_prompts(args.tokenizer, limit)
    eng = TorchEngine(lm, EngineConfig())
    await eng.start()
    try:
        ids = torch.tensor([nxt], device=lm.device)
        hf_prefill(model, ids)  # warm-up
        await clawrl_prefill(eng, nxt)
        colds, hits, hfs, cached = [], [], [], 0
        for _ in range(repeat):
            await eng.flush_cache()
            cold, _ = await clawrl_prefill(eng, nxt)
            await eng.flush_cache()
            await clawrl_prefill(eng, first)
            hit, cached = await clawrl_prefill(eng, nxt)
            colds.append(cold)
            hits.append(hit)
            hfs.append(hf_prefill(model, ids))
        busy = [await prefill_beside_decoding(eng, nxt, others, others_new) for _ in range(repeat)]
    finally:
        await eng.shutdown()
    c, h, f, b = (statistics.median(x) * 1000 for x in (colds, hits, hfs, busy))
    print(f"prefill {len(nxt)} tokens: clawrl cold {c:.1f} ms, prefix-cache hit {h:.1f} ms ({cached} cached), "
          f"HF forward {f:.1f} ms, cold/HF {c / f:.2f}, hit/cold {h / c:.1%}; cold while {len(others)} streams "
          f"decode {b:.1f} ms", flush=True)
    return {"openclaw": {
        "clawrl_ms": round(c, 2), "hf_ms": round(f, 2), "ratio_to_hf": round(c / f, 3),
        "hit_ms": round(h, 2), "hit_over_cold": round(h / c, 4), "tokens": len(nxt), "cached_tokens": cached,
        "cold_beside_decoding_ms": round(b, 2), "decoding_streams": len(others),
        "prefill_chunk_tokens": eng.engine_cfg.prefill_chunk_tokens,
        "runs": {"clawrl_cold_ms": [round(x * 1000, 2) for x in colds],
                 "clawrl_hit_ms": [round(x * 1000, 2) for x in hits], "hf_ms": [round(x * 1000, 2) for x in hfs],
                 "clawrl_cold_beside_decoding_ms": [round(x * 1000, 2) for x in busy]},
    }}


# ---------------------------------------------------------------- serving

def chat_tokenizer(tokenizer_dir: str | None, workdir: Path):
    """The embedded model's tokenizer as transformers loads it: the gateway renders the chat
    template and detokenises with it."""
    if tokenizer_dir and (Path(tokenizer_dir) / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    try:
        return AutoTokenizer.from_pretrained(default_model_path(build_if_missing=False))
    except FileNotFoundError:
        save_tokenizer(build_tokenizer(0), workdir / "tokenizer", 32768)  # trained here (seconds)
        return AutoTokenizer.from_pretrained(workdir / "tokenizer")


def speak_tokenizer(model, vocab_used: int) -> None:
    """Make the random model sample ids the tokenizer has, so the gateway has text to detokenise
    and stream (the 1.7B shape's 151936 ids are far more than the embedded tokenizer's): the
    (tied) embedding rows past ``vocab_used`` become zero, whose logit is then 0, and the others are
    scaled up 16 times, so that their logits dominate. The shape, and so every byte and FLOP of a
    step, stays as it was."""
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        for w in {id(emb): emb, id(model.lm_head.weight): model.lm_head.weight}.values():
            w[vocab_used:] = 0
            w[:vocab_used] *= 16


def serving_conversations(tok, n: int, prompt_tokens: int) -> list[list[dict]]:
    """``n`` different one-message chats of about ``prompt_tokens`` tokens: a numbered request
    over a slice of the OpenClaw system prompt's words (different slices, so that no prefix is
    shared beyond the template's first tokens)."""
    words = json.loads(FIXTURE.read_text())["body"]["messages"][0]["content"].split()
    per_word = len(tok.encode(" ".join(words), add_special_tokens=False)) / len(words)
    take = max(1, int((prompt_tokens - 16) / per_word))
    convs = []
    for i in range(n):
        start = (i * 101) % len(words)
        part = [words[(start + j) % len(words)] for j in range(take)]
        convs.append([{"role": "user", "content": f"Request {i}. Summarise this:\n" + " ".join(part)}])
    return convs


class LoopLag:
    """How late a 5 ms sleep wakes up on the event loop, on average: how busy the loop is."""

    def __init__(self):
        self.lags: list[float] = []
        self._task = None

    async def _probe(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - t - 0.005)

    def __enter__(self):
        self._task = asyncio.get_running_loop().create_task(self._probe())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()

    def mean_ms(self) -> float:
        return 1000 * statistics.fmean(self.lags) if self.lags else 0.0


def serving_summary(rows: list, wall: float, cpu: float, lag_ms: float) -> dict:
    firsts = sorted(f for f, _, _ in rows if f is not None)
    tokens = sum(n for _, _, n in rows)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(firsts) if firsts else float("nan"),
            "ttft_max_ms": 1000 * firsts[-1] if firsts else float("nan"),
            "latency_p50_ms": 1000 * statistics.median(t for _, t, _ in rows),
            "server_cpu_s": cpu, "loop_lag_ms": lag_ms}


async def serve_direct(eng: TorchEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Every prompt through ``engine.stream`` at once: first token, last token, tokens."""
    async def one(ids, p):
        t0 = time.perf_counter()
        first, n = None, 0
        async for chunk in eng.stream(ids, p):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
        return first, time.perf_counter() - t0, n

    await eng.flush_cache()
    cpu = time.process_time()
    with LoopLag() as lag:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(ids, p) for ids, p in zip(prompts, params)))
        wall = time.perf_counter() - t0
    return serving_summary(rows, wall, time.process_time() - cpu, lag.mean_ms())


async def serve_generate(eng: TorchEngine, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    """The same prompts through ``engine.generate`` (the whole result once, no per-token chunks):
    tok/s, to tell the cost of streaming tokens through the event loop from the gateway's."""
    await eng.flush_cache()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(eng.generate(ids, p) for ids, p in zip(prompts, params)))
    return sum(len(x.token_ids) for x in results) / (time.perf_counter() - t0)


def request_costs(gw, tok, reqs, prompts) -> dict:
    """What the gateway does for each request before its engine stream opens, timed alone (idle
    server, ms per request): rendering the chat template to ids on the event loop, and linking
    the turn into its session (a SQLite transaction, in a worker thread); and storing the finished
    turn. Under load these run one after another on the same GIL as the engine thread."""
    t = time.perf_counter()
    for r in reqs:
        render_prompt(tok, r, gw.max_context, False)
    render = (time.perf_counter() - t) / len(reqs)
    begin = record = 0.0
    for r, ids in zip(reqs, prompts):
        t = time.perf_counter()
        plan = gw.linker.begin([{"role": "user", "content": r.messages[0]["content"] + " (cost probe)"}], None)
        t1 = time.perf_counter()
        gw.linker.record(plan, prompt_ids=ids, response_ids=ids[:256], logprobs=[0.0] * len(ids[:256]),
                         weight_versions=[0] * len(ids[:256]), response_text="x" * 1000, status="complete")
        begin, record = begin + t1 - t, record + time.perf_counter() - t1
    return {"render_ms": round(1000 * render, 2), "link_begin_ms": round(1000 * begin / len(reqs), 2),
            "link_record_ms": round(1000 * record / len(reqs), 2)}


async def serve_http(eng: TorchEngine, url: str, model_name: str, convs_file: Path, new: int,
                     temperature: float) -> dict:
    """The same chats as streamed chat completions from the client process."""
    await eng.flush_cache()
    cpu = time.process_time()
    with LoopLag() as lag:
        proc = await asyncio.create_subprocess_exec(sys.executable, str(CLIENT), url, model_name, str(convs_file),
                                                    str(new), str(temperature), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"the serving client failed: {err.decode()[-1000:]}")
    d = json.loads(out.decode().strip().splitlines()[-1])
    # the client's own warm-up request ran inside this window too: a small overcount of the CPU
    return serving_summary(d["rows"], d["wall_s"], time.process_time() - cpu, lag.mean_ms())


async def run_serving(model, lm, args, streams, prompt_len, new, repeat, temperature: float = 1.0) -> dict:
    """Concurrent chats through the gateway (uvicorn + FastAPI + SSE + the turn store) against the
    same prompts through the engine directly, in the same process and on the same engine. A model
    loaded with its own tokenizer (a real one) serves as it is, greedy at ``temperature=0``, and
    stops where it stops; a random one is made to speak the embedded tokenizer and runs to ``new``."""
    work = Path(tempfile.mkdtemp(prefix="gpu-serving-"))
    if lm.tokenizer is None:
        tok = chat_tokenizer(args.tokenizer, work)
        speak_tokenizer(model, min(len(tok), model.config.vocab_size))
    else:
        tok = lm.tokenizer
    slm = LoadedModel(**{**vars(lm), "tokenizer": tok})
    cfg = compose([f"run_dir={work / 'run'}", f"engine.max_batch_size={max(streams)}",
                   f"server.max_queue={4 * max(streams)}", f"engine.decode_attention={args.decode_attention}"])
    eng = TorchEngine(slm, cfg.engine)
    app = create_app(cfg, eng, SessionLinker(TurnStore(cfg.run_dir), cfg.sessions.idle_timeout_s))
    gw = app.state.gateway
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())  # its lifespan starts the engine
    out = {"loop": type(asyncio.get_running_loop()).__module__, "decode_attention": args.decode_attention}
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        for n in streams:
            convs = serving_conversations(tok, n, prompt_len)
            convs_file = work / f"convs_{n}.json"
            convs_file.write_text(json.dumps(convs))
            reqs = [parse_chat_request({"model": gw.model_name, "messages": m, "max_tokens": new,
                                        "temperature": temperature, "top_p": 1.0, "stream": True}) for m in convs]
            prompts = [render_prompt(tok, r, gw.max_context, False).ids for r in reqs]
            params = [gw.sampling(r, len(ids)) for r, ids in zip(reqs, prompts)]  # as the gateway makes them
            await serve_direct(eng, prompts, params)  # warm-up: graph captures for these shapes
            direct, http, generate = [], [], []
            for _ in range(repeat):
                direct.append(await serve_direct(eng, prompts, params))
                http.append(await serve_http(eng, url, gw.model_name, convs_file, new, temperature))
                generate.append(await serve_generate(eng, prompts, params))
            for d in direct + http:  # a real model stops at its own end of turn: greedy, the same ones each run
                expected = n * new if lm.tokenizer is None else direct[0]["tokens"]
                if d["tokens"] != expected:
                    raise RuntimeError(f"{d['tokens']} tokens came back, not {expected}")
            d = sorted(direct, key=lambda x: x["tok_s"])[len(direct) // 2]  # the median run by throughput
            h = sorted(http, key=lambda x: x["tok_s"])[len(http) // 2]
            out[f"chats_{n}"] = {
                "gateway_tok_s": round(h["tok_s"], 1), "engine_tok_s": round(d["tok_s"], 1),
                "ratio": round(h["tok_s"] / d["tok_s"], 3),
                "gateway_ttft_p50_ms": round(h["ttft_p50_ms"], 1), "engine_ttft_p50_ms": round(d["ttft_p50_ms"], 1),
                "gateway_ttft_max_ms": round(h["ttft_max_ms"], 1), "engine_ttft_max_ms": round(d["ttft_max_ms"], 1),
                "gateway_latency_p50_ms": round(h["latency_p50_ms"], 1),
                "engine_latency_p50_ms": round(d["latency_p50_ms"], 1),
                "gateway_server_cpu_s": round(h["server_cpu_s"], 2), "engine_server_cpu_s": round(d["server_cpu_s"], 2),
                "gateway_loop_lag_ms": round(h["loop_lag_ms"], 2), "engine_loop_lag_ms": round(d["loop_lag_ms"], 2),
                "engine_generate_tok_s": round(statistics.median(generate), 1),
                "prompt_tokens_mean": round(statistics.fmean(len(p) for p in prompts), 1), "new_tokens": new,
                "per_request_alone": request_costs(gw, tok, reqs, prompts),
                "runs": {"gateway_tok_s": [round(x["tok_s"], 1) for x in http],
                         "engine_tok_s": [round(x["tok_s"], 1) for x in direct],
                         "engine_generate_tok_s": [round(x, 1) for x in generate]},
            }
            print(f"serving {n:>3} chats: gateway {h['tok_s']:9.1f} tok/s, TTFT p50 {h['ttft_p50_ms']:7.1f} ms; "
                  f"engine direct {d['tok_s']:9.1f} tok/s, TTFT p50 {d['ttft_p50_ms']:7.1f} ms; ratio "
                  f"{h['tok_s'] / d['tok_s']:5.2f}; loop lag {h['loop_lag_ms']:.2f} vs {d['loop_lag_ms']:.2f} ms, "
                  f"server CPU {h['server_cpu_s']:.1f} vs {d['server_cpu_s']:.1f} s; engine.generate "
                  f"{statistics.median(generate):.1f} tok/s; alone per request {out[f'chats_{n}']['per_request_alone']}  "
                  f"runs {out[f'chats_{n}']['runs']}", flush=True)
    finally:
        server.should_exit = True
        await serving  # the lifespan shuts the engine down
    return out


# ---------------------------------------------------------------- report

def commit() -> str:
    if os.environ.get("CLAWRL_COMMIT"):
        return os.environ["CLAWRL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(results: dict) -> str:
    lines = []
    decodes = [k for k in results if k == "decode" or k.startswith("decode_")]
    if decodes or results.get("prefill"):
        lines += ["| what | clawrl | HF baseline, same run | clawrl / HF |", "|---|---:|---:|---:|"]
    for part in decodes:
        how = "" if part == "decode" else f", {part[7:]} attention"
        for key, d in results[part].items():
            if key.startswith("streams_"):
                lines.append(f"| decode{how}, {key[8:]} stream(s), tok/s (greedy: {d['clawrl_greedy_tok_s']:.0f}) "
                             f"| {d['clawrl_tok_s']:.0f} | {d['hf_tok_s']:.0f} | {d['ratio']:.2f} |")
    p = results.get("prefill", {}).get("openclaw")
    if p:
        lines.append(f"| cold prefill, OpenClaw request ({p['tokens']} tokens), ms | {p['clawrl_ms']:.0f} "
                     f"| {p['hf_ms']:.0f} | {p['ratio_to_hf']:.2f} (HF/clawrl {1 / p['ratio_to_hf']:.2f}) |")
        lines.append(f"| prefix-cache hit, same request, ms | {p['hit_ms']:.1f} | | {p['hit_over_cold']:.1%} of cold |")
        if "cold_beside_decoding_ms" in p:
            lines.append(f"| cold prefill while {p['decoding_streams']} streams decode (chunked), ms "
                         f"| {p['cold_beside_decoding_ms']:.0f} | {p['hf_ms']:.0f} "
                         f"| {p['cold_beside_decoding_ms'] / p['hf_ms']:.2f} |")
    sync = results.get("sync")
    if sync:
        lines += ["", f"| weight sync across processes, {sync['bytes'] / 2**30:.2f} GiB | ms |", "|---|---:|",
                  f"| raw device copy in one process (floor) | {sync['raw_copy_ms']:.1f} |"]
        lines += [f"| {b} | {sync[b]['ms']:.0f} |" for b in ("ipc", "gloo") if b in sync]
    train = results.get("train")
    if train:
        lines += ["", "| training, {} x {} tokens a step | tok/s | MFU | / HF loop | peak GiB |".format(
            train["sequences"], train["seq_len"]), "|---|---:|---:|---:|---:|",
            f"| HF loop (probe) | {train['hf']['tok_s']:.0f} | {train['hf']['mfu']:.1%} | 1.00 | |"]
        for key, d in ((k, d) for k, d in train.items() if k.startswith("torch")):
            name = "clawrl torch trainer" + ("" if key == "torch" else f", {' '.join(d['overrides'])}")
            lines.append(f"| {name} | {d['tok_s']:.0f} | {d['mfu']:.1%} | {d['ratio_to_hf']:.2f} "
                         f"| {d['peak_mem_gib']:.1f} |")
        for key in ("megatron", "megatron_eager"):
            meg = train.get(key, {})
            if "tok_s" in meg:
                name = "clawrl megatron backend" + (f", {' '.join(meg['overrides'])}" if meg["overrides"] else "")
                lines.append(f"| {name} (1 rank; {meg['ratio_to_torch']:.2f}x the torch trainer) | {meg['tok_s']:.0f} "
                             f"| {meg['mfu']:.1%} | {meg['ratio_to_hf']:.2f} | {meg['peak_mem_gib']:.1f} |")
    if results.get("hybrid"):
        from gpu_hybrid import hybrid_table

        lines += hybrid_table(results["hybrid"])
    if results.get("real"):
        from gpu_real_model import real_table

        lines += real_table(results["real"])
    serving = [k for k in results if k == "serving" or k.startswith("serving_")]
    if serving:
        lines += ["", "| concurrent chats | gateway tok/s | engine direct tok/s | gateway / direct "
                      "| TTFT p50 gateway / direct, ms | latency p50 gateway / direct, ms |",
                  "|---|---:|---:|---:|---:|---:|"]
    for part in serving:
        how = "" if part == "serving" else f" ({part[8:]} attention)"
        for key, d in ((k, d) for k, d in results[part].items() if k.startswith("chats_")):
            lines.append(f"| {key[6:]}{how} | {d['gateway_tok_s']:.0f} | {d['engine_tok_s']:.0f} | {d['ratio']:.2f} "
                         f"| {d['gateway_ttft_p50_ms']:.0f} / {d['engine_ttft_p50_ms']:.0f} "
                         f"| {d['gateway_latency_p50_ms']:.0f} / {d['engine_latency_p50_ms']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("decode", "prefill", "serving", "train", "sync", "staleness", "hybrid", "real",
                                       "all"), default="all")
    ap.add_argument("--model-dir", default=None,
                    help="--part real: an HF model directory or a fetched model's name (clawrl model get)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="model shape (default: qwen3-1.7b on a GPU, tiny on a CPU)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is reported")
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the embedded model's)")
    ap.add_argument("--out", default=None, help="JSON file to merge the figures into")
    ap.add_argument("--decode-attention", choices=ATTENTIONS, default="sdpa",
                    help="engine.decode_attention; decode figures of another than the default (sdpa) go under "
                         "decode_<name>")
    ap.add_argument("--train-variants", default=None,
                    help="comma-separated trainer variants for --part train, megatron_parts and megatron_eager "
                         "among them (default: all; 'default' is always measured)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = args.shape or ("qwen3-1.7b" if device == "cuda" else "tiny")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / ("h200.json" if device == "cuda"
                                                                              else "cpu.json")
    streams, prompt_len, new, limit = SIZES[shape]
    t0 = time.perf_counter()
    stamp = {"commit": commit(), "command": "python benchmarks/gpu_suite.py " + shlex.join(sys.argv[1:] if argv is None
                                                                                            else argv)}
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.part in ("train", "all"):  # first, on a device nothing else holds yet
        from gpu_train import run_train

        def words_tokenizer(model_dir: Path) -> None:  # the trainer loads one; the ids are random
            save_tokenizer(train_tokenizer(["the model has random weights"] * 8, vocab_size=300), model_dir, 8192)
        only = args.train_variants.split(",") if args.train_variants else None
        train = run_train(build_model, shape, device, words_tokenizer, only)
        for key, d in train.items():
            if isinstance(d, dict):
                d.update(stamp, shape=shape)
        results["train"] = train
    if args.part in ("sync", "all"):
        from gpu_sync import run_sync

        sync_figures = run_sync(build_model, shape, device, args.repeat, serve=lambda m: served(m, shape))
        results["sync"] = {**sync_figures, **stamp, "shape": shape}
    if args.part == "staleness":  # not in "all": two servers for a minute and a half each
        from gpu_staleness import run_staleness

        results["staleness"] = {**run_staleness(SHAPES[shape], device), **stamp, "shape": shape}
    if args.part == "hybrid":  # not in "all": two more models, served and trained
        from gpu_hybrid import run_hybrid

        def words(model_dir: Path) -> None:
            save_tokenizer(train_tokenizer(["the model has random weights"] * 8, vocab_size=300), model_dir, 8192)
        results["hybrid"] = {**run_hybrid(build_model, shape, device, args.repeat, words), **stamp, "shape": shape}
    if args.part == "real":  # not in "all": a real model directory, which the device must be given
        from gpu_real_model import run_real

        results["real"] = {**run_real(args, run_decode, run_serving), **stamp}
    if args.part in ("train", "sync", "staleness", "hybrid", "real"):
        return write_results(out, results, stamp, shape, t0)
    model = build_model(shape, device)
    lm = served(model, shape)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters on "
          f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}, {lm.dtype}; torch {torch.__version__}",
          flush=True)
    results["meta"] = {"shape": shape, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                       "torch": torch.__version__, "dtype": str(lm.dtype), **stamp}
    if args.part in ("decode", "all"):
        dec = asyncio.run(run_decode(model, lm, args, streams, prompt_len, new, args.repeat))
        engine = dec.pop("engine")
        for d in dec.values():
            d.update(stamp, shape=shape, prompt_tokens=prompt_len, new_tokens=new, decode_attention=args.decode_attention)
        key = "decode" if args.decode_attention == "sdpa" else f"decode_{args.decode_attention}"
        results[key] = {**dec, "static_decode": engine}
    if args.part in ("prefill", "all"):
        others = torch.randint(0, model.config.vocab_size, (8, prompt_len)).tolist()
        pre = asyncio.run(run_prefill(model, lm, args, limit, args.repeat, others, 4 * new))
        pre["openclaw"].update(stamp, shape=shape)
        results["prefill"] = pre
    if args.part in ("serving", "all"):  # last: it changes the model's weights (speak_tokenizer)
        chats, prompt_tokens, serve_new = SERVING[shape]
        # the event loop `clawrl serve` gets (uvicorn's choice: uvloop where it is installed)
        with asyncio.Runner(loop_factory=uvicorn.Config(None).get_loop_factory()) as runner:
            srv = runner.run(run_serving(model, lm, args, chats, prompt_tokens, serve_new, args.repeat))
        for key, d in srv.items():
            if key.startswith("chats_"):
                d.update(stamp, shape=shape)
        results["serving" if args.decode_attention == "sdpa" else f"serving_{args.decode_attention}"] = srv
    return write_results(out, results, stamp, shape, t0)


def write_results(out: Path, results: dict, stamp: dict, shape: str, t0: float) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\n{table(results)}\n\n({shape}, {device}, commit {stamp['commit']}, "
          f"{time.perf_counter() - t0:.0f} s; written to {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
