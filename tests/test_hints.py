"""Hint judges: the rules extractor on natural corrections and non-hints, the vote-selection rule
(majority acceptance, consensus, ties, rejection reasons), the model judge's parsing on a canned
engine, and the labelled set (deterministic, labelled, matched by the documented criterion)."""
import asyncio

import pytest

from clawrl.config import OpdConfig
from clawrl.judges import JudgeError
from clawrl.judges.base import JudgeInput
from clawrl.judges.hint_set import hint_cases, hint_matches, instructions_in
from clawrl.judges.hints import (HintVote, ModelHintJudge, RulesHintJudge, choose_hint, make_hint_judge, overlap,
                                 parse_hint_vote, usable_hint)
from engine_testing import build_tokenizer
from test_judges import CannedEngine


def extract(*texts):
    item = JudgeInput(1, "What is 7+5?", "7 + 5 = 12. Numbers are fun!", None,
                      [{"role": "user", "content": t} for t in texts])
    return RulesHintJudge().score(item)


@pytest.mark.parametrize("text, hint", [
    ("Too long. One line, and no rhymes please.", "Answer in one line, without rhymes."),
    ("Don't use bold, and give just the number.", "Without bold text, answer with just the answer."),
    ("Hmm, no -- too wordy.", "Be brief."),
    ("No, it's 12.", "The answer is 12."),
    ("It's Paris, not Rome.", "The answer is Paris."),
    ("Hmm, how did you get that?", "Show the full sum, like 7 + 5 = 12."),
    ("Thanks, but keep it shorter next time.", "Be brief."),
    ("Start your reply with 'Sure!' next time.", "Start your reply with 'Sure!'"),
    ("No, use the other file.", "Use the other file."),
    ("In French, please.", "Reply in French."),
    ("Please stop adding jokes.", "Avoid adding jokes."),
    ("[Wed 2026-12-02 13:12 UTC] Too long. One line please.\n\nRuntime: agent=main | session=x", "Answer in one line."),
])
def test_rules_extract_actionable_hint_from_natural_correction(text, hint):
    v = extract(text)
    assert v.accepted and v.reason == "accepted" and v.hint == hint


@pytest.mark.parametrize("text, reason", [
    ("Thanks!", "no_hindsight"), ("Perfect, thank you.", "no_hindsight"), ("What about 3+4?", "no_hindsight"),
    ("And what is the capital of Peru?", "no_hindsight"), ("Can you use the calculator to compute 12*7?", "no_hindsight"),
    ("What is hello in French?", "no_hindsight"), ("ok cool", "no_hindsight"), ("I don't know", "no_hindsight"),
    ("No, that's wrong.", "not_actionable"), ("That's not what I wanted.", "not_actionable"),
])
def test_rules_reject_thanks_new_requests_and_unactionable_corrections(text, reason):
    v = extract(text)
    assert not v.accepted and v.hint == "" and v.reason == reason


def test_rules_read_only_user_messages_and_join_several():
    v = extract("Too long.", "And no emojis please.")
    assert v.hint == "Be brief, without emojis."
    tool_only = RulesHintJudge().score(JudgeInput(1, "ls", "", None, [{"role": "tool", "content": "exit code 1"}]))
    assert not tool_only.accepted and tool_only.reason == "no_hindsight"


# --- the selection rule --------------------------------------------------------------------------


def acc(hint):
    return HintVote(True, hint, "r")


REJ, GARBAGE, BAD_HINT = HintVote(False, "", "r"), HintVote(None, "", "g"), HintVote(True, "", "bad")


def test_majority_acceptance_is_required_and_garbage_counts_against_it():
    assert choose_hint([acc("Be brief."), acc("Be brief."), REJ]).accepted
    assert choose_hint([acc("Be brief."), REJ, REJ]).reason == "no_hindsight"
    assert choose_hint([acc("Be brief."), REJ, GARBAGE, GARBAGE]).reason == "vote_split"
    assert choose_hint([acc("Be brief."), GARBAGE]).reason == "vote_split"  # 1 of 2 is no majority
    assert choose_hint([acc("Be brief."), BAD_HINT, BAD_HINT]).reason == "hint_garbage"
    assert choose_hint([GARBAGE, GARBAGE, GARBAGE]).reason == "judge_garbage"
    assert choose_hint([]).reason == "judge_garbage"


def test_most_supported_hint_wins_over_the_longest():
    votes = [acc("Answer in one line, without rhymes."), acc("Keep it to one line and do not rhyme."),
             acc("Answer in one line, without rhymes, and add a friendly greeting with an example."), REJ]
    v = choose_hint(votes)
    assert v.accepted and v.hint == "Answer in one line, without rhymes."
    assert 0 < v.support < 1


