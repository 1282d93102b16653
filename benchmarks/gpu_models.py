"""What the GPU benchmarks share about their models: built with random weights the one way the
reference probe builds them, handed to the engine as a loaded model, and timed in HF's ``generate``
as the side figure. One place, so the attention-only and hybrid parts build and time alike."""
from __future__ import annotations

import time

import torch

from clawrl.engines.loading import LoadedModel


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_model(model_cls, cfg, device: str):
    """``model_cls(cfg)`` built on ``device`` after ``torch.manual_seed(0)``, in bf16 on a GPU (on a
    CPU float32, since that is what CPUs run), in eval mode."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    return model.eval()


def served(model, name: str) -> LoadedModel:
    """The engine's view of a model held in memory (no directory, no tokenizer: ids are random)."""
    p = next(model.parameters())
    return LoadedModel(model=model, tokenizer=None, name=name, path="(random weights)",
                       architecture=type(model).__name__, max_context=32768, eos_token_ids=[], device=p.device,
                       dtype=p.dtype)


def hf_decode(model, prompt: torch.Tensor, new: int) -> float:
    """HF ``generate``'s tok/s for ``new`` sampled tokens after each row of ``prompt`` (EOS ignored)."""
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0,
                             top_k=0)
    sync()
    dt = time.perf_counter() - t
    assert out.shape[1] == prompt.shape[1] + new
    return prompt.shape[0] * new / dt
