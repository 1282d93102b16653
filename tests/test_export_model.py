"""``clawrl export-model``: a run's checkpoint as a Hugging Face model directory.

Runs are short real trainings of a small random Qwen3 (tied embeddings) with the torch trainer, a
checkpoint after each of two steps, kept with the weights the trainer served at each version
(``export_weights``, what the weight sync hands the engine). The exports are then loaded the ways a
user would: ``AutoModelForCausalLM.from_pretrained``, peft over the base, the clawrl engine, and
``clawrl serve model.path=DIR``."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawrl.checkpoints import CheckpointStore
from clawrl.cli import main
from clawrl.config import compose
from clawrl.engines import make_engine
from clawrl.run_lock import RunDirBusy, RunDirLock
from clawrl.samples import Sample
from clawrl.trainers.torch_trainer import TorchTrainer
from checkpoint_support import MegatronShards
from engine_testing import make_model_dir
from gateway_support import free_port

CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]
BASE_LR = 3.0e-4  # the base model's own clawrl.yaml, which the export carries along


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = make_model_dir(tmp_path_factory.mktemp("export_base") / "q3", "qwen3", seed=5)
    (path / "clawrl.yaml").write_text(f"train:\n  lr: {BASE_LR}\n")
    return path


def _batch(trainer, seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(3):
        prompt = torch.randint(3, trainer.vocab_size, (6,), generator=gen).tolist()
        response = torch.randint(3, trainer.vocab_size, (4,), generator=gen).tolist()
        out.append(Sample(i, i, str(i), prompt, response, [0.0] * 4, [0] * 4, 1.0, 1.0 if i % 2 else -1.0))
    for s, lps in zip(out, trainer.logprobs(out)):
        s.rollout_logprobs = lps
    return out


def _train_run(base: Path, run: Path, *overrides: str) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Two train steps with a checkpoint after each; the weights served at versions 1 and 2."""
    cfg = compose([f"model.path={base}", "model.device=cpu", "train.lr=1e-2", "train.save_every=1", *overrides])
    trainer = TorchTrainer(cfg, str(base))
    store = CheckpointStore(run, cfg.train)
    served = {}
    for version in (1, 2):
        assert trainer.train_step(_batch(trainer, version), version - 1).ok
        assert store.after_step(trainer, version) is not None
        served[version] = trainer.export_weights()
    return run, served


@pytest.fixture(scope="module")
def full_run(base, tmp_path_factory):
    return _train_run(base, tmp_path_factory.mktemp("full_run"))


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    return _train_run(base, tmp_path_factory.mktemp("lora_run"), "train.lora.enabled=true")


def export(run: Path, out: Path, base: Path, *args: str) -> int:
    return main(["export-model", "--run-dir", str(run), "--out", str(out), *args, f"model.path={base}"])


def prompt_ids(base: Path) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(base))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7+5?"}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False) + tok.encode("It is 12.", add_special_tokens=False)


def logits(model, ids: list[int]) -> torch.Tensor:
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(str(model))
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0].float()


def with_weights(base: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The base model with ``weights`` (the served ones) loaded: the reference the export must equal."""
    model = AutoModelForCausalLM.from_pretrained(str(base))
    model.load_state_dict(weights, strict=False)
    return model


def tree(root: Path) -> dict:
    """Every path under ``root`` with its size and modification time: what 'nothing written' means."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_newest_and_older_version_load_in_transformers_with_the_weights_served_at_that_version(
        base, full_run, tmp_path, capsys):
    run, served = full_run
    ids = prompt_ids(base)
    base_logits = logits(base, ids)
    exported = {}
    for version, args in ((2, ()), (1, ("--version", "1"))):
        out = tmp_path / f"v{version}"
        assert export(run, out, base, *args) == 0
        said = capsys.readouterr().out.strip()
        assert said == f"clawrl: exported {run / 'checkpoints' / f'step_{version}'} (weight version {version}, " \
                       f"full weights) to {out}"
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            assert (out / name).is_file(), name
        on_disk = load_file(str(out / "model.safetensors"))
        assert on_disk and all(torch.equal(t, served[version][k]) for k, t in on_disk.items())
        exported[version] = logits(out, ids)
        torch.testing.assert_close(exported[version], logits(with_weights(base, served[version]), ids),
                                   atol=1e-6, rtol=0)
        assert (exported[version] - base_logits).abs().max() > 1e-3  # trained away from the base
    assert (exported[2] - exported[1]).abs().max() > 1e-4  # two versions, two models

    out = tmp_path / "v1"
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == AutoTokenizer.from_pretrained(str(base)).chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == \
        json.loads((base / "generation_config.json").read_text())["eos_token_id"]
    provenance = json.loads((out / "clawrl_export.json").read_text())
    assert (provenance["checkpoint"], provenance["weight_version"], provenance["form"]) == ("step_1", 1, "full")
    # the base's clawrl defaults came along: serving the export composes as serving the base did
    assert compose([f"model.path={out}"]).train.lr == BASE_LR


