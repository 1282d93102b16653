"""The rollout buffer: every closed turn becomes a sample that ends trained or skipped with a reason,
judged in the background, consumed exactly once, with staleness, advantages and restarts honoured."""
import asyncio
import json
import logging
import threading
from pathlib import Path

import pytest

from clawrl.buffer import RolloutBuffer
from clawrl.config import JudgeConfig, TrainConfig
from clawrl.judges.base import Judge, JudgeInput, Verdict, Vote
from clawrl.judges.rules import RulesJudge
from clawrl.orchestration.judging import JudgeWorker
from clawrl.sessions import SessionHints, SessionLinker
from clawrl.store import TurnStore

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


class Chat:
    """Drives a TurnStore through SessionLinker.begin/record, as the gateway does."""

    def __init__(self, store):
        self.linker = SessionLinker(store, idle_timeout_s=60.0)
        self.next_token = 100

    def serve(self, messages, reply, versions=(0, 0, 0), status="complete", hints=SessionHints(), prompt=None,
              tool_calls=None):
        plan = self.linker.begin(messages, caller_key="k", hints=hints)
        n = len(versions)
        ids = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        prompt = prompt if prompt is not None else [1, 2, 3, len(messages)] + [len(m["content"] or "") for m in messages]
        return self.linker.record(plan, prompt_ids=prompt, response_ids=ids, logprobs=[-0.25 * (i + 1) for i in range(n)],
                                  weight_versions=list(versions), response_text=reply, tool_calls=tool_calls,
                                  finish_reason="stop", status=status)

    def conversation(self, feedback, opening="What is 7+5?", versions=(0, 0, 0)):
        """A main turn per reply; each later user message is the previous turn's next state.
        Returns the turn ids; the last turn stays open."""
        history = [SYSTEM, user(opening)]
        turns = []
        for i, fb in enumerate(list(feedback) + [None]):
            reply = f"Answer {i}: 12."
            turns.append(self.serve(list(history), reply, versions=versions))
            if fb is None:
                break
            history += [assistant(reply), user(fb)]
        return turns


@pytest.fixture
def store(tmp_path):
    s = TurnStore(tmp_path)
    yield s
    s.close()


def make_buffer(store, **train):
    return RolloutBuffer(store, TrainConfig(**train))


def judge_all(buffer, judge=None, **cfg):
    worker = JudgeWorker(buffer, judge or RulesJudge(), JudgeConfig(**cfg), poll_s=0.05)
    return asyncio.run(worker.drain())


def by_turn(buffer):
    return {s["turn_id"]: s for s in buffer.samples()}


def test_feedback_turns_become_ready_samples_with_the_judged_reward(store, caplog):
    chat, buffer = Chat(store), make_buffer(store)
    t = chat.conversation(["Thanks, perfect!", "No, that's wrong. Try again."])
    assert buffer.sync() == 2  # the last turn is still open: no sample yet
    caplog.set_level(logging.INFO, logger="clawrl.buffer")
    assert judge_all(buffer) == 2
    s = by_turn(buffer)
    assert (s[t[0]]["state"], s[t[0]]["reward"], s[t[0]]["advantage"]) == ("ready", 1.0, 1.0)
    assert (s[t[1]]["state"], s[t[1]]["reward"], s[t[1]]["advantage"]) == ("ready", -1.0, -1.0)
    assert t[2] not in s
    votes = buffer.votes(s[t[1]]["sample_id"])
    assert [v["score"] for v in votes] == [-1] and "wrong" in votes[0]["rationale"] and "retry" in votes[0]["rationale"]
    assert "judged -1 by rules" in caplog.text


