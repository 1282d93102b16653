"""The rollout buffer under OPD: a sample never trains before its teacher outcome is in (opd), a turn
with a hint but no reward is kept rather than lost as no_signal (combine), one with neither is
skipped with the reason, and a rewarded turn whose teacher never answers trains RL-only after the
timeout. The TeacherGate reads the teacher's table and does this on its own."""
from __future__ import annotations

import time

import pytest

from clawrl.buffer import Readiness, RolloutBuffer
from clawrl.config import TrainConfig
from clawrl.engines.base import ScoreResult
from clawrl.judges.hints import HintVerdict, HintVote
from clawrl.methods.opd.gate import TeacherGate
from clawrl.methods.opd.teacher import OpdStore
from clawrl.store import TurnStore
from test_buffer import Chat, by_turn, judge_all

OPD = Readiness(reward=False, teacher=True)  # the opd method's rule: no reward judge, wait for the teacher
COMBINE = Readiness(reward=True, teacher=True)  # combine's: both


@pytest.fixture
def store(tmp_path):
    s = TurnStore(tmp_path)
    yield s
    s.close()


def hint(opd: OpdStore, turn_id: int, text: str | None, scored: bool = True) -> None:
    """Record the teacher's outcome for a turn as the TeacherWorker would."""
    if text is None:
        opd.record_hint(turn_id, HintVerdict(False, "", "no_hindsight", [HintVote(False, "", "thanks")], "rules"))
        return
    opd.record_hint(turn_id, HintVerdict(True, text, "accepted", [HintVote(True, text, "rules: x")], "rules", 1.0))
    if scored:
        opd.record_score(turn_id, "policy", [1, 2, 3], ScoreResult(logprobs=[-0.1, -0.2, -0.3], weight_version=0), 0)


def test_opd_sample_waits_for_its_teacher_then_trains_with_it_or_is_skipped_with_the_reason(store):
    chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(), OPD)
    opd, gate = OpdStore(store), TeacherGate(buffer, store, wait_s=None)
    hinted, thanked, later = (chat.conversation([fb], opening=q)[0] for fb, q in (
        ("Too long. One line, please.", "Hi"), ("Thanks!", "What is 2+2?"), ("Shorter, please.", "Bye")))
    gate.resolve_now()
    assert {s["state"] for s in buffer.samples()} == {"pending"}  # nothing is ready before the teacher
    hint(opd, hinted, "Answer in one line.")
    hint(opd, thanked, None)
    hint(opd, later, "Be brief.", scored=False)  # accepted, still being scored
    gate.resolve_now(now=time.time() + 1e6)  # under opd there is no timeout
    s = by_turn(buffer)
    assert (s[hinted]["state"], s[hinted]["rl_signal"], s[hinted]["advantage"]) == ("ready", 0, 0.0)
    assert (s[thanked]["state"], s[thanked]["skip_reason"]) == ("skipped", "no_hint:no_hindsight")
    assert s[later]["state"] == "pending"
    [sample] = buffer.take_batch(8, current_version=0)
    assert sample.turn_id == hinted and sample.rl_signal is False and sample.extra["opd_state"] == "scored"
    assert opd.attach([sample]) == 1 and sample.teacher.teacher_logprobs == [-0.1, -0.2, -0.3]


def test_opd_sample_of_a_turn_excluded_after_sampling_is_skipped_not_left_waiting(store):
    chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(), OPD)
    OpdStore(store)  # the teacher's table, as the OPD method creates it
    gate = TeacherGate(buffer, store, wait_s=None)
    turn = chat.conversation(["Shorter, please."], opening="Hi")[0]
    gate.resolve_now()
    assert by_turn(buffer)[turn]["state"] == "pending"
    store.relabel_turn(turn, "excluded", actor="admin")  # the teacher will never hint-judge it now
    gate.resolve_now()
    assert (by_turn(buffer)[turn]["state"], by_turn(buffer)[turn]["skip_reason"]) == ("skipped", "excluded")


