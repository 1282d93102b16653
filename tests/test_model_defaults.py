"""What a model directory says about ending a reply (every end-of-turn id) and sampling it (the
defaults a request that sends no temperature/top_p/top_k gets)."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from clawrl.config import ServerConfig
from clawrl.engines.loading import load_model
from clawrl.engines.model_defaults import end_of_turn_ids, generation_config, sampling_defaults
from clawrl.gateway.protocol import parse_chat_request


def test_smollm2_stops_at_endoftext_as_well_as_the_im_end_its_configs_name(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert generation_config(str(smollm2_dir)).eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = end_of_turn_ids(tok, generation_config(str(smollm2_dir)))
    assert ids == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    assert load_model(str(smollm2_dir)).eos_token_ids == ids  # what the torch engine stops at


def test_every_eos_of_every_config_counts_first_then_the_special_end_of_turn_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    class Config:
        eos_token_id = [7, 2]

    ids = end_of_turn_ids(tok, None, Config())
    assert ids == [7, 2, tok.convert_tokens_to_ids("<|endoftext|>")]


def gen_dir(tmp_path, **fields):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **fields}))
    return str(tmp_path)


def test_generation_config_gives_the_defaults_and_server_default_temperature_overrides_it(tmp_path):
    d = sampling_defaults(gen_dir(tmp_path, temperature=0.6, top_p=0.9, top_k=20))
    assert (d.temperature, d.top_p, d.top_k) == (0.6, 0.9, 20)
    assert d.describe() == ("temperature 0.6 (generation_config.json), top_p 0.9 (generation_config.json), "
                            "top_k 20 (generation_config.json)")
    d = sampling_defaults(gen_dir(tmp_path, temperature=0.6), server_temperature=0.0)
    assert (d.temperature, d.sources[0]) == (0.0, "server.default_temperature")
    assert ServerConfig().default_temperature is None


@pytest.mark.parametrize("fields", [{"do_sample": False}, {}, {"temperature": -1, "top_p": 0, "top_k": True}])
def test_do_sample_false_missing_or_invalid_fields_keep_temperature_one_and_no_truncation(tmp_path, fields):
    d = sampling_defaults(gen_dir(tmp_path, **fields))
    assert (d.temperature, d.top_p, d.top_k, d.sources) == (1.0, 1.0, 0, ("default",) * 3)


def test_a_directory_without_generation_config_gets_the_plain_defaults(tmp_path):
    assert sampling_defaults(str(tmp_path)).temperature == 1.0
    assert sampling_defaults("").temperature == 1.0


def test_a_request_that_leaves_sampling_out_keeps_none_and_one_that_sends_it_keeps_its_own():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat_request(body)
    assert (req.temperature, req.top_p, req.top_k) == (None, None, None)
    req = parse_chat_request({**body, "temperature": 0, "top_p": 0.5, "top_k": 3})
    assert (req.temperature, req.top_p, req.top_k) == (0.0, 0.5, 3)