async def _engine_logprobs(model_path: Path, prompt: list[int], response: list[int],
                           weights: dict | None = None, version: int = 0) -> list[float]:
    engine = make_engine(compose([f"model.path={model_path}", "model.device=cpu", "engine.threads=1"]))
    await engine.start()
    try:
        if weights is not None:
            await engine.update_weights(weights, version)
        assert engine.model_info().weight_version == version
        return (await engine.score(prompt, response)).logprobs
    finally:
        await engine.shutdown()


def test_the_export_scores_as_the_runs_engine_did_at_that_version(base, full_run, tmp_path):
    run, served = full_run
    out = tmp_path / "v1"
    assert export(run, out, base, "--version", "1") == 0
    ids = prompt_ids(base)
    prompt, response = ids[:-4], ids[-4:]
    at_version_1 = asyncio.run(_engine_logprobs(base, prompt, response, served[1], 1))  # the run's engine
    from_export = asyncio.run(_engine_logprobs(out, prompt, response))
    base_scores = asyncio.run(_engine_logprobs(base, prompt, response))
    torch.testing.assert_close(torch.tensor(from_export), torch.tensor(at_version_1), atol=1e-5, rtol=0)
    assert max(abs(a - b) for a, b in zip(base_scores, at_version_1)) > 1e-3


def test_a_lora_run_is_exported_merged_as_the_trainer_serves_it(base, lora_run, tmp_path, capsys):
    run, served = lora_run
    out = tmp_path / "merged"
    assert export(run, out, base) == 0
    assert f"(weight version 2, LoRA merged into {base}) to {out}" in capsys.readouterr().out
    on_disk = load_file(str(out / "model.safetensors"))
    assert set(on_disk) <= set(served[2]) and not any("lora" in k for k in on_disk)
    assert all(torch.equal(t, served[2][k]) for k, t in on_disk.items())
    ids = prompt_ids(base)
    merged = logits(out, ids)
    torch.testing.assert_close(merged, logits(with_weights(base, served[2]), ids), atol=1e-6, rtol=0)
    assert (merged - logits(base, ids)).abs().max() > 1e-4


def test_adapter_is_a_peft_adapter_directory_that_peft_loads_over_the_base(base, lora_run, tmp_path, capsys):
    from peft import PeftModel

    run, served = lora_run
    out = tmp_path / "adapter"
    assert export(run, out, base, "--version", "1", "--adapter") == 0
    assert f"(weight version 1, PEFT LoRA adapter over {base}) to {out}" in capsys.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    lora = compose([]).train.lora
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", lora.r, lora.alpha)
    assert config["base_model_name_or_path"] == str(base)
    assert not (out / "model.safetensors").exists()
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tensors and all("lora_A" in k or "lora_B" in k for k in tensors)

    ids = prompt_ids(base)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(out))
    adapted = logits(peft_model, ids)
    # unmerged (x W + s x A B) against merged (x (W + s B A)): float32 reassociation, about 1e-5 on these logits
    torch.testing.assert_close(adapted, logits(with_weights(base, served[1]), ids), atol=5e-5, rtol=0)
    assert (adapted - logits(base, ids)).abs().max() > 1e-4
    assert AutoTokenizer.from_pretrained(str(out)).chat_template  # the chat template travels with it
    assert not (out / "clawrl.yaml").exists()  # the base's clawrl defaults belong to a model directory


def test_export_beside_a_live_server_holding_the_lock_writes_nothing_into_the_run(base, full_run, tmp_path, capsys):
    run, served = full_run
    out = tmp_path / "beside"
    with RunDirLock(run):  # a live server holds the run
        before = tree(run)
        assert export(run, out, base) == 0
        assert tree(run) == before
        with pytest.raises(RunDirBusy):
            RunDirLock(run).acquire()  # still the server's
    assert "(weight version 2, full weights)" in capsys.readouterr().out
    assert all(torch.equal(t, served[2][k]) for k, t in load_file(str(out / "model.safetensors")).items())


