"""How well the embedded model adds: the skill its build is calibrated on.

Held-out pairs only (``corpus.is_held_out``), asked through the chat template with the trained
phrasings, decoded greedily with HF ``generate``. A reply counts when its last number is the sum,
so "12", "7 + 5 = 12" and "The answer is 12." all pass.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawrl.embedded.corpus import ADDITION_QUESTIONS, sample_pair


def _last_int(text: str) -> int | None:
    nums = re.findall(r"-?\d+", text)
    return int(nums[-1]) if nums else None


def evaluate_addition(model_dir: str | Path, n: int = 100, seed: int = 0, system_prompt: str | None = None,
                      batch_size: int = 50) -> float:
    """Fraction of ``n`` held-out additions answered with the right number. ``system_prompt``
    (e.g. a few thousand tokens of instructions) is put before each question when given."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    rng = random.Random(seed)
    pairs = [sample_pair(rng, held_out=True) for _ in range(n)]
    prompts = []
    for i, (a, b) in enumerate(pairs):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": ADDITION_QUESTIONS[i % len(ADDITION_QUESTIONS)].format(a=a, b=b)})
        prompts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    correct = 0
    for start in range(0, n, batch_size):
        enc = tok(prompts[start:start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=16, do_sample=False)
        for (a, b), row in zip(pairs[start:start + batch_size], out[:, enc["input_ids"].shape[1]:]):
            correct += _last_int(tok.decode(row, skip_special_tokens=True)) == a + b
    return correct / n
