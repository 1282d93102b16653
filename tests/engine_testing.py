"""Small random-weight HF chat models for the engine tests: Qwen3, Qwen2 and Llama directories with
a byte-level BPE tokenizer and a ChatML template, built in a few seconds.

Weights are drawn wider than HF's default init so next-token distributions are peaked: with the
default 0.02 std every logit is nearly equal and greedy decoding would be all near-ties.
"""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is 7+5? It is 12.",
    "You are a helpful assistant. Use tools when needed and answer briefly.",
    "def add(a, b):\n    return a + b\n# tests pass; the build is green",
    "Paris is the capital of France. Berlin is the capital of Germany.",
] * 20


def build_tokenizer(out: Path, vocab_size: int = 600):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def make_model_dir(out: Path, arch: str = "qwen3", seed: int = 0, chat_template: bool = True,
                   std: float = 0.25, max_pos: int = 4096, **overrides) -> Path:
    """Write a random-weight ``arch`` (qwen3 | qwen2 | llama | mistral | gpt2) chat model to ``out``."""
    from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
                              Qwen3Config)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    if not chat_template:
        cfg_file = out / "tokenizer_config.json"
        import json

        data = json.loads(cfg_file.read_text())
        data.pop("chat_template", None)
        cfg_file.write_text(json.dumps(data))
        (out / "chat_template.jinja").unlink(missing_ok=True)
    common = dict(vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tok.pad_token_id, bos_token_id=None)
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=max_pos, **common, **overrides)
    else:
        cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig}[arch]
        kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max_pos, rope_theta=10000.0,
                  tie_word_embeddings=(arch == "qwen3"), **common)
        if arch == "qwen3":
            kw["head_dim"] = 16
        if arch == "mistral":
            kw["sliding_window"] = None
        kw.update(overrides)
        cfg = cls(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "bias" in name:
                p.normal_(0.0, std)
    model.save_pretrained(str(out))
    return out
