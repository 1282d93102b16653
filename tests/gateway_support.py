"""Test helpers for the gateway: a small byte-level BPE tokenizer with a Qwen-style (ChatML +
Hermes tools) chat template, and a tiny Qwen3 model trained in seconds to answer
deterministically, so tests can assert what a real engine returns end to end."""
from __future__ import annotations

import json
import asyncio
import os
import shutil
import socket
import threading
import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role in ('user', 'system') %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% for tc in message.tool_calls or [] %}{% if message.content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_ANSWER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLAIN_ANSWER = "Hello! The sky is blue and the sea is calm."

_CORPUS = [
    PLAIN_ANSWER, TOOL_ANSWER, CHAT_TEMPLATE, json.dumps(WEATHER_TOOL),
    "What is the weather in Paris? Tell me a story about a cat. How are you today? Thanks, bye.",
    "The quick brown fox jumps over the lazy dog. 0123456789 café naïve 東京 ✓ emoji 🙂",
]


def build_tokenizer(out: Path):
    """A byte-level BPE tokenizer (vocab ~600) with ChatML specials; <tool_call> is a normal
    added token, as in Qwen, so it survives ``skip_special_tokens`` decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
    )
    fast.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_tiny_model(out: Path, max_steps: int = 150, seed: int = 0) -> Path:
    """A 2-layer Qwen3 that has memorised two answers: with tools in the prompt it calls
    get_weather(city=Paris); without, it says PLAIN_ANSWER. Greedy decoding reproduces them."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    final = Path(out)
    if (final / "model.safetensors").exists():
        return final
    out = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend (20x slower on a busy box)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg)
    questions = ["What is the weather in Paris?", "Tell me a story about a cat.", "Hi"]
    samples = []
    for q in questions:
        for system in (None, "You are a helpful assistant."):
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
            for tools, answer in ((None, PLAIN_ANSWER), ([WEATHER_TOOL], TOOL_ANSWER)):
                prompt = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
                p = tok(prompt, add_special_tokens=False)["input_ids"]
                a = tok(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
                samples.append((p, a))
    width = max(len(p) + len(a) for p, a in samples)
    ids = torch.full((len(samples), width), tok.pad_token_id)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (p, a) in enumerate(samples):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    steps = 0
    for _ in range(max_steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        steps += 1
        if loss.item() < 0.02:  # memorised: greedy decoding now reproduces both answers
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(out)
    (out / "train_log.txt").write_text(f"steps {steps} loss {loss.item():.4f}\n")
    try:
        os.replace(out, final)  # atomic: a concurrent test run sees no half-written model
    except OSError:
        shutil.rmtree(out, ignore_errors=True)  # another run finished first
    return final


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A live uvicorn server for an app, in a thread, on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def model_cache_dir() -> Path:
    """Where the tiny test model is cached across test runs (rebuilt when its recipe changes)."""
    import hashlib

    import inspect

    recipe = "".join([CHAT_TEMPLATE, json.dumps(_CORPUS), inspect.getsource(build_tokenizer),
                      inspect.getsource(build_tiny_model)])
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    root = Path(os.environ.get("CLAWRL_TEST_CACHE", Path.home() / ".cache" / "clawrl-tests"))
    return root / f"gateway-tiny-{digest}"


def load_tiny(path: Path, name: str = "tiny"):
    from clawrl.engines.loading import load_model

    return load_model(str(path), device="cpu", dtype="float32", name=name)


def make_controlled_engine(loaded, engine_cfg):
    """The real TorchEngine with knobs for deterministic error paths (never for behaviour claims):
    hold streams at a gate (overload), force long, slow generations (disconnect), fail."""
    from dataclasses import replace

    from clawrl.engines.torch_engine import TorchEngine

    class ControlledEngine(TorchEngine):
        def __init__(self):
            super().__init__(loaded, engine_cfg)
            self.released = threading.Event()
            self.released.set()
            self.force_long = False
            self.step_delay = 0.0  # seconds added to every scheduler step, so generation is slow
            self.fail_on_open: Exception | None = None
            self.fail_mid_stream: Exception | None = None
            self.aborted: list[str] = []

        def stream(self, prompt_ids, params, request_id=None):
            if self.fail_on_open is not None:
                raise self.fail_on_open
            if self.force_long:
                params = replace(params, ignore_eos=True)
            return self._paced(super().stream(prompt_ids, params, request_id))

        async def _paced(self, inner):
            try:
                async for chunk in inner:
                    while not self.released.is_set():
                        await asyncio.sleep(0.01)
                    yield chunk
                    if self.fail_mid_stream is not None:
                        raise self.fail_mid_stream
            finally:
                await inner.aclose()

        def _step(self):
            if self.step_delay:
                time.sleep(self.step_delay)
            super()._step()

        async def abort(self, request_id):
            self.aborted.append(request_id)
            return await super().abort(request_id)

    return ControlledEngine()
