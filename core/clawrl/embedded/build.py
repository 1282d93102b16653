"""Build the embedded default model: corpus, tokenizer, pretraining, all on a plain CPU.

clawrl must work offline with nothing to download, so it trains its own small chat model
(``clawrl model build``; ``default_model_path()`` builds it on first use). No ``model.path`` means
this model: ``resolve_model(cfg)`` decides that, once, in each entry point before any engine or
trainer is made; engines and trainers only ever see a directory. The shape was chosen by
measurement on a 2-core CPU: under a few minutes of training a tiny Qwen3 (hidden 128, 2 layers,
0.4M parameters beside the 8192x128 tied embedding) beats a 4M one because it sees more tokens.
Training runs a fixed number of steps, not a fixed time, so a seed always gives byte-identical
weights (with the same thread count and library versions).

Most steps are 16 packed rows of 256 tokens of short chats; every ``LONG_EVERY``-th step is one
4096-token row that starts with a long system prompt, so the model learns to answer after the
kind of prefix a real agent client sends (more long steps cost addition accuracy for the same
time); every ``AGENT_EVERY``-th step is four 1024-token rows of whole agent episodes
(``clawrl.embedded.agentic``: python tool calls and boxed answers, bash blocks and bash tool calls,
computer-use JSON); every ``DRILL_EVERY``-th step is eight 512-token rows of toolcall drills
(``agentic.toolcall_drill``: whole tool calls trained on all but their first token, so the model
copies numbers better without being taught when to call). Loss is on assistant tokens only, and only those positions go through the
output layer, which with an 8k vocabulary would otherwise be most of the compute.

Measured (seed 0, 1875 steps, two threads on the shared 2-core box: 527 s; BENCHMARKS.md, "Toolcall
drills in the embedded build"): additions of held-out pairs 73/76/78% (three sets of 100), 77% after
a 9k-character system prompt; toolcall-rl greedy test success 0.145, T=1 train success 0.21. The
same recipe without the drills (1500 steps) added better (81-85%, 83%) but succeeded on 0.9% of
T=1 toolcall episodes, too few for GRPO groups to differ. At 1300 steps without drills the agent
episodes were not yet learned (0.004 on toolcall-rl); before agent episodes existed (900 steps)
additions were 83-95%, and lr 3e-3 stalled at 30% where 2e-3 reached 85%.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tqdm import tqdm
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from clawrl.config import ClawrlConfig
from clawrl.embedded.corpus import agent_episode, chat_pieces, drill_episode, long_chat, short_chat
from clawrl.embedded.english import english_paragraphs
from clawrl.embedded.evaluate import evaluate_addition
from clawrl.embedded.tokenizer import ENDOFTEXT, IM_END, render_chat, save_tokenizer, train_tokenizer
from clawrl.errors import CliError
from clawrl.paths import data_dir, share_tree

MODEL_NAME = "clawrl-tiny"
DEFAULT_STEPS = 1875  # calibrated: about 7.5 minutes for the whole build on 2 idle cores (0.23 s a step)
SHORT_ROWS, SHORT_LEN = 16, 256
LONG_LEN = 4096
LONG_EVERY = 16
# Every AGENT_EVERY-th step (that is not a long one) is AGENT_ROWS rows of AGENT_LEN tokens of agent
# episodes, packed whole (padded, never cut: a tool call trained without the question it copies
# from would teach the model to invent numbers).
AGENT_EVERY, AGENT_ROWS, AGENT_LEN = 4, 4, 1024
# Every DRILL_EVERY-th step (neither long nor agent) is DRILL_ROWS rows of toolcall drills, packed whole.
DRILL_EVERY, DRILL_ROWS, DRILL_LEN = 5, 8, 512
LR, WARMUP, MIN_LR_RATIO = 2e-3, 30, 0.1
ROPE_THETA = 10_000.0
TOKENIZER_CHATS = 6000  # short chats the tokenizer trains on, beside the English text
TOKENIZER_AGENT_CHATS = 1500  # and agent episodes
MAX_POSITIONS = 32768


def recipe_hash() -> str:
    """Short hash of everything the build depends on: this package's code (corpus, tokenizer,
    training recipe) and the Python minor version (the English text comes from its stdlib).

    It is part of the cache directory's name, so changing the recipe builds a new model instead of
    silently serving one made by older code.
    """
    h = hashlib.sha256(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    for src in sorted([*Path(__file__).parent.glob("*.py"), *Path(__file__).parent.glob("*.jsonl")]):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:10]


def _cache_dir(seed: int, steps: int) -> Path:
    name = f"{MODEL_NAME}-seed{seed}" + ("" if steps == DEFAULT_STEPS else f"-steps{steps}") + f"-{recipe_hash()}"
    return data_dir() / "models" / name


def default_model_path(build_if_missing: bool = True) -> Path:
    """The cached default model directory; built (about 4 minutes, with a message) when missing."""
    path = _cache_dir(0, DEFAULT_STEPS)
    if (path / "model.safetensors").exists():
        return path
    if not build_if_missing:
        raise FileNotFoundError(f"the embedded model is not built yet ({path}); run `clawrl model build`")
    print(f"clawrl: building the embedded model {MODEL_NAME} into {path} (a few minutes, once)", file=sys.stderr)
    return build_model()


def resolve_model(cfg: ClawrlConfig) -> ClawrlConfig:
    """``cfg`` with the model it serves and trains resolved to a directory: unchanged when
    ``model.path`` is set; otherwise the embedded model (``default_model_path``, built on first use),
    served as ``clawrl-tiny`` unless ``model.name`` names it. A copy: the config is not changed."""
    if cfg.model.path is not None:
        return cfg
    model = dataclasses.replace(cfg.model, path=str(default_model_path()), name=cfg.model.name or MODEL_NAME)
    return dataclasses.replace(cfg, model=model)


@contextmanager
def _build_lock(target: Path):
    """One build per target at a time; a second process waits and then finds the model built."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_model(seed: int = 0, steps: int | None = None, out: str | Path | None = None, force: bool = False) -> Path:
    """Train tokenizer and model for ``seed`` and ``steps`` (default: the calibrated budget) into
    ``out`` (default: the cache) and return the directory. Reuses an existing build unless
    ``force``. Written to a temporary sibling and renamed, so a killed build leaves nothing behind."""
    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 1:
        raise ValueError("steps must be at least 1")
    target = Path(out) if out is not None else _cache_dir(seed, steps)
    if target.exists() and not (target / "model.safetensors").exists() and (target.is_file() or any(target.iterdir())):
        # --force replaces a model directory; it must never delete a directory of someone else's files.
        raise FileExistsError(f"{target} exists and is not a model directory; choose a new or empty one")
    with _build_lock(target):
        if (target / "model.safetensors").exists() and not force:
            return target
        for stale in target.parent.glob(f".{target.name}.*"):  # left by a build killed with SIGKILL
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _build_into(tmp, seed, steps)
            share_tree(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_into(out: Path, seed: int, steps: int) -> None:
    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        tok = build_tokenizer(seed)
        model = _train_model(tok, seed, steps)
        _save(model, tok, out)
        accuracy = evaluate_addition(out, n=100, seed=seed + 1)
    finally:
        torch.set_num_threads(threads)
    info = {
        "name": MODEL_NAME, "seed": seed, "steps": steps, "addition_accuracy": accuracy,
        "parameters": sum(p.numel() for p in model.parameters()), "build_seconds": round(time.time() - t0, 1),
        "versions": _versions(),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"clawrl: built {MODEL_NAME} in {info['build_seconds']} s; held-out addition accuracy {accuracy:.0%}", file=sys.stderr)


def _versions() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def tokenizer_chats(seed: int):
    """The chats the tokenizer of ``seed`` trains on: short chats, then agent episodes."""
    rng = random.Random(f"tokenizer-{seed}")
    for _ in range(TOKENIZER_CHATS):
        yield short_chat(rng)
    rng = random.Random(f"tokenizer-agent-{seed}")
    for _ in range(TOKENIZER_AGENT_CHATS):
        yield agent_episode(rng)


def build_tokenizer(seed: int = 0):
    """The embedded tokenizer for ``seed``: trained on the corpus's chats plus stdlib English."""
    texts = [render_chat(c.messages, c.tools) for c in tokenizer_chats(seed)]
    return train_tokenizer(texts + list(english_paragraphs()))


def _token_stream(tok, chats):
    """(ids, trained) tensors for each chat of the batches in ``chats``. Pieces are encoded one by
    one, as the engine will see them: a prompt ending in ``<|im_start|>assistant\n``, then replies."""
    for chat_batch in chats:
        pieces = [chat_pieces(c) for c in chat_batch]
        flat = [t for p in pieces for t, _ in p]
        encs = iter(tok.encode_batch(flat, add_special_tokens=False))
        for p in pieces:
            ids, mask = [], []
            for _, trained in p:
                e = next(encs).ids
                ids += e
                mask += [trained] * len(e)
            yield torch.tensor(ids), torch.tensor(mask)


def _rows(stream, length: int):
    """Pack the stream into rows of ``length`` tokens (chats cut at row ends)."""
    ids_buf, mask_buf, n = [], [], 0
    for ids, mask in stream:
        ids_buf.append(ids)
        mask_buf.append(mask)
        n += len(ids)
        while n >= length:
            ids_all, mask_all = torch.cat(ids_buf), torch.cat(mask_buf)
            yield ids_all[:length], mask_all[:length]
            ids_buf, mask_buf, n = [ids_all[length:]], [mask_all[length:]], n - length


def _packed_rows(stream, length: int, pad_id: int):
    """Pack whole chats into rows of ``length`` tokens, padding (untrained) what is left of a row;
    a chat longer than a row is cut to it."""
    ids_buf, mask_buf, n = [], [], 0
    for ids, mask in stream:
        ids, mask = ids[:length], mask[:length]
        if n + len(ids) > length:
            pad = length - n
            yield (torch.cat(ids_buf + [torch.full((pad,), pad_id)]),
                   torch.cat(mask_buf + [torch.zeros(pad, dtype=mask.dtype)]))
            ids_buf, mask_buf, n = [], [], 0
        ids_buf.append(ids)
        mask_buf.append(mask)
        n += len(ids)


def step_kind(step: int) -> str:
    """Which stream a training step reads: "long", "agent", "drill" or "short"."""
    if step % LONG_EVERY == LONG_EVERY - 1:
        return "long"
    if step % AGENT_EVERY == AGENT_EVERY - 1:
        return "agent"
    if step % DRILL_EVERY == DRILL_EVERY - 1:
        return "drill"
    return "short"


def token_budgets(steps: int) -> dict[str, int]:
    """The most tokens each stream's rows hold over ``steps`` steps (what the build can train on)."""
    per_step = {"short": SHORT_ROWS * SHORT_LEN, "long": LONG_LEN, "agent": AGENT_ROWS * AGENT_LEN,
                "drill": DRILL_ROWS * DRILL_LEN}
    budgets = dict.fromkeys(per_step, 0)
    for step in range(steps):
        budgets[step_kind(step)] += per_step[step_kind(step)]
    return budgets


def _chat_batches(seed: int, kind: str):
    rng = random.Random(f"{kind}-{seed}")
    paragraphs = english_paragraphs()
    while True:
        if kind == "short":
            yield [short_chat(rng) for _ in range(64)]
        elif kind == "agent":
            yield [agent_episode(rng) for _ in range(64)]
        elif kind == "drill":
            yield [drill_episode(rng) for _ in range(64)]
        else:
            yield [long_chat(rng, paragraphs)]


def model_config(vocab_size: int, eos_id: int, pad_id: int):
    """The tiny Qwen3 shape (0.8M parameters beside the embeddings)."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=32, intermediate_size=384, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, eos_token_id=eos_id, pad_token_id=pad_id,
        bos_token_id=None, clawrl_model_name=MODEL_NAME,
    )


def _lr(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def _train_model(tok, seed: int, steps: int):
    torch.manual_seed(seed)
    config = model_config(tok.get_vocab_size(), tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT))
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    short_rows = _rows(_token_stream(tok, _chat_batches(seed, "short")), SHORT_LEN)
    long_rows = _rows(_token_stream(tok, _chat_batches(seed, "long")), LONG_LEN)
    agent_rows = _packed_rows(_token_stream(tok, _chat_batches(seed, "agent")), AGENT_LEN, config.pad_token_id)
    drill_rows = _packed_rows(_token_stream(tok, _chat_batches(seed, "drill")), DRILL_LEN, config.pad_token_id)
    seen, t0 = 0, time.time()
    bar = tqdm(range(steps), desc=f"training {MODEL_NAME}", unit="step", file=sys.stderr)
    for step in bar:
        kind = step_kind(step)
        if kind == "long":
            rows = [next(long_rows)]
        elif kind == "agent":
            rows = [next(agent_rows) for _ in range(AGENT_ROWS)]
        elif kind == "drill":
            rows = [next(drill_rows) for _ in range(DRILL_ROWS)]
        else:
            rows = [next(short_rows) for _ in range(SHORT_ROWS)]
        ids = torch.stack([r[0] for r in rows])
        mask = torch.stack([r[1] for r in rows])[:, 1:]
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps)
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        logits = model.lm_head(hidden[mask])
        loss = F.cross_entropy(logits.float(), ids[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += ids.numel()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{seen / (time.time() - t0):.0f}")
    model.eval()
    return model


def _save(model, tok, out: Path) -> None:
    model.save_pretrained(str(out), safe_serialization=True)
    eos = [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.token_to_id(ENDOFTEXT), do_sample=False).save_pretrained(str(out))
    save_tokenizer(tok, out, model_max_length=MAX_POSITIONS)


def build_cli(args) -> int:
    """``clawrl model build [--seed N] [--steps N] [--out DIR] [--force]``."""
    if args.steps is not None and args.steps < 1:
        raise CliError("--steps must be at least 1")
    try:
        path = build_model(seed=args.seed, steps=args.steps, out=args.out, force=args.force)
    except FileExistsError as e:
        raise CliError(str(e)) from None
    info = json.loads((path / "build_info.json").read_text())
    print(f"{path}  (seed {info['seed']}, {info['steps']} steps, addition accuracy {info['addition_accuracy']:.0%})")
    return 0
