"""Loading model directories: any HF causal LM with a chat template serves; everything else is a
one-line ModelLoadError naming the problem (never a transformers traceback)."""
from __future__ import annotations

import json
import shutil

import pytest

from clawrl.config import compose
from clawrl.embedded import build
from clawrl.engines.loading import ModelLoadError, load_model
from engine_testing import make_model_dir


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("load") / "good", "qwen3")


def copy_of(good_dir, tmp_path):
    return shutil.copytree(good_dir, tmp_path / "m")


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_good_directory_loads_in_eval_mode_with_eos_and_context(good_dir):
    lm = load_model(str(good_dir))
    assert not lm.model.training
    assert lm.architecture == "Qwen3ForCausalLM" and lm.name == "good"
    assert lm.max_context == 4096
    # the config's eos, then <|endoftext|>: a special end-of-turn token of the vocabulary
    assert lm.eos_token_ids == [lm.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert load_model(str(good_dir), name="served-as").name == "served-as"


def test_no_model_path_resolves_to_the_embedded_model_served_as_clawrl_tiny(good_dir, monkeypatch):
    monkeypatch.setattr(build, "default_model_path", lambda: good_dir)
    cfg = compose()
    resolved = build.resolve_model(cfg)
    assert (resolved.model.path, resolved.model.name) == (str(good_dir), "clawrl-tiny")
    assert cfg.model.path is None  # a copy: the composed config is left as it was
    assert load_model(resolved.model.path, name=resolved.model.name).name == "clawrl-tiny"
    assert build.resolve_model(compose(["model.name=mine"])).model.name == "mine"


def test_a_given_model_path_is_left_alone_and_nothing_is_built(good_dir, monkeypatch):
    def refuse():
        raise AssertionError("a configured model.path must not build the embedded model")

    monkeypatch.setattr(build, "default_model_path", refuse)
    cfg = compose([f"model.path={good_dir}"])
    assert build.resolve_model(cfg) is cfg


def test_loading_refuses_an_unresolved_path_instead_of_building_a_model(monkeypatch):
    def refuse():
        raise AssertionError("loading must never build the embedded model")

    monkeypatch.setattr(build, "default_model_path", refuse)
    with pytest.raises(ModelLoadError, match=r"^model.path is not resolved: the entry point must resolve it"):
        load_model(None)


def test_missing_path_and_file_path_are_refused(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in load_error(tmp_path / "file")


def test_directory_without_config_is_refused(tmp_path):
    assert "no config.json" in load_error(tmp_path)


def test_model_without_chat_template_is_refused(tmp_path):
    path = make_model_dir(tmp_path / "plain", "qwen3", chat_template=False)
    assert "no chat template" in load_error(path)


def test_unknown_and_non_causal_architectures_are_named(good_dir, tmp_path):
    m = copy_of(good_dir, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "model_type": "warpdrive9"}))
    msg = load_error(m)
    assert "unsupported architecture" in msg and "warpdrive9" in msg
    (m / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    msg = load_error(m)
    assert "unsupported architecture" in msg and "vit" in msg and "not a causal language model" in msg
    (m / "config.json").write_text("{not json")
    assert "not valid JSON" in load_error(m)


def test_truncated_weights_file_is_named(good_dir, tmp_path):
    m = copy_of(good_dir, tmp_path)
    weights = m / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    msg = load_error(m)
    assert "corrupt weights file" in msg and str(weights) in msg and "truncated" in msg
    weights.write_bytes(b"\x01\x02")
    assert str(weights) in load_error(m)
    weights.unlink()
    assert "no weights" in load_error(m)


def test_bad_device_or_dtype_is_one_line(good_dir):
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_model(str(good_dir), dtype="float8")
    with pytest.raises(ModelLoadError, match="unknown device"):
        load_model(str(good_dir), device="warp:0")
