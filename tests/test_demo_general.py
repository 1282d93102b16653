"""The real-model demo users (``clawrl.demo.general``): what their feedback means to the judges, the
held-out split, the skill probe's scoring, and the known model's per-model defaults as the log reports them."""
from __future__ import annotations

import json
import random

import pytest

from clawrl.config import compose, model_defaults_report
from clawrl.demo.general import CAPITALS, all_questions, ask_general, skill_correct
from clawrl.demo.users import USERS
from clawrl.judges.base import JudgeInput
from clawrl.judges.hints import RulesHintJudge
from clawrl.judges.rules import RulesJudge
from clawrl.models.catalog import KNOWN, MANIFEST


def judged(user, reply: str, rng: random.Random):
    q = user.ask(rng, held_out=False)
    return q, JudgeInput(1, q.text, reply, None, [{"role": "user", "content": user.feedback(q, reply, rng)}])


@pytest.mark.parametrize("reply, liked", [("Apple.", True), ("A banana is a yellow fruit that grows in bunches.", True),
                                          (" ".join(["word"] * 21), False), ("", False)])
def test_the_concise_user_says_only_thumbs_and_the_reward_judge_reads_them(reply, liked):
    user, judge, rng = USERS["concise"], RulesJudge(), random.Random(0)
    q, item = judged(user, reply, rng)
    assert user.satisfied(q, reply) == liked
    assert item.next_state[0]["content"] in ("\U0001F44D", "\U0001F44E")
    verdict = judge.score(item)
    assert verdict.signal and verdict.score == (1 if liked else -1)
    assert not RulesHintJudge().score(item).accepted  # a thumb says nothing about what to do instead


def test_the_opener_users_correction_is_a_hint_to_open_with_sure():
    user, rng = USERS["opener"], random.Random(1)
    for _ in range(6):
        q, item = judged(user, "Gravity is the force that pulls things down.", rng)
        verdict = RulesHintJudge().score(item)
        assert verdict.accepted and "Sure!" in verdict.hint, (item.next_state, verdict)
    q, item = judged(user, "Sure! Gravity pulls things down.", rng)
    assert user.satisfied(q, item.reply) and RulesJudge().score(item).score == 1


def test_held_out_questions_never_come_up_in_interactions_and_both_sides_are_varied():
    train, held = set(all_questions(False)), set(all_questions(True))
    assert not train & held and len(held) >= 10 and len(train) >= 3 * len(held) - 10
    rng = random.Random(2)
    assert {ask_general(rng, held_out=True).text for _ in range(200)} <= held
    assert {ask_general(rng, held_out=False).text for _ in range(200)} <= train


def test_the_skill_probe_wants_the_capital_itself():
    i = [c for c, _ in CAPITALS].index("France")
    assert skill_correct(i, "The capital of France is Paris.") and skill_correct(i, "paris")
    assert not skill_correct(i, "The capital of France is Lyon.") and not skill_correct(i, "Parisian food")


def _installed_like(tmp_path, wheel_sha256: str):
    known = KNOWN["smollm2-135m-instruct"]
    d = tmp_path / "smol"
    d.mkdir()
    (d / MANIFEST).write_text(json.dumps({"format": 1, "name": known.name, "files": {},
                                          "source": {"package": known.package, "wheel_sha256": wheel_sha256}}))
    return d


def test_a_fetched_known_model_gets_its_measured_defaults_and_the_log_reports_them(tmp_path):
    d = _installed_like(tmp_path, KNOWN["smollm2-135m-instruct"].wheel_sha256)
    cfg = compose([f"model.path={d}", "train.kl_coef=0.25"])
    assert cfg.train.lora.enabled and cfg.train.lr == 1e-4 and cfg.server.default_temperature == 0.7
    assert cfg.demo.temperature is None and cfg.demo.max_tokens == 48
    report = model_defaults_report(cfg)
    assert "conf/models/smollm2-135m-instruct.yaml" in report and "train.lora.enabled=True (LoRA r=8" in report
    assert "train.lr=0.0001 (" in report and "train.kl_coef=0.5, replaced by 0.25 from the recipe or command line" in report
    (d / "clawrl.yaml").write_text("train:\n  lr: 3.0e-5\n")  # the directory's own file wins over the package's
    cfg = compose([f"model.path={d}"])
    assert cfg.train.lr == 3e-5 and not cfg.train.lora.enabled


def test_a_directory_whose_manifest_is_not_the_pinned_wheel_gets_no_known_defaults(tmp_path):
    cfg = compose([f"model.path={_installed_like(tmp_path, '0' * 64)}"])
    assert not cfg.train.lora.enabled and cfg.train.lr == 1e-5
    assert model_defaults_report(cfg).startswith("per-model defaults: none")