def test_real_openclaw_correction_is_judged_from_the_users_request_not_the_internal_trailer(store):
    fixtures = Path(__file__).parent / "fixtures" / "openclaw-2026.9.6"
    b1, b2 = (json.loads((fixtures / f).read_text())["body"] for f in ("chat_turn1.json", "chat_turn2.json"))
    chat, buffer = Chat(store), make_buffer(store)
    t1 = chat.serve(b1["messages"], "Hello from stub.")
    chat.serve(b2["messages"], "The sea is wide.")
    buffer.sync()
    [(sid, turn)] = buffer.pending_turns(8)
    item = JudgeInput.from_turn(turn)
    assert item.turn_id == t1 and "two-line poem about the sea" in item.request
    assert item.reply == "Hello from stub." and "Too long" in item.next_state[0]["content"]
    judge_all(buffer)
    s = buffer.get_sample(sid)
    assert (s["state"], s["reward"]) == ("ready", -1.0)
    assert buffer.votes(sid)[0]["rationale"] == "complaint"


def test_samples_carry_the_exact_tokens_logprobs_and_versions_of_the_turn(store):
    chat, buffer = Chat(store), make_buffer(store, max_weight_lag=10)
    t = chat.conversation(["great"], versions=(3, 3, 4))  # a response generated across a weight swap
    judge_all(buffer)
    [sample] = buffer.take_batch(8, current_version=5)
    turn = store.get_turn(t[0])
    assert sample.turn_id == t[0]
    assert sample.prompt_ids == turn["prompt_ids"] and sample.response_ids == turn["response_ids"]
    assert sample.rollout_logprobs == [-0.25, -0.5, -0.75] and sample.weight_versions == [3, 3, 4]
    assert sample.extra["weight_lag"] == 2 and sample.reward == 1.0 and sample.advantage == 1.0


def test_every_closed_turn_ends_trained_or_skipped_with_a_reason(store, caplog):
    caplog.set_level(logging.INFO, logger="clawrl.buffer")
    chat, buffer = Chat(store), make_buffer(store)
    good = chat.conversation(["perfect, thanks"])
    silent = chat.conversation(["And what is 8+1?"], opening="Hi there")  # no explicit feedback
    aborted = chat.serve([SYSTEM, user("Write a poem")], "Roses", status="aborted")
    side = chat.serve([SYSTEM, user("Read HEARTBEAT.md if it exists. Reply HEARTBEAT_OK.")], "HEARTBEAT_OK")
    excluded = chat.conversation(["wrong"], opening="Capital of France?")
    store.relabel_turn(excluded[0], "excluded", actor="admin")
    store.close_idle_sessions(now=1e12, idle_timeout_s=60)  # every session idles out: open turns close
    buffer.sync()
    judge_all(buffer)
    s = by_turn(buffer)
    assert s[good[0]]["state"] == "ready"
    assert s[silent[0]]["skip_reason"] == "no_signal"
    assert s[aborted]["skip_reason"] == "untrainable:aborted"
    assert s[side]["skip_reason"] == "side_turn"
    assert s[excluded[0]]["skip_reason"] == "excluded"
    for last in (good[1], silent[1], excluded[1]):
        assert s[last]["skip_reason"] == "no_next_state"
    assert f"turn {aborted} skipped: untrainable:aborted" in caplog.text
    assert f"turn {side} skipped: side_turn" in caplog.text and "skipped: no_signal" in caplog.text
    assert buffer.ready_count() == 1
    [sample] = buffer.take_batch(8, current_version=0)
    buffer.mark_trained([sample.sample_id], train_step=1, weight_version=1)
    all_turns = [t["turn_id"] for t in store.iter_turns()]
    final = by_turn(buffer)
    assert sorted(final) == sorted(all_turns)
    assert all(x["state"] == "trained" or (x["state"] == "skipped" and x["skip_reason"]) for x in final.values())
    counts = buffer.counts()
    assert counts["trained"] == 1 and counts["skipped"] == len(all_turns) - 1
    assert counts["skipped_by_reason"]["no_next_state"] == 3 and counts["skipped_by_reason"]["side_turn"] == 1


def test_session_done_closes_the_last_turn_without_a_next_state(store):
    chat, buffer = Chat(store), make_buffer(store)
    history = [SYSTEM, user("bye")]
    t = chat.serve(history, "Goodbye!", hints=SessionHints(done=True))
    buffer.sync()
    assert by_turn(buffer)[t]["skip_reason"] == "no_next_state"


