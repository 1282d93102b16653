"""Judges: explicit-feedback rules (incl. negation), the model judge's prompt, votes, majority, ties
and garbage on a real engine and on canned replies, and environment verdicts."""
import asyncio
from typing import AsyncIterator

import pytest

from clawrl.buffer import RolloutBuffer
from clawrl.config import EngineConfig, JudgeConfig, TrainConfig
from clawrl.engines.base import Engine, ModelInfo, SamplingParams, ScoreResult, TokenChunk
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine
from clawrl.judges import JudgeError, make_judge
from clawrl.judges.base import JudgeInput, majority
from clawrl.judges.env import EnvJudge, register_env_verdict, unregister_env_verdict
from clawrl.judges.prm import PRMJudge, parse_score
from clawrl.judges.rules import NO_FEEDBACK, RulesJudge
from clawrl.orchestration.judging import JudgeWorker
from clawrl.store import TurnStore
from engine_testing import make_model_dir


def item(*next_state, request="What is 7+5?", reply="It is 12.", tool_calls=None):
    return JudgeInput(turn_id=1, request=request, reply=reply, tool_calls=tool_calls, next_state=list(next_state))


def user(text):
    return {"role": "user", "content": text}


def tool(text):
    return {"role": "tool", "content": text}


def rules(*next_state):
    return RulesJudge().score(item(*next_state))


# --- rules ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, rule", [
    ("Thanks!", "thanks"), ("thank you so much", "thanks"), ("Perfect.", "praise"), ("great, that works", "praise"),
    ("That's correct", "correct"), ("\U0001F44D", "thumbs_up"), ("\U0001F44D\U0001F3FD nice", "thumbs_up"),
    ("Not bad at all", "not_bad"), ("No problem, thanks", "thanks"), ("nothing wrong with that, cheers", "nothing_wrong"),
    ("[Wed 2026-12-02 13:12 UTC] Thank you!\n\nRuntime: agent=main | session=agent:main:x", "thanks"),
])
def test_rules_score_explicit_praise_positive(text, rule):
    v = rules(user(text))
    assert v.score == 1 and v.signal and rule in v.votes[0].rationale


@pytest.mark.parametrize("text, rule", [
    ("That's wrong.", "wrong"), ("incorrect", "wrong"), ("No, use the other file.", "no_correction"), ("No.", "no_correction"),
    ("That's not what I asked for", "negated_praise"), ("that's not it", "thats_not"), ("Please try again", "retry"),
    ("redo it", "retry"), ("\U0001F44E", "thumbs_down"), ("not great", "negated_praise"), ("That isn't right", "negated_praise"),
    ("It doesn't work", "not_working"), ("Too long. One line please.", "complaint"),
    ("Thanks, but that's wrong", "wrong"),  # a correction outweighs courtesy
])
def test_rules_score_corrections_negative(text, rule):
    v = rules(user(text))
    assert v.score == -1 and rule in v.votes[0].rationale


@pytest.mark.parametrize("text", [
    "And what is 8+1?", "What's wrong with my code?", "Is that correct?", "no thanks", "Now list the files.",
    "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nthanks wrong\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>",
])
def test_rules_find_no_signal_without_explicit_feedback(text):
    v = rules(user(text))
    assert (v.score, v.signal, v.votes[0].rationale) == (0, False, NO_FEEDBACK)


@pytest.mark.parametrize("text, rule", [
    ("Command exited with code 1", "nonzero_exit"), ('{"exitCode": 2, "stdout": ""}', "nonzero_exit"),
    ("Traceback (most recent call last):\n  File x\nValueError: bad", "tool_error"),
    ('{"status": "error", "error": "ENOENT"}', "tool_error"), ("bash: foo: command not found", "tool_error"),
    ("cat: x.txt: No such file or directory", "tool_error"), ("Error: permission denied", "tool_error"),
])
def test_rules_score_tool_failures_negative(text, rule):
    v = rules(tool(text))
    assert v.score == -1 and rule in v.votes[0].rationale


@pytest.mark.parametrize("text", ["exit code 0", '{"error": null, "files": ["a"]}', '".git/"\n"AGENTS.md"'])
def test_rules_leave_successful_tool_results_unscored(text):
    assert rules(tool(text)).signal is False


def test_rules_read_content_parts_and_the_whole_next_state():
    v = rules(tool("exit code 0"), {"role": "user", "content": [{"type": "text", "text": "perfect, "}, {"type": "text", "text": "thanks"}]})
    assert v.score == 1 and "praise" in v.votes[0].rationale and "thanks" in v.votes[0].rationale