def test_combine_keeps_a_hint_without_reward_and_skips_a_turn_with_neither(store):
    chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(), COMBINE)
    opd, gate = OpdStore(store), TeacherGate(buffer, store, wait_s=60.0)
    # the rules reward judge reads no signal in either; only the first says what to do
    hint_only = chat.conversation(["Just the number, please."], opening="What is 7+5?")[0]
    neither = chat.conversation(["And what is 8+1?"], opening="Hi there")[0]
    judge_all(buffer)
    s = by_turn(buffer)
    assert s[hint_only]["state"] == s[neither]["state"] == "judged"  # not lost as no_signal yet
    hint(opd, hint_only, "Answer with just the answer.")
    hint(opd, neither, None)
    gate.resolve_now()
    s = by_turn(buffer)
    assert (s[hint_only]["state"], s[hint_only]["rl_signal"]) == ("ready", 0)
    assert (s[neither]["state"], s[neither]["skip_reason"]) == ("skipped", "no_signal")


def test_combine_rewarded_sample_waits_for_the_teacher_and_trains_rl_only_after_the_timeout(store):
    chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(), COMBINE)
    opd, gate = OpdStore(store), TeacherGate(buffer, store, wait_s=30.0)
    both = chat.conversation(["No, that's wrong. Just the number, please."], opening="What is 7+5?")[0]
    slow = chat.conversation(["Thanks, perfect!"], opening="What is 10+11?")[0]  # another prompt: its own group
    judge_all(buffer)
    hint(opd, both, "Answer with just the answer.")
    gate.resolve_now()
    s = by_turn(buffer)
    assert (s[both]["state"], s[both]["reward"], s[both]["opd_state"]) == ("ready", -1.0, "scored")
    assert (s[slow]["state"], s[slow]["opd_state"]) == ("judged", None)  # its teacher has not answered
    gate.resolve_now(now=time.time() + 31)
    s = by_turn(buffer)
    assert (s[slow]["state"], s[slow]["reward"], s[slow]["opd_state"]) == ("ready", 1.0, "timeout")
    hint(opd, slow, None)  # a late teacher outcome changes nothing
    gate.resolve_now()
    assert by_turn(buffer)[slow]["opd_state"] == "timeout"
    batch = {b.turn_id: b for b in buffer.take_batch(8, current_version=0)}
    assert batch[both].rl_signal and batch[slow].extra["opd_state"] == "timeout"
    assert opd.attach(list(batch.values())) == 1 and batch[slow].teacher is None


def test_combine_keeps_a_hinted_turn_whose_reward_judge_failed(store):
    class Broken:
        kind = "prm"

        async def judge(self, item):
            raise RuntimeError("judge engine down")

    chat, buffer = Chat(store), RolloutBuffer(store, TrainConfig(), COMBINE)
    opd, gate = OpdStore(store), TeacherGate(buffer, store, wait_s=60.0)
    turn = chat.conversation(["Too long. One line, please."], opening="Hi")[0]
    judge_all(buffer, judge=Broken(), retries=0)
    assert by_turn(buffer)[turn]["state"] == "judged"
    hint(opd, turn, "Answer in one line.")
    gate.resolve_now()
    s = by_turn(buffer)[turn]
    assert (s["state"], s["rl_signal"], s["opd_state"]) == ("ready", 0, "scored")
    assert buffer.votes(s["sample_id"])[0]["rationale"].startswith("error: RuntimeError")


def test_buffer_refuses_no_signal_source_and_unknown_outcomes(store):
    with pytest.raises(ValueError, match="reward judge, an OPD teacher"):
        Readiness(reward=False, teacher=False)
    buffer = RolloutBuffer(store, TrainConfig(), COMBINE)
    with pytest.raises(ValueError, match="OPD outcome"):
        buffer.resolve_opd(1, "maybe")
    with pytest.raises(ValueError, match="does not wait for OPD"):
        RolloutBuffer(store, TrainConfig()).resolve_opd(1, "scored")
