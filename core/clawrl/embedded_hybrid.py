"""``clawrl model build arch=hybrid``: the embedded chat model's recipe on a tiny hybrid
linear-attention model (Qwen3-Next's layout), so the hybrid path has a chat model that speaks, to
serve and to run the demos with, beside the attention one.

Same tokenizer, corpus, step mix, learning-rate schedule and step count as ``clawrl model build``
(``clawrl.embedded.build``, whose helpers it calls); only the model differs: 4 layers, three Gated
DeltaNet layers then one gated full-attention layer, hidden size 128 like the default model's.

It lives outside ``clawrl/embedded/`` on purpose: every file there is hashed into the default
model's cache name, so adding this one there would rebuild the default model for everyone. Its own
cache name hashes the default recipe and this file. It is not built in CI (the pure-torch delta
rule trains slower than attention on a CPU); its benchmark command builds it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from clawrl.embedded import build
from clawrl.embedded.evaluate import evaluate_addition
from clawrl.embedded.tokenizer import ENDOFTEXT, IM_END
from clawrl.errors import CliError
from clawrl.paths import data_dir, share_tree

MODEL_NAME = "clawrl-tiny-hybrid"
ARCHS = ("qwen3", "hybrid")


def recipe_hash() -> str:
    """The default recipe's hash and this file's bytes: a change to either builds a new model."""
    h = hashlib.sha256(build.recipe_hash().encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:10]


def cache_dir(seed: int, steps: int) -> Path:
    name = f"{MODEL_NAME}-seed{seed}" + ("" if steps == build.DEFAULT_STEPS else f"-steps{steps}")
    return data_dir() / "models" / f"{name}-{recipe_hash()}"


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> Qwen3NextConfig:
    """The tiny hybrid: 4 layers (linear, linear, linear, full), hidden 128, dense MLP."""
    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=0,
        max_position_embeddings=build.MAX_POSITIONS, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": build.ROPE_THETA, "partial_rotary_factor": 0.25},
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, clawrl_model_name=MODEL_NAME,
    )


def train_model(tok, seed: int, steps: int):
    """``clawrl.embedded.build``'s training loop on ``model_config`` (that loop builds its own Qwen3)."""
    torch.manual_seed(seed)
    config = model_config(tok.get_vocab_size(), tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT))
    config._attn_implementation = "sdpa"
    model = Qwen3NextForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=build.LR, betas=(0.9, 0.95), weight_decay=0.01)
    streams = {
        "short": (build._rows(build._token_stream(tok, build._chat_batches(seed, "short")), build.SHORT_LEN),
                  build.SHORT_ROWS),
        "long": (build._rows(build._token_stream(tok, build._chat_batches(seed, "long")), build.LONG_LEN), 1),
        "agent": (build._packed_rows(build._token_stream(tok, build._chat_batches(seed, "agent")), build.AGENT_LEN,
                                     config.pad_token_id), build.AGENT_ROWS),
        "drill": (build._packed_rows(build._token_stream(tok, build._chat_batches(seed, "drill")), build.DRILL_LEN,
                                     config.pad_token_id), build.DRILL_ROWS),
    }
    seen, t0 = 0, time.time()
    bar = tqdm(range(steps), desc=f"training {MODEL_NAME}", unit="step", file=sys.stderr)
    for step in bar:
        rows_iter, n_rows = streams[build.step_kind(step)]
        rows = [next(rows_iter) for _ in range(n_rows)]
        ids = torch.stack([r[0] for r in rows])
        mask = torch.stack([r[1] for r in rows])[:, 1:]
        for g in opt.param_groups:
            g["lr"] = build._lr(step, steps)
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        loss = F.cross_entropy(model.lm_head(hidden[mask]).float(), ids[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += ids.numel()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{seen / (time.time() - t0):.0f}")
    model.eval()
    return model


def build_hybrid(seed: int = 0, steps: int | None = None, out: str | Path | None = None, force: bool = False) -> Path:
    """Build (or reuse) the tiny hybrid chat model into ``out`` (default: its cache directory);
    written to a temporary sibling and renamed, as ``clawrl.embedded.build.build_model`` does."""
    steps = build.DEFAULT_STEPS if steps is None else steps
    if steps < 1:
        raise ValueError("steps must be at least 1")
    target = Path(out) if out is not None else cache_dir(seed, steps)
    if target.exists() and not (target / "model.safetensors").exists() and (target.is_file() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not a model directory; choose a new or empty one")
    with build._build_lock(target):
        if (target / "model.safetensors").exists() and not force:
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            t0, threads = time.time(), torch.get_num_threads()
            torch.set_num_threads(min(2, os.cpu_count() or 1))
            try:
                tok = build.build_tokenizer(seed)
                model = train_model(tok, seed, steps)
                build._save(model, tok, tmp)
                accuracy = evaluate_addition(tmp, n=100, seed=seed + 1)
            finally:
                torch.set_num_threads(threads)
            info = {"name": MODEL_NAME, "arch": "hybrid", "seed": seed, "steps": steps,
                    "addition_accuracy": accuracy, "parameters": sum(p.numel() for p in model.parameters()),
                    "build_seconds": round(time.time() - t0, 1), "versions": build._versions()}
            (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
            share_tree(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_cli(args) -> int:
    """``clawrl model build [arch=qwen3|hybrid] [--seed N] [--steps N] [--out DIR] [--force]``: the
    default (Qwen3) embedded model, or with ``arch=hybrid`` this module's."""
    arch = "qwen3"
    for item in getattr(args, "settings", None) or []:
        key, sep, value = item.partition("=")
        if key != "arch" or not sep:
            raise CliError(f"clawrl model build takes arch=qwen3|hybrid, not '{item}'")
        if value not in ARCHS:
            raise CliError(f"arch={value}: one of {', '.join(ARCHS)}")
        arch = value
    if arch == "qwen3":
        return build.build_cli(args)
    if args.steps is not None and args.steps < 1:
        raise CliError("--steps must be at least 1")
    try:
        path = build_hybrid(seed=args.seed, steps=args.steps, out=args.out, force=args.force)
    except FileExistsError as e:
        raise CliError(str(e)) from None
    info = json.loads((path / "build_info.json").read_text())
    print(f"{path}  ({MODEL_NAME}, seed {info['seed']}, {info['steps']} steps, "
          f"addition accuracy {info['addition_accuracy']:.0%})")
    return 0