def test_a_relabel_after_judging_is_honoured_at_take_time(store):
    chat, buffer = Chat(store), make_buffer(store)
    a = chat.conversation(["thanks!"])
    b = chat.conversation(["👍"], opening="Name a colour")
    judge_all(buffer)
    store.relabel_turn(a[0], "excluded", actor="admin")
    taken = buffer.take_batch(8, current_version=0)
    assert [x.turn_id for x in taken] == [b[0]]
    assert by_turn(buffer)[a[0]]["skip_reason"] == "excluded"


def test_lifecycle_transitions_and_wrong_state_errors(store):
    chat, buffer = Chat(store), make_buffer(store)
    t = chat.conversation(["thanks", "perfect"])
    buffer.sync()
    assert buffer.counts()["pending"] == 2
    judge_all(buffer)
    assert buffer.counts()["ready"] == 2
    batch = buffer.take_batch(1, current_version=0)
    assert [x.turn_id for x in batch] == [t[0]]
    assert buffer.counts()["consumed"] == 1 and buffer.counts()["ready"] == 1
    ready_id = by_turn(buffer)[t[1]]["sample_id"]
    with pytest.raises(ValueError, match="only consumed"):
        buffer.mark_trained([ready_id], train_step=1, weight_version=1)
    buffer.mark_trained([batch[0].sample_id], train_step=1, weight_version=1)
    with pytest.raises(ValueError, match="only consumed"):  # trained once, never again
        buffer.mark_trained([batch[0].sample_id], train_step=2, weight_version=2)
    buffer.mark_skipped([ready_id], "trainer_rejected")
    with pytest.raises(ValueError, match="cannot be skipped"):
        buffer.mark_skipped([batch[0].sample_id], "late")
    with pytest.raises(KeyError):
        buffer.mark_skipped([9999], "nope")
    c = buffer.counts()
    assert (c["trained"], c["skipped_by_reason"]) == (1, {"trainer_rejected": 1})


def test_two_concurrent_takers_never_get_the_same_sample(tmp_path):
    store = TurnStore(tmp_path)
    chat, buffer = Chat(store), make_buffer(store)
    for i in range(12):
        chat.conversation(["thanks"], opening=f"question {i}")
    judge_all(buffer)
    assert buffer.counts()["ready"] == 12
    other = TurnStore(tmp_path)  # a second connection set, as another process would have
    buffers = [buffer, make_buffer(other)]
    got = [[], []]
    barrier = threading.Barrier(2)

    def take(i):
        barrier.wait()
        while batch := buffers[i].take_batch(2, current_version=0):
            got[i] += [x.sample_id for x in batch]

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not set(got[0]) & set(got[1])
    assert len(got[0]) + len(got[1]) == 12
    other.close()
    store.close()


def test_consumed_samples_stay_consumed_across_a_reopen_of_the_store(tmp_path):
    store = TurnStore(tmp_path)
    chat = Chat(store)
    for i in range(4):
        chat.conversation(["great"], opening=f"q{i}")
    buffer = make_buffer(store)
    judge_all(buffer)
    first = {x.sample_id for x in buffer.take_batch(2, current_version=0)}
    store.close()
    reopened = TurnStore(tmp_path, create=False)
    buffer2 = make_buffer(reopened)
    second = {x.sample_id for x in buffer2.take_batch(8, current_version=0)}
    assert len(first) == 2 and len(second) == 2 and not first & second
    assert buffer2.take_batch(8, current_version=0) == []
    reopened.close()


def test_stale_samples_are_dropped_under_drop(store):
    chat, buffer = Chat(store), make_buffer(store, max_weight_lag=2, stale_policy="drop")
    old = chat.conversation(["thanks"], opening="old", versions=(1, 4, 4))
    fresh = chat.conversation(["thanks"], opening="fresh", versions=(3, 3, 3))
    judge_all(buffer)
    taken = buffer.take_batch(8, current_version=5)
    assert [x.turn_id for x in taken] == [fresh[0]]
    s = by_turn(buffer)[old[0]]
    assert (s["state"], s["skip_reason"], s["weight_lag"]) == ("skipped", "stale", 4)  # lag from the oldest token


