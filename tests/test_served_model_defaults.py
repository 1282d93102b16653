"""How ``clawrl serve`` ends and samples a pretrained model's replies, through the official ``openai``
client: SmolLM2-135M-Instruct (``smollm2_dir``) ends turns with ``<|endoftext|>`` as well as the
``<|im_end|>`` its configs name, and no special token's text reaches ``content``; a model's
``generation_config.json`` gives the sampling defaults, which the request's own fields beat."""
from __future__ import annotations

import json
import shutil

import openai
from transformers import AutoTokenizer

from test_openclaw_real import CLAWRL, ClawrlServe

NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def client_of(server: ClawrlServe) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def test_no_special_token_reaches_the_content_of_smollm2_replies_streamed_or_not(smollm2_dir, tmp_path):
    specials = [t.content for t in AutoTokenizer.from_pretrained(str(smollm2_dir)).added_tokens_decoder.values()
                if t.special]
    server = ClawrlServe(CLAWRL, tmp_path, f"model.path={NAME}")
    try:
        client = client_of(server)
        sampled = client.chat.completions.create(model=NAME, messages=FRANCE, temperature=1.0, seed=3, n=4)
        texts = [c.message.content for c in sampled.choices]
        for seed in range(2):  # seed 0: SmolLM2 answers <|endoftext|> at once, which must end the reply unseen
            stream = client.chat.completions.create(model=NAME, messages=FRANCE, seed=seed, stream=True)
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    finally:
        server.stop()
    print(texts)
    assert "stop" in {c.finish_reason for c in sampled.choices}
    assert not [(s, t) for t in texts for s in specials if s in t]


def test_generation_config_sampling_defaults_apply_and_the_requests_own_value_wins(tiny_model_dir, tmp_path):
    model = tmp_path / "tiny-greedy"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 5}))

    def replies_by_seed(run: str, *overrides: str) -> tuple[ClawrlServe, list[set[str]]]:
        """Replies over four seeds: sending no temperature, then sending temperature 1."""
        server = ClawrlServe(CLAWRL, tmp_path / run, f"model.path={model}", *overrides)
        try:
            client = client_of(server)
            name = client.models.list().data[0].id
            return server, [{client.chat.completions.create(model=name, messages=FRANCE, max_tokens=16, seed=s,
                                                            **sent).choices[0].message.content for s in range(4)}
                            for sent in ({}, {"temperature": 1.0})]
        finally:
            server.stop()

    server, (by_default, sent) = replies_by_seed("gen")
    assert len(by_default) == 1  # temperature 0 from generation_config.json: greedy whatever the seed
    assert len(sent) > 1  # the request's temperature wins
    assert "temperature 0.0 (generation_config.json), top_p 1.0 (default), top_k 5 (generation_config.json)" \
        in server.output()
    server, (by_default, _) = replies_by_seed("server", "server.default_temperature=1.0")
    assert len(by_default) > 1  # server.default_temperature wins over generation_config.json
    assert "temperature 1.0 (server.default_temperature)" in server.output()