def test_model_dtype_bfloat16_exports_the_weights_as_a_gpu_engine_serves_them(base, full_run, tmp_path):
    run, served = full_run
    out = tmp_path / "bf16"
    assert export(run, out, base, "model.dtype=bfloat16") == 0
    on_disk = load_file(str(out / "model.safetensors"))
    assert on_disk and all(t.dtype == torch.bfloat16 and torch.equal(t, served[2][k].to(torch.bfloat16))
                           for k, t in on_disk.items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_corrupt_newest_checkpoint_is_passed_over_with_a_note_and_never_exported(base, full_run, tmp_path, capsys):
    run, served = full_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with open(copy / "checkpoints" / "step_2" / "weights.safetensors", "r+b") as f:  # a flipped byte
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert export(copy, tmp_path / "out", base) == 0
    out, err = capsys.readouterr()
    assert "(weight version 1, full weights)" in out
    assert err.startswith("clawrl: checkpoint step_2 is incomplete or corrupt") and "checksum" in err
    assert all(torch.equal(t, served[1][k]) for k, t in load_file(str(tmp_path / "out" / "model.safetensors")).items())

    assert export(copy, tmp_path / "v2", base, "--version", "2") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "v2").exists()
    assert "has no complete checkpoint of weight version 2 (checkpointed versions: 1, 2) (1 incomplete or " \
           "corrupt passed over: checkpoint step_2 is incomplete or corrupt" in err


@pytest.mark.parametrize("argv, message", [
    (["--run-dir", "{tmp}/nowhere"], "--run-dir {tmp}/nowhere: no such run directory"),
    (["--run-dir", "{tmp}/a-file"], "--run-dir {tmp}/a-file: no such run directory"),
    (["--run-dir", "{tmp}/fresh"], "{tmp}/fresh has no complete checkpoint to export"),
    (["--version", "7"], "{run} has no complete checkpoint of weight version 7 (checkpointed versions: 1, 2)"),
    (["--version", "two"], "--version must be a whole number >= 1, got 'two'"),
    (["--version", "0"], "--version must be a whole number >= 1, got '0' (version 0 is the base model)"),
    (["--out", "{tmp}/full"], "--out {tmp}/full exists and is not empty; give a new or empty directory"),
    (["--out", "{tmp}/a-file"], "--out {tmp}/a-file exists and is not a directory"),
    (["--adapter"], "--adapter: {run}/checkpoints/step_2 holds full weights, not a LoRA adapter"),
    (["--run-dir", "{tmp}/megatron"], "clawrl export-model reads torch-trainer checkpoints (full or LoRA)"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(base, full_run, tmp_path, capsys, argv, message):
    run, _ = full_run
    (tmp_path / "a-file").write_text("not a run\n")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine\n")
    CheckpointStore(tmp_path / "megatron").save(MegatronShards(), 1)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in ["--run-dir", str(run), "--out", "{tmp}/out", *argv]]
    before = tree(tmp_path)
    assert main(["export-model", *argv, f"model.path={base}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("clawrl: ") and "Traceback" not in err, err
    assert message.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)) in err
    assert tree(tmp_path) == before  # no --out, no temporary directory left behind


def test_a_checkpoint_of_another_model_is_refused_in_one_line(full_run, lora_run, tmp_path, capsys):
    other = make_model_dir(tmp_path / "other", "qwen3", seed=6, head_dim=8)  # attention of another width
    capsys.readouterr()
    for run, args, says in ((full_run[0], (), "step_2 does not fit the model"),
                            (lora_run[0], ("--adapter",), "step_2 holds a LoRA adapter that does not fit")):
        assert export(run, tmp_path / "out", other, *args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and says in err and "shape" in err, err
        assert not (tmp_path / "out").exists()


def test_a_bad_input_from_the_shell_is_one_line_without_a_traceback(tmp_path):
    done = subprocess.run([*CLAWRL, "export-model", "--run-dir", str(tmp_path / "nowhere"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"clawrl: --run-dir {tmp_path / 'nowhere'}: no such run directory"
    assert not (tmp_path / "out").exists()


def test_clawrl_serve_serves_the_export(base, full_run, tmp_path):
    from test_serve import Served

    run, _ = full_run
    out = tmp_path / "served-model"
    assert export(run, out, base) == 0
    (tmp_path / "serve-run").mkdir()
    server = Served(tmp_path / "serve-run", out, free_port())
    try:
        reply = server.chat([{"role": "user", "content": "What is 7+5?"}], max_tokens=4).json()
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
    assert reply["model"] == "tiny" and isinstance(reply["choices"][0]["message"]["content"], str)
    assert reply["usage"]["completion_tokens"] >= 1
    assert str(out) in server.output()  # the export, not another model, was loaded