def test_stale_samples_are_kept_under_importance_weight(store):
    chat, buffer = Chat(store), make_buffer(store, max_weight_lag=2, stale_policy="importance_weight")
    old = chat.conversation(["thanks"], opening="old", versions=(1, 4, 4))
    judge_all(buffer)
    [sample] = buffer.take_batch(8, current_version=5)
    assert sample.turn_id == old[0] and sample.extra["weight_lag"] == 4
    assert sample.weight_versions == [1, 4, 4] and sample.rollout_logprobs == [-0.25, -0.5, -0.75]


def test_samples_requeued_after_a_crash_are_not_stale_for_the_version_jump_the_crash_caused(store):
    """Versions 1-6 were served, nothing was checkpointed, the server died: the base weights come back
    as version 7. A token of version 0 is on-policy for them; one of version 4 is 4 updates away."""
    chat, buffer = Chat(store), make_buffer(store, max_weight_lag=4, stale_policy="drop")
    base = chat.conversation(["thanks"], opening="base", versions=(0, 0, 0))
    later = chat.conversation(["thanks"], opening="later", versions=(2, 4, 4))
    too_far = chat.conversation(["thanks"], opening="far", versions=(5, 6, 6))
    judge_all(buffer)
    buffer.record_alias(7, source=0)
    taken = {x.turn_id: x.extra["weight_lag"] for x in buffer.take_batch(8, current_version=7)}
    assert taken == {base[0]: 0, later[0]: 4}
    s = by_turn(buffer)[too_far[0]]
    assert (s["state"], s["skip_reason"], s["weight_lag"]) == ("skipped", "stale", 6)


def test_a_recorded_alias_survives_a_restart_and_lag_grows_with_new_updates(tmp_path):
    store = TurnStore(tmp_path)
    # max_batch_size=1: steps of one, so the second sample waits (a step would otherwise take both)
    chat, buffer = Chat(store), make_buffer(store, max_weight_lag=1, batch_size=1, max_batch_size=1)
    turns = [chat.conversation(["thanks"], opening=f"q{i}", versions=(3, 3, 3)) for i in range(2)]
    judge_all(buffer)
    buffer.record_alias(9, source=3)
    store.close()
    store = TurnStore(tmp_path)
    buffer = make_buffer(store, max_weight_lag=1, batch_size=1, max_batch_size=1)
    # version 10 is one update after 9 (= 3): lag 1, within the bound
    [first] = buffer.take_batch(1, current_version=10)
    assert first.turn_id == turns[0][0] and first.extra["weight_lag"] == 1
    # two updates later it is stale
    assert buffer.take_batch(1, current_version=11) == []
    assert by_turn(buffer)[turns[1][0]]["weight_lag"] == 2
    store.close()
    with pytest.raises(ValueError, match="newer than its source"):
        make_buffer(TurnStore(tmp_path), max_weight_lag=1).record_alias(3, source=3)


def test_n_choices_of_one_request_form_a_grpo_group(store):
    chat, buffer = Chat(store), make_buffer(store, group_advantage="grpo")
    linker = chat.linker
    plan = linker.begin([SYSTEM, user("Pick a number")], caller_key="k")
    turns = []
    for i, reply in enumerate(["7", "8", "9"]):
        turns.append(linker.record(plan, prompt_ids=[1, 2, 3], response_ids=[50 + i], logprobs=[-1.0],
                                   weight_versions=[0], response_text=reply, finish_reason="stop"))
    # The client keeps choice "8"; the user's reaction becomes its next state.
    chat.serve([SYSTEM, user("Pick a number"), assistant("8"), user("wrong, try again")], "9")
    buffer.sync()
    judge_all(buffer)
    s = by_turn(buffer)
    assert s[turns[1]]["state"] == "judged"  # waits: its sibling choices are still open
    # Give the siblings verdicts by the environment, as an n>1 rollout would.
    for tid, fb in ((turns[0], "thanks"), (turns[2], "thanks")):
        store.apply_link(session_id=plan.session_id, caller_hash=plan.caller_hash, user=None, source="inferred",
                         now=0.0, branch_id=plan.branch_id, next_state=(tid, [user(fb)]))
    judge_all(buffer)
    s = by_turn(buffer)
    adv = [s[t]["advantage"] for t in turns]
    assert [s[t]["state"] for t in turns] == ["ready"] * 3
    assert len({s[t]["group_id"] for t in turns}) == 1
    assert adv[1] < 0 < adv[0] and adv[0] == pytest.approx(adv[2])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)  # group-normalised, unlike a group of one


