"""OPD teacher: hints judged and stored with reasons, the sampled response scored under the hinted
prompt (token-in/token-out, exact logprobs and top-k, weight version), durable across restarts,
bounded concurrency, yielding to serving, and clear failures for prompts it cannot rebuild."""
import asyncio
import time

import pytest

from clawrl.config import EngineConfig, OpdConfig
from clawrl.engines.base import ScoreResult
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine
from clawrl.judges.base import JudgeInput
from clawrl.judges.hints import HintJudge, HintVerdict, HintVote, RulesHintJudge
from clawrl.samples import Sample
from clawrl.store import TurnStore
from clawrl.methods.opd.teacher import (OpdStore, TeacherWorker, acceptance, hint_tag, hinted_messages,
                                        teacher_prompt_ids)
from engine_testing import make_model_dir
from test_buffer import SYSTEM, Chat, assistant, user
from test_judges import CannedEngine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(make_model_dir(tmp_path_factory.mktemp("teacher_model") / "m", "qwen3", seed=5)),
                      device="cpu")


@pytest.fixture
def store(tmp_path):
    s = TurnStore(tmp_path)
    yield s
    s.close()


def render(tok, messages, tools=None):
    return tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


_OPENINGS = iter(range(1, 10_000))


def served(store, tok, feedback, prefill=()):
    """Two turns of a new conversation: 'What is 7+<n>?' answered, then ``feedback`` (the first turn's
    next state). Returns the first turn's id; its stored prompt ids are the real rendering (plus ``prefill``)."""
    chat = Chat(store)
    first = [SYSTEM, user(f"What is 7+{next(_OPENINGS)}?")]
    t1 = chat.serve(first, "7 + 5 = 12. Numbers are fun!", prompt=render(tok, first) + list(prefill),
                    versions=(0, 0, 0, 0))
    second = first + [assistant("7 + 5 = 12. Numbers are fun!"), user(feedback)]
    chat.serve(second, "12", prompt=render(tok, second))
    return t1


def run_worker(store, engine, judge=None, **cfg):
    async def go():
        await engine.start()
        try:
            worker = TeacherWorker(OpdStore(store), judge or RulesHintJudge(), engine, OpdConfig(**cfg),
                                   tokenizer=getattr(engine, "tokenizer", None), poll_s=0.05)
            return await worker.drain()
        finally:
            await engine.shutdown()
    return asyncio.run(go())


def test_teacher_scores_the_stored_response_under_the_hinted_prompt(store, model):
    tok = model.tokenizer
    t1 = served(store, tok, "Too long. One line, please.")
    assert run_worker(store, TorchEngine(model, EngineConfig()), topk=3) == 1
    rec = OpdStore(store).get(t1)
    turn = OpdStore(store).turn(t1)
    assert rec["state"] == "scored" and rec["hint"] == "Answer in one line." and rec["teacher"] == "policy"
    text = tok.decode(rec["teacher_prompt_ids"])
    assert "? [Hint: answer in one line]" in text and text.count("[Hint:") == 1
    assert rec["teacher_prompt_ids"] != turn["prompt_ids"]
    assert len(rec["teacher_logprobs"]) == len(turn["response_ids"]) == 4
    assert rec["weight_version"] == 0
    assert len(rec["topk_ids"]) == 4 and all(len(r) == 3 for r in rec["topk_ids"] + rec["topk_logprobs"])

    async def direct():  # the stored numbers are the engine's exact scores of the stored ids
        engine = TorchEngine(model, EngineConfig())
        await engine.start()
        try:
            hinted = await engine.score(rec["teacher_prompt_ids"], turn["response_ids"], top_k=3)
            plain = await engine.score(turn["prompt_ids"], turn["response_ids"])
            return hinted, plain
        finally:
            await engine.shutdown()

    hinted, plain = asyncio.run(direct())
    assert rec["teacher_logprobs"] == pytest.approx(hinted.logprobs, abs=1e-9)
    assert rec["topk_ids"] == hinted.topk_ids
    assert rec["teacher_logprobs"] != pytest.approx(plain.logprobs, abs=1e-4)  # the hint changes the scores


def test_turns_without_hint_are_recorded_with_the_reason(store, model):
    tok = model.tokenizer
    thanks = served(store, tok, "Thanks!")
    wrong = served(store, tok, "No, that's wrong.")
    run_worker(store, TorchEngine(model, EngineConfig()))
    opd = OpdStore(store)
    assert (opd.get(thanks)["state"], opd.get(thanks)["reason"]) == ("rejected", "no_hindsight")
    assert (opd.get(wrong)["state"], opd.get(wrong)["reason"]) == ("rejected", "not_actionable")
    assert opd.get(thanks)["votes"][0]["rationale"].startswith("no_hindsight")
    counts = opd.counts()
    assert counts["rejected"] == 2 and counts["by_reason"] == {"no_hindsight": 1, "not_actionable": 1}