# --- majority and parsing -------------------------------------------------------------------------


def test_majority_of_valid_votes_and_ties_give_zero():
    assert majority([1, 1, -1]) == 1
    assert majority([-1, None, -1]) == -1
    assert majority([1, -1]) == 0 and majority([1, 0, -1]) == 0 and majority([1, -1, None]) == 0
    assert majority([None, None]) == 0 and majority([]) == 0
    assert majority([0, 0, 1]) == 0


@pytest.mark.parametrize("text, score", [
    ("The user thanked the assistant.\nScore: +1", 1), ("Score: -1", -1), ("score: 0", 0), ("Score: 1", 1),
    ("Score: **-1**", -1), ("First I thought Score: -1 but no.\nScore: +1", 1), ("\\boxed{-1}", -1),
    ("no verdict here", None), ("Score: 5", None), ("Score: 1.5", None), ("", None),
])
def test_parse_score_takes_the_last_score_line(text, score):
    assert parse_score(text) == score


# --- PRM judge ------------------------------------------------------------------------------------


class CannedEngine(Engine):
    """A deterministic engine: each generate() streams the next canned reply's tokens."""

    def __init__(self, tokenizer, replies, delay=0.0):
        self.tokenizer, self.replies, self.delay = tokenizer, list(replies), delay
        self.prompts, self.seeds = [], []

    async def start(self):
        pass

    async def shutdown(self):
        pass

    async def stream(self, prompt_ids, params: SamplingParams, request_id=None) -> AsyncIterator[TokenChunk]:
        self.prompts.append(list(prompt_ids))
        self.seeds.append(params.seed)
        text = self.replies.pop(0)
        await asyncio.sleep(self.delay)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_new_tokens]
        yield TokenChunk(ids, [-1.0] * len(ids), [0] * len(ids))
        yield TokenChunk([], [], [], finish_reason="stop")

    async def score(self, prompt_ids, response_ids, top_k=0, temperature=1.0):
        return ScoreResult([0.0] * len(response_ids), 0)

    async def abort(self, request_id):
        return False

    async def pause(self):
        pass

    async def resume(self):
        pass

    async def flush_cache(self):
        pass

    async def update_weights(self, state, version):
        raise NotImplementedError("a canned engine has no weights")

    async def health(self):
        return {"ok": True}

    def model_info(self):
        return ModelInfo("canned", "", "Canned", len(self.tokenizer), 4096, [], 0, "cpu", "float32")


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    return load_model(str(make_model_dir(tmp_path_factory.mktemp("judge_model") / "m", "qwen3", seed=3)), device="cpu")