def test_a_group_of_one_keeps_its_reward_as_advantage(store):
    chat, buffer = Chat(store), make_buffer(store, baseline="reward", group_advantage="grpo")
    t = chat.conversation(["no, that's not it"])
    judge_all(buffer)
    assert by_turn(buffer)[t[0]]["advantage"] == -1.0  # never a normalised group of one (which gives 0)


def test_ema_baseline_centres_live_chat_and_survives_a_restart(tmp_path):
    store = TurnStore(tmp_path)
    chat, buffer = Chat(store), make_buffer(store, baseline="ema", baseline_decay=0.5)
    a = chat.conversation(["thanks"], opening="q1")
    judge_all(buffer)
    b = chat.conversation(["wrong"], opening="q2")
    judge_all(buffer)
    s = by_turn(buffer)
    assert s[a[0]]["advantage"] == 1.0  # first reward: no baseline yet
    assert s[b[0]]["advantage"] == -2.0  # -1 minus the baseline 1.0
    assert buffer.counts()["baseline"] == {"decay": 0.5, "value": 0.0, "count": 2}
    store.close()
    store = TurnStore(tmp_path)
    chat, buffer = Chat(store), make_buffer(store, baseline="ema", baseline_decay=0.5)
    c = chat.conversation(["perfect"], opening="q3")
    judge_all(buffer)
    assert by_turn(buffer)[c[0]]["advantage"] == 1.0  # +1 minus the restored baseline 0.0
    assert buffer.counts()["baseline"] == {"decay": 0.5, "value": 0.5, "count": 3}
    store.close()


def test_requeue_after_restore_returns_lost_work_to_ready(store):
    chat, buffer = Chat(store), make_buffer(store)
    for i in range(6):
        chat.conversation(["thanks"], opening=f"q{i}")
    judge_all(buffer)
    step1 = buffer.take_batch(2, current_version=0)
    buffer.mark_trained([x.sample_id for x in step1], train_step=1, weight_version=1)
    step2 = buffer.take_batch(2, current_version=1)
    buffer.mark_trained([x.sample_id for x in step2], train_step=2, weight_version=2)
    in_flight = buffer.take_batch(2, current_version=2)
    # Crash; the newest checkpoint is step 1: step 2's update and the in-flight batch are lost.
    assert buffer.requeue_after_restore(checkpoint_step=1) == 4
    c = buffer.counts()
    assert (c["trained"], c["ready"], c["consumed"]) == (2, 4, 0)
    again = {x.sample_id for x in buffer.take_batch(8, current_version=1)}
    assert again == {x.sample_id for x in step2 + in_flight}
    assert buffer.get_sample(step2[0].sample_id)["requeues"] == 1


class ScriptedJudge(Judge):
    """Answers from a script per call: a Verdict, 'sleep' (slower than any timeout) or an exception."""

    kind = "scripted"

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    async def judge(self, item):
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if step == "sleep":
            await asyncio.sleep(10)
        if isinstance(step, Exception):
            raise step
        return step


GARBAGE = Verdict(0, [Vote(None, "garbage: no score", "blah"), Vote(None, "garbage: no score", "meh")], "scripted")


