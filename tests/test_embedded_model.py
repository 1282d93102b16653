"""The embedded default model: a deterministic, atomic build that yields a Qwen3 with a 32k context
which adds two numbers it never saw added, with or without a long system prompt in front."""
import json
import os
import random
from pathlib import Path

import pytest

from clawrl.cli import main as clawrl_main
from clawrl.embedded import build
from clawrl.embedded.corpus import (Chat, chat_pieces, is_held_out, long_system_prompt,
                                    sample_pair, short_chat)
from clawrl.embedded.english import english_paragraphs
from clawrl.embedded.evaluate import evaluate_addition


def test_corpus_is_deterministic_for_a_seed():
    a = [short_chat(random.Random(5)) for _ in range(3)]
    b = [short_chat(random.Random(5)) for _ in range(3)]
    assert [c.messages for c in a] == [c.messages for c in b]


def test_corpus_never_contains_held_out_additions():
    rng = random.Random(0)
    seen = set()
    for _ in range(3000):
        for m in short_chat(rng).messages:
            text = m.get("content") or ""
            if m["role"] == "assistant" and " + " in text and " = " in text:
                lhs = text.split(" = ")[0].split()[-3:]
                if len(lhs) == 3 and lhs[0].isdigit() and lhs[2].isdigit():
                    seen.add((int(lhs[0]), int(lhs[2])))
    assert len(seen) > 500
    assert not [p for p in seen if is_held_out(*p)]
    assert all(is_held_out(*sample_pair(rng, held_out=True)) for _ in range(200))


def test_only_assistant_replies_are_trained():
    chat = Chat([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5", "train": False},
                 {"role": "user", "content": "No, that's wrong."}, {"role": "assistant", "content": "Sorry, 2 + 2 = 4."}])
    pieces = chat_pieces(chat)
    assert [t for t, trained in pieces if trained] == ["Sorry, 2 + 2 = 4.<|im_end|>"]
    assert "".join(t for t, _ in pieces).endswith("<|im_start|>assistant\nSorry, 2 + 2 = 4.<|im_end|>\n")


def test_long_system_prompt_has_the_asked_length():
    text = long_system_prompt(random.Random(1), english_paragraphs(), 9000)
    assert len(text) == 9000 and "## " in text


@pytest.mark.slow
def test_build_is_deterministic_for_a_seed(tmp_path):
    a = build.build_model(seed=3, steps=3, out=tmp_path / "a")
    b = build.build_model(seed=3, steps=3, out=tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    info = json.loads((a / "build_info.json").read_text())
    assert info["seed"] == 3 and info["steps"] == 3 and 0 <= info["addition_accuracy"] <= 1
    assert _modes(a) == {".": 0o755, **{f.name: 0o644 for f in a.iterdir()}}  # for every local user


def _modes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}


def test_a_built_model_is_readable_by_every_local_user_whatever_the_umask(tmp_path, monkeypatch):
    """safetensors writes model.safetensors 0600 and mkdtemp makes the directory 0700; the cache's
    model is shared, so the build opens both (and anything else it wrote) to every local user."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def save_a_model(out, seed, steps):
        Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(out)
        (out / "extra").mkdir()
        (out / "extra" / "notes.json").write_text("{}")

    monkeypatch.setattr(build, "_build_into", save_a_model)
    old = os.umask(0o077)
    try:
        model = build.build_model(seed=0, steps=3, out=tmp_path / "model")
    finally:
        os.umask(old)
    modes = _modes(model)
    assert modes.pop("model.safetensors") == 0o644 and modes.pop(".") == 0o755 and modes.pop("extra") == 0o755
    assert set(modes.values()) == {0o644}, modes


def test_failed_build_leaves_no_model_behind(tmp_path, monkeypatch):
    def fail(seed):
        raise RuntimeError("killed")

    monkeypatch.setattr(build, "build_tokenizer", fail)
    with pytest.raises(RuntimeError, match="killed"):
        build.build_model(seed=0, steps=3, out=tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_build_never_replaces_a_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert clawrl_main(["model", "build", "--steps", "3", "--force", "--out", str(tmp_path)]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_build_cli_refuses_nonpositive_steps(capsys):
    assert clawrl_main(["model", "build", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_default_model_loads_as_qwen3_with_32k_context(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert model.config.model_type == "qwen3"
    assert model.config.max_position_embeddings >= 32768
    assert model.config.clawrl_model_name == "clawrl-tiny"
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert model.generation_config.eos_token_id[0] == tok.convert_tokens_to_ids("<|im_end|>")
    info = json.loads((tiny_model_dir / "build_info.json").read_text())
    assert info["steps"] == build.DEFAULT_STEPS


def test_default_model_adds_held_out_pairs(tiny_model_dir):
    assert evaluate_addition(tiny_model_dir, n=100, seed=11) >= 0.6


def test_default_model_adds_after_a_long_system_prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    system = long_system_prompt(random.Random(99), english_paragraphs(), 9000)
    assert len(AutoTokenizer.from_pretrained(str(tiny_model_dir))(system)["input_ids"]) > 2000
    assert evaluate_addition(tiny_model_dir, n=30, seed=12, system_prompt=system) >= 0.4


def test_default_model_calls_the_tool_a_request_needs(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawrl.embedded.corpus import tool_schema

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    tools = [tool_schema(t) for t in ("read", "get_weather", "ls", "get_time", "exec")]
    asks = {"What's the weather in Paris?": "get_weather", "List the files.": "ls", "Run `pwd`.": "exec",
            "What time is it in Asia/Tokyo?": "get_time", "Read notes.txt for me.": "read", "What is 12+30?": None}
    for question, tool in asks.items():
        enc = tok.apply_chat_template([{"role": "user", "content": question}], tools=tools,
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=40, do_sample=False)
        reply = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=False)
        if tool is None:
            assert "<tool_call>" not in reply and "42" in reply
            continue
        body = reply.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
        call = json.loads(body)
        assert call["name"] == tool and isinstance(call["arguments"], dict), reply


def test_a_changed_recipe_gets_a_new_cache_directory(tmp_path, monkeypatch):
    """A model built by older corpus or training code is never served as the current default."""
    import shutil

    from clawrl.embedded import build

    pkg = tmp_path / "embedded"
    shutil.copytree(Path(build.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(build, "__file__", str(pkg / "build.py"))
    before = build.recipe_hash()
    assert build._cache_dir(0, build.DEFAULT_STEPS).name.endswith(before)
    (pkg / "corpus.py").write_text((pkg / "corpus.py").read_text() + "\n# a recipe change\n")
    assert build.recipe_hash() != before