class CountingEngine(CannedEngine):
    """Scores with constant logprobs, counting calls and their overlap; ``waiting`` is what health reports."""

    def __init__(self, tokenizer, delay=0.0, waiting_until=0.0):
        super().__init__(tokenizer, [])
        self.calls, self.live, self.most_live, self.delay, self.waiting_until = 0, 0, 0, delay, waiting_until
        self.score_times = []

    async def score(self, prompt_ids, response_ids, top_k=0, temperature=1.0):
        self.calls += 1
        self.live += 1
        self.most_live = max(self.most_live, self.live)
        self.score_times.append(time.monotonic())
        await asyncio.sleep(self.delay)
        self.live -= 1
        return ScoreResult([-0.5] * len(response_ids), 7)

    async def health(self):
        return {"ok": True, "waiting": 1 if time.monotonic() < self.waiting_until else 0}


class NeverCalled(HintJudge):
    kind = "never"

    async def extract(self, item):
        raise AssertionError("a judged turn was judged again")


def test_restart_neither_rejudges_nor_rescores(store, model):
    tok = model.tokenizer
    t1 = served(store, tok, "Too long. One line, please.")
    run_worker(store, TorchEngine(model, EngineConfig()))
    before = OpdStore(store).get(t1)
    engine = CountingEngine(tok)
    assert run_worker(store, engine, judge=NeverCalled()) == 0
    assert engine.calls == 0 and OpdStore(store).get(t1) == before


def test_accepted_but_unscored_turn_is_scored_after_a_restart(store, model):
    tok = model.tokenizer
    t1 = served(store, tok, "Too long. One line, please.")
    OpdStore(store).record_hint(t1, HintVerdict(True, "Be brief.", "accepted", [HintVote(True, "Be brief.", "r")], "x", 1.0))
    engine = CountingEngine(tok)
    assert run_worker(store, engine, judge=NeverCalled()) == 1
    rec = OpdStore(store).get(t1)
    assert engine.calls == 1 and rec["state"] == "scored" and rec["hint"] == "Be brief." and rec["weight_version"] == 7


def test_concurrency_is_bounded(store, model):
    tok = model.tokenizer
    for _ in range(5):
        served(store, tok, "Too long. One line, please.")
    engine = CountingEngine(tok, delay=0.05)
    assert run_worker(store, engine, concurrency=2) == 5
    assert engine.calls == 5 and engine.most_live == 2


def test_scoring_waits_while_user_requests_queue(store, model):
    tok = model.tokenizer
    served(store, tok, "Too long. One line, please.")
    start = time.monotonic()
    engine = CountingEngine(tok, waiting_until=start + 0.3)
    run_worker(store, engine)
    assert engine.score_times and engine.score_times[0] >= start + 0.3


def test_forced_tool_prefill_is_carried_over_after_the_hint(store, model):
    tok = model.tokenizer
    prefill = tok.encode('<tool_call>\n{"name": "', add_special_tokens=False)
    t1 = served(store, tok, "Too long. One line, please.", prefill=prefill)
    ids = teacher_prompt_ids(tok, OpdStore(store).turn(t1), "Answer in one line.")
    assert ids[-len(prefill):] == prefill and "[Hint: answer in one line]" in tok.decode(ids)


def test_prompt_that_does_not_render_to_the_stored_ids_fails_with_a_reason(store, model):
    tok = model.tokenizer
    chat = Chat(store)
    first = [SYSTEM, user("What is 7+5?")]
    t1 = chat.serve(first, "7 + 5 = 12. Numbers are fun!", prompt=[5, 6, 7])  # e.g. truncated history
    chat.serve(first + [assistant("7 + 5 = 12. Numbers are fun!"), user("Too long. One line, please.")], "12")
    engine = CountingEngine(tok)
    run_worker(store, engine)
    rec = OpdStore(store).get(t1)
    assert (rec["state"], rec["reason"]) == ("failed", "prompt_mismatch") and engine.calls == 0