def test_a_judge_that_times_out_is_retried_then_skipped_with_judge_timeout(store):
    chat, buffer = Chat(store), make_buffer(store)
    t = chat.conversation(["thanks"])
    judge = ScriptedJudge(["sleep"])
    judge_all(buffer, judge, timeout_s=0.05, retries=2)
    s = by_turn(buffer)[t[0]]
    assert (s["state"], s["skip_reason"]) == ("skipped", "judge_timeout")
    assert judge.calls == 3
    votes = buffer.votes(s["sample_id"])
    assert [v["attempt"] for v in votes] == [1, 2, 3] and all("timeout" in v["rationale"] for v in votes)


def test_garbage_answers_are_recorded_and_skip_with_judge_garbage(store):
    chat, buffer = Chat(store), make_buffer(store)
    t = chat.conversation(["thanks"])
    judge_all(buffer, ScriptedJudge([GARBAGE]), retries=1)
    s = by_turn(buffer)[t[0]]
    assert s["skip_reason"] == "judge_garbage"
    votes = buffer.votes(s["sample_id"])
    assert len(votes) == 4 and {v["raw"] for v in votes} == {"blah", "meh"}
    assert buffer.counts()["garbage_votes"] == 4


def test_a_retry_after_garbage_can_still_judge_and_keeps_every_vote(store):
    chat, buffer = Chat(store), make_buffer(store)
    t = chat.conversation(["whatever"])
    good = Verdict(1, [Vote(1, "looks fine", "Score: +1"), Vote(1, "ok", "Score: +1"), Vote(-1, "bad", "Score: -1")],
                   "scripted")
    judge_all(buffer, ScriptedJudge([RuntimeError("engine hiccup"), GARBAGE, good]), retries=2)
    s = by_turn(buffer)[t[0]]
    assert (s["state"], s["reward"]) == ("ready", 1.0)
    votes = buffer.votes(s["sample_id"])
    assert [v["attempt"] for v in votes] == [1, 2, 2, 3, 3, 3]
    assert "engine hiccup" in votes[0]["rationale"]
    assert buffer.counts()["judge_agreement"] == pytest.approx(2 / 3)


def test_judging_runs_with_bounded_concurrency(store):
    chat, buffer = Chat(store), make_buffer(store)
    for i in range(6):
        chat.conversation(["thanks"], opening=f"q{i}")
    running, peak = 0, 0

    class Slow(Judge):
        kind = "slow"

        async def judge(self, item):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.02)
            running -= 1
            return Verdict(1, [Vote(1, "ok", "")], "slow")

    assert judge_all(buffer, Slow(), concurrency=2) == 6
    assert peak == 2


def test_background_worker_judges_turns_as_they_close(store):
    chat, buffer = Chat(store), make_buffer(store)

    async def go():
        worker = JudgeWorker(buffer, RulesJudge(), JudgeConfig(), poll_s=10.0)
        worker.start()
        await asyncio.sleep(0.05)
        await asyncio.to_thread(chat.conversation, ["thanks!"])
        worker.notify()  # the gateway calls this when a turn gets its next state
        for _ in range(100):
            if buffer.counts()["ready"]:
                break
            await asyncio.sleep(0.02)
        await worker.stop()
        return buffer.counts()

    assert asyncio.run(go())["ready"] == 1


def test_pending_samples_survive_a_restart_and_are_judged_after_it(tmp_path):
    store = TurnStore(tmp_path)
    chat, buffer = Chat(store), make_buffer(store)
    chat.conversation(["thanks"])
    buffer.sync()
    assert buffer.counts()["pending"] == 1
    store.close()
    store = TurnStore(tmp_path)
    buffer = make_buffer(store)
    assert judge_all(buffer) == 1 and buffer.counts()["ready"] == 1
    store.close()


def test_bad_train_settings_are_refused(store):
    with pytest.raises(ValueError, match="stale_policy"):
        make_buffer(store, stale_policy="keep")
    with pytest.raises(ValueError, match="baseline"):
        make_buffer(store, baseline="mean")
