"""What a model directory says about ending and sampling a reply.

A pretrained chat model ends a turn with more than its one ``eos_token_id``: SmolLM2 names only
``<|im_end|>`` yet also samples ``<|endoftext|>``, and a reply that runs past it rambles on. Its
``generation_config.json`` also carries the temperature/top-p/top-k its authors tuned it for.
Every engine, the gateway and the environment rollouts ask here, so they agree.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from transformers import GenerationConfig

log = logging.getLogger(__name__)

# special tokens that close a turn in the common chat formats (ChatML, Llama 3, Phi-3, Gemma, Llama 2)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>",
                      "</s>")


def end_of_turn_ids(tokenizer, *configs) -> list[int]:
    """Every id that ends a reply: ``eos_token_id`` of each config (an int or a list; pass the
    generation config and the model config), the tokenizer's eos, and the well-known end-of-turn
    tokens the tokenizer holds as special tokens."""
    ids: list[int] = []
    for value in [getattr(c, "eos_token_id", None) for c in configs] + [tokenizer.eos_token_id]:
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in ids:
                ids.append(i)
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special.update(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    for token in END_OF_TURN_TOKENS:
        if token in special and special[token] not in ids:
            ids.append(special[token])
    return ids


def generation_config(model_path: str):
    """The directory's transformers ``GenerationConfig``, or None when it has none."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets, and where each value came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    sources: tuple[str, str, str] = ("default", "default", "default")

    def describe(self) -> str:
        values = (self.temperature, self.top_p, self.top_k)
        return ", ".join(f"{name} {v} ({src})"
                         for name, v, src in zip(("temperature", "top_p", "top_k"), values, self.sources))


# field: (accepts the value, the neutral value); a value outside these is ignored with a log line
_FIELDS = {
    "temperature": (lambda v: isinstance(v, (int, float)) and 0 <= v <= 2, 1.0),
    "top_p": (lambda v: isinstance(v, (int, float)) and 0 < v <= 1, 1.0),
    "top_k": (lambda v: isinstance(v, int) and v >= 0, 0),
}


def sampling_defaults(model_path: str, server_temperature: Optional[float] = None) -> SamplingDefaults:
    """Defaults from ``server.default_temperature``, else the model's ``generation_config.json``,
    else 1.0 / 1.0 / 0 (no truncation). ``do_sample`` is not read: a file saying ``do_sample:
    false`` without a temperature (the embedded model's) keeps temperature 1, and a client that
    wants greedy sends ``temperature: 0``."""
    file = Path(model_path) / "generation_config.json" if model_path else None
    raw: dict = {}
    if file is not None and file.is_file():
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", file, str(e).splitlines()[0] if str(e) else type(e).__name__)
        raw = raw if isinstance(raw, dict) else {}
    picks = [_pick(name, raw, file, server_temperature if name == "temperature" else None) for name in _FIELDS]
    return SamplingDefaults(*(v for v, _ in picks), sources=tuple(src for _, src in picks))


def _pick(name: str, raw: dict, file: Optional[Path], override: Optional[float]) -> tuple:
    valid, neutral = _FIELDS[name]
    if override is not None:
        return float(override), "server.default_temperature"
    v = raw.get(name)
    if v is None:
        return neutral, "default"
    if isinstance(v, bool) or not valid(v):
        log.warning("ignoring %s=%r in %s: out of range", name, v, file)
        return neutral, "default"
    return type(neutral)(v), "generation_config.json"