def test_attach_puts_teacher_signal_on_scored_samples_only(store, model):
    tok = model.tokenizer
    hinted = served(store, tok, "Too long. One line, please.")
    thanks = served(store, tok, "Thanks!")
    run_worker(store, CountingEngine(tok), topk=0)
    opd = OpdStore(store)
    samples = [Sample(1, hinted, "g", [], [1, 2, 3, 4], [0.0] * 4, [0] * 4, 0.0, 0.0),
               Sample(2, thanks, "g", [], [1, 2, 3, 4], [0.0] * 4, [0] * 4, 0.0, 0.0)]
    assert opd.attach(samples) == 1
    assert samples[0].teacher.teacher_logprobs == [-0.5] * 4
    assert samples[0].teacher.hint == "Answer in one line." and samples[0].teacher.topk_ids is None
    assert samples[1].teacher is None


def test_hint_goes_on_the_last_user_message_of_the_history():
    messages = [SYSTEM, user("What is 7+5?"), {"role": "user", "content": [{"type": "text", "text": "trailer"}]}]
    out = hinted_messages(messages, 2, "Answer in one line.")
    assert out[1]["content"] == "What is 7+5? [Hint: answer in one line]" and out[2] == messages[2]
    assert messages[1]["content"] == "What is 7+5?"  # the stored messages are not modified
    parts = hinted_messages([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], 1, "Be brief.")
    assert parts[0]["content"][-1]["text"] == " [Hint: be brief]"
    assert hint_tag("JSON only, please.") == "[Hint: JSON only, please]"


def test_worker_refuses_bad_settings(model):
    with pytest.raises(ValueError, match="concurrency"):
        TeacherWorker(None, RulesHintJudge(), CountingEngine(model.tokenizer), OpdConfig(concurrency=0),
                      tokenizer=model.tokenizer)
    with pytest.raises(ValueError, match="topk"):
        TeacherWorker(None, RulesHintJudge(), CountingEngine(model.tokenizer), OpdConfig(topk=-1),
                      tokenizer=model.tokenizer)


def test_a_second_verdict_for_a_judged_turn_is_ignored(store, model):
    t1 = served(store, model.tokenizer, "Thanks!")
    opd = OpdStore(store)
    assert opd.record_hint(t1, HintVerdict(False, "", "no_hindsight", [], "rules"))
    assert not opd.record_hint(t1, HintVerdict(True, "Be brief.", "accepted", [], "rules", 1.0))
    assert opd.get(t1)["state"] == "rejected"


def test_hinted_sample_is_the_teachers_own_reply_under_the_hint_stored_with_the_score(store, model):
    # opd.hinted_sample: the worker also samples under the hinted prompt and stores the ids as sampled,
    # in the same row as the scores; attach hands them out, weighted by the hint judge's acceptance
    tok = model.tokenizer
    t1 = served(store, tok, "Too long. One line, please.")
    assert run_worker(store, TorchEngine(model, EngineConfig()), hinted_sample=True, hinted_temperature=0.0,
                      hinted_max_tokens=6) == 1
    rec = OpdStore(store).get(t1)
    assert rec["state"] == "scored" and rec["hinted_temperature"] == 0.0 and rec["acceptance"] == 1.0

    async def greedy():
        engine = TorchEngine(model, EngineConfig())
        await engine.start()
        try:
            from clawrl.engines.base import SamplingParams
            return await engine.generate(rec["teacher_prompt_ids"], SamplingParams(max_new_tokens=6, temperature=0))
        finally:
            await engine.shutdown()

    expected = asyncio.run(greedy())
    assert rec["hinted_ids"] == expected.token_ids and 1 <= len(rec["hinted_ids"]) <= 6
    # the ids are exact; logprobs differ by fp32 noise between batch shapes (2.9e-6 seen in CI)
    assert rec["hinted_logprobs"] == pytest.approx(expected.logprobs, abs=2e-5)
    n = len(OpdStore(store).turn(t1)["response_ids"])
    s = Sample(1, t1, "g", [], [1] * n, [0.0] * n, [0] * n, 0.0, 0.0)
    assert OpdStore(store).attach([s], hinted=True) == 1
    assert s.teacher.hinted_ids == expected.token_ids and s.teacher.hinted_weight == 1.0
    OpdStore(store).attach([s])  # opd.hinted_sample off (e.g. a replay's override): no hinted reply
    assert s.teacher.hinted_ids is None and s.teacher.hinted_weight == 0.0


def test_without_hinted_sample_no_reply_is_sampled_and_acceptance_counts_every_vote(store, model):
    tok = model.tokenizer
    t1 = served(store, tok, "Too long. One line, please.")
    engine = CountingEngine(tok)
    run_worker(store, engine)
    rec = OpdStore(store).get(t1)
    assert rec["state"] == "scored" and rec["hinted_ids"] is None and rec["hinted_logprobs"] is None
    assert acceptance([{"accept": True}, {"accept": True}, {"accept": False}, {"accept": None}]) == 0.5
    assert acceptance([]) == 0.0