def prm_verdict(tokenizer, replies, **kw):
    engine = CannedEngine(tokenizer, replies)
    judge = PRMJudge(engine, tokenizer, votes=len(replies), **kw)
    verdict = asyncio.run(judge.judge(item(user("No, it is 13."), tool_calls=[
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"x": "7+5"}'}}])))
    return verdict, engine


def test_prm_prompt_shows_request_reply_and_next_state_in_the_chat_template(judge_model):
    verdict, engine = prm_verdict(judge_model.tokenizer, ["Score: -1"] * 3)
    prompt = judge_model.tokenizer.decode(engine.prompts[0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    for part in ("What is 7+5?", "It is 12.", "calc(", "No, it is 13.", "Score: +1"):
        assert part in prompt
    assert len(set(engine.seeds)) == 3  # every vote is its own sample
    assert (verdict.score, verdict.kind, verdict.garbage) == (-1, "prm", False)


def test_prm_majority_decides_and_a_tie_gives_zero(judge_model):
    tok = judge_model.tokenizer
    assert prm_verdict(tok, ["Score: +1", "The user corrects it. Score: -1", "Score: +1"])[0].score == 1
    tie, _ = prm_verdict(tok, ["Score: +1", "Score: -1", "I cannot tell"])
    assert tie.score == 0 and [v.score for v in tie.votes] == [1, -1, None]
    assert tie.votes[2].raw == "I cannot tell" and "garbage" in tie.votes[2].rationale
    assert not tie.garbage


def test_prm_all_garbage_votes_make_a_garbage_verdict(judge_model):
    v, _ = prm_verdict(judge_model.tokenizer, ["hmm", "Score: maybe"])
    assert v.garbage and [x.score for x in v.votes] == [None, None]


def test_prm_prompt_is_cut_to_fit_the_judge_context(judge_model):
    judge = PRMJudge(CannedEngine(judge_model.tokenizer, []), judge_model.tokenizer, max_new_tokens=64)
    long_item = item(tool("line of output\n" * 2000), request="start " + "x " * 3000)
    ids = judge.prompt_ids(long_item)
    assert len(ids) <= 4096 - 64
    assert "characters cut" in judge_model.tokenizer.decode(ids)


def test_prm_on_a_real_engine_records_every_sampled_vote(judge_model):
    async def go():
        engine = TorchEngine(judge_model, EngineConfig())
        await engine.start()
        try:
            judge = PRMJudge(engine, votes=3, max_new_tokens=12)
            return await judge.judge(item(user("thanks!")))
        finally:
            await engine.shutdown()

    verdict = asyncio.run(go())
    assert len(verdict.votes) == 3 and all(v.raw for v in verdict.votes)
    assert len({v.raw for v in verdict.votes}) > 1  # distinct seeds, distinct samples
    # A random-weight model never writes a score line: its votes are garbage, and say so.
    assert verdict.garbage and all(v.score is None for v in verdict.votes)


def test_prm_judge_too_slow_for_its_timeout_skips_the_turn(judge_model, tmp_path):
    from test_buffer import Chat

    store = TurnStore(tmp_path)
    Chat(store).conversation(["thanks"])
    buffer = RolloutBuffer(store, TrainConfig())
    engine = CannedEngine(judge_model.tokenizer, ["Score: +1"] * 6, delay=5.0)
    worker = JudgeWorker(buffer, PRMJudge(engine, votes=3), JudgeConfig(kind="prm", timeout_s=0.05, retries=1))
    assert asyncio.run(worker.drain()) == 1
    [sample] = buffer.samples()[:1]
    assert sample["skip_reason"] == "judge_timeout" and len(buffer.votes(sample["sample_id"])) == 2
    store.close()


def test_make_judge_builds_the_configured_kind(judge_model):
    assert make_judge(JudgeConfig()).kind == "rules"
    assert make_judge(JudgeConfig(kind="env")).kind == "env"
    engine = CannedEngine(judge_model.tokenizer, [])
    prm = make_judge(JudgeConfig(kind="prm", votes=5), engine)
    assert prm.kind == "prm" and prm.votes == 5
    with pytest.raises(JudgeError, match="needs a judge engine"):
        make_judge(JudgeConfig(kind="prm"))
    with pytest.raises(JudgeError, match="unknown judge.kind"):
        make_judge(JudgeConfig(kind="vibes"))


# --- environment verdicts -------------------------------------------------------------------------


def test_env_judge_uses_the_first_registered_verdict_that_answers():
    register_env_verdict("never", lambda it: None)

    async def exit_marker(it):
        text = it.next_state[-1]["content"]
        return 1 if "VERDICT: PASS" in text else -1 if "VERDICT: FAIL" in text else None

    register_env_verdict("exit_marker", exit_marker)
    try:
        judge = EnvJudge(["never", "exit_marker"])
        v = asyncio.run(judge.judge(item(tool("...\nVERDICT: FAIL"))))
        assert (v.score, v.votes[0].rationale, v.kind) == (-1, "exit_marker", "env")
        v = asyncio.run(judge.judge(item(tool("nothing to report"))))
        assert (v.score, v.signal) == (0, False)
    finally:
        unregister_env_verdict("never")
        unregister_env_verdict("exit_marker")


def test_env_judge_records_a_broken_verdict_function_as_garbage():
    register_env_verdict("broken", lambda it: 7)
    try:
        v = asyncio.run(EnvJudge(["broken"]).judge(item(tool("x"))))
        assert v.garbage and "returned 7" in v.votes[0].rationale
    finally:
        unregister_env_verdict("broken")
    with pytest.raises(JudgeError, match="no environment verdict named"):
        EnvJudge(["broken"])


def test_builtin_pytest_summary_verdict():
    judge = EnvJudge(["pytest_summary"])
    passed = asyncio.run(judge.judge(item(tool("....\n========== 4 passed in 0.12s ==========\n"))))
    failed = asyncio.run(judge.judge(item(tool("F...\n====== 1 failed, 3 passed in 0.30s ======"))))
    assert (passed.score, failed.score) == (1, -1)