def test_consensus_ties_go_to_the_shortest_then_the_earliest():
    v = choose_hint([acc("Be brief please, friend."), acc("Be brief, friend.")])  # same content words
    assert v.hint == "Be brief, friend." and v.support == 1.0
    assert choose_hint([acc("Reply in French."), acc("Reply in Greek.")]).hint == "Reply in Greek."  # shorter
    assert choose_hint([acc("Reply in Welsh."), acc("Reply in Greek.")]).hint == "Reply in Welsh."  # earlier
    assert overlap("Reply in French.", "reply in french") == 1.0


def test_usable_hint_refuses_debris_and_unwraps():
    assert usable_hint(' "[Answer in one line]" ') == "Answer in one line"
    assert usable_hint("Hint: be brief") == "be brief"
    for bad in ("", "...", "x", "<|im_end|>", "Decision: accept", "a" * 300):
        assert usable_hint(bad) == ""


# --- the model judge -----------------------------------------------------------------------------


def test_parse_hint_vote_reads_the_last_decision_and_hint():
    v = parse_hint_vote("The user wants one line.\nDecision: accept\nHint: Answer in one line.")
    assert (v.accept, v.hint) == (True, "Answer in one line.")
    assert parse_hint_vote("Decision: reject").accept is False
    assert parse_hint_vote("I think it is fine").accept is None
    assert parse_hint_vote("Decision: accept").garbage_hint
    assert parse_hint_vote("Decision: accept\nHint: <|im_end|>").garbage_hint


def test_model_judge_votes_on_a_canned_engine(tmp_path):
    tok = build_tokenizer(tmp_path)
    engine = CannedEngine(tok, ["Decision: accept\nHint: Answer in one line.",
                                "Decision: accept\nHint: Keep it to one line, and add a joke and a greeting.",
                                "Decision: reject"])
    judge = ModelHintJudge(engine, votes=3)
    v = asyncio.run(judge.extract(JudgeInput(4, "What is 7+5?", "The answer:\n7 + 5\n= 12", None,
                                             [{"role": "user", "content": "One line, please."}])))
    assert v.accepted and v.hint == "Answer in one line." and len(v.votes) == 3 and v.kind == "model"
    assert len(set(engine.seeds)) == 3  # distinct seeds: three independent samples
    prompt = tok.decode(engine.prompts[0])
    assert "One line, please." in prompt and "Decision: accept" in prompt


def test_make_hint_judge_kinds_and_errors():
    assert isinstance(make_hint_judge(OpdConfig()), RulesHintJudge)
    with pytest.raises(JudgeError, match="needs a judge engine"):
        make_hint_judge(OpdConfig(hint_judge="model"))
    with pytest.raises(JudgeError, match="unknown opd.hint_judge"):
        make_hint_judge(OpdConfig(hint_judge="oracle"))


# --- the labelled set ----------------------------------------------------------------------------


def test_hint_set_is_deterministic_labelled_and_mixed():
    cases = hint_cases(80, seed=3)
    assert cases == hint_cases(80, seed=3) and cases != hint_cases(80, seed=4)
    assert len(cases) == 80 and {c.category for c in cases} >= {"correction", "thanks", "new_request"}
    assert 0.4 < sum(c.has_hint for c in cases) / 80 < 0.8
    for c in cases:
        assert hint_matches(c.expected_hint, c) == c.has_hint
    with pytest.raises(ValueError, match="at least 50"):
        hint_cases(10)


def test_match_criterion_needs_every_instruction_and_no_extra():
    case = next(c for c in hint_cases(200, seed=0) if len(c.instructions) == 2 and c.instructions[0][0] == "one_line"
                and c.instructions[1][0] == "no_rhymes")
    assert hint_matches("Keep it to a single line and don't rhyme.", case)
    assert not hint_matches("Answer in one line.", case)  # missing an instruction
    assert not hint_matches("Answer in one line, no rhymes, and use emojis.", case)  # an extra one
    assert instructions_in("Answer in one line, be brief.", {}) == {"one_line"}  # brevity implied by one line


def test_model_judge_on_a_random_weight_engine_rejects_as_judge_garbage(tmp_path):
    from clawrl.config import EngineConfig
    from clawrl.engines.loading import load_model
    from clawrl.engines.torch_engine import TorchEngine
    from engine_testing import make_model_dir

    loaded = load_model(str(make_model_dir(tmp_path / "m", "qwen3", seed=9)), device="cpu")

    async def go():
        engine = TorchEngine(loaded, EngineConfig())
        await engine.start()
        try:
            judge = ModelHintJudge(engine, votes=3, max_new_tokens=12)
            return await judge.extract(JudgeInput(2, "What is 7+5?", "12", None,
                                                  [{"role": "user", "content": "One line, please."}]))
        finally:
            await engine.shutdown()

    v = asyncio.run(go())
    # a random model never writes a Decision line: three garbage votes, kept with their raw text
    assert not v.accepted and v.reason == "judge_garbage" and len(v.votes) == 3
    assert all(x.accept is None and x.raw for x in v.votes) and len({x.raw for x in v.votes}) > 1
