"""Session linking on real OpenClaw traffic, branches, headers, turn types, next states, closing, CLI."""
import json
import logging
from pathlib import Path

import pytest

from clawrl.cli import main as clawrl_main
from clawrl.sessions import InvalidTurnType, SessionHints, SessionInputError, SessionLinker
from clawrl.store import TurnStore

FIXTURES = Path(__file__).parent / "fixtures" / "openclaw-2026.9.6"
# The replies the stub endpoint streamed to OpenClaw when the fixtures were captured.
CHAT_REPLY = {"response_text": "Hello from stub."}
TOOL_REPLY = {
    "response_text": "",
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}],
}


def fixture_body(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())["body"]


def serve(linker, messages, *, reply=None, caller="test-key", user=None, hints=SessionHints(), status="complete",
          tools=None, now=None):
    """Link one request and record a reply for it, as the gateway does. Returns (plan, turn_id)."""
    reply = reply or {"response_text": "ok"}
    plan = linker.begin(messages, tools, caller_key=caller, user=user, hints=hints, now=now)
    n = 3
    turn_id = linker.record(
        plan, prompt_ids=list(range(10)), response_ids=list(range(100, 100 + n)), logprobs=[-0.5] * n,
        weight_versions=[0] * n, finish_reason="stop", status=status, **reply,
    )
    return plan, turn_id


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture
def linker(tmp_path):
    store = TurnStore(tmp_path)
    yield SessionLinker(store, idle_timeout_s=60.0)
    store.close()


def turns_of(linker, session_id):
    return {t["turn_id"]: t for t in linker.store.get_session(session_id)["turns"]}


def test_openclaw_chat_pair_links_with_the_correction_as_next_state(linker):
    b1, b2 = fixture_body("chat_turn1.json"), fixture_body("chat_turn2.json")
    p1, t1 = serve(linker, b1["messages"], tools=b1["tools"], reply=CHAT_REPLY)
    p2, t2 = serve(linker, b2["messages"], tools=b2["tools"])
    assert (p2.session_id, p2.branch_id, p2.parent_turn_id, p2.turn_index) == (p1.session_id, 0, t1, 1)
    assert p2.link_rule == "prefix" and p2.next_state_for == t1
    turns = turns_of(linker, p1.session_id)
    next_state = turns[t1]["next_state"]
    # Only the correction: the internal-context trailer is set aside, the reply is not repeated.
    assert next_state == [{"role": "user", "content": "[Wed 2026-12-02 13:12 UTC] Too long. One line, and no rhymes please."}]
    assert turns[t1]["close_reason"] == "next_state" and turns[t1]["next_state_at"] is not None
    assert turns[t2]["next_state"] is None and turns[t2]["close_reason"] is None
    assert (turns[t1]["turn_type"], turns[t1]["type_rule"]) == ("main", "default_main")
    # OpenClaw's 40 KB system prompt and tool schemas hold nothing that redaction mistakes for a secret.
    assert turns[t1]["trainable"] is True and turns[t2]["trainable"] is True


def test_openclaw_tool_pair_links_with_the_tool_result_as_next_state(linker):
    b1, b2 = fixture_body("tool_turn1.json"), fixture_body("tool_turn2.json")
    # The history carries the call as call1 with compact arguments; we sent call_1 with spaces.
    assert b2["messages"][2]["tool_calls"][0]["id"] == "call1"
    assert b2["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"path":"."}'
    p1, t1 = serve(linker, b1["messages"], tools=b1["tools"], reply=TOOL_REPLY)
    p2, t2 = serve(linker, b2["messages"], tools=b2["tools"])
    assert (p2.session_id, p2.parent_turn_id, p2.turn_index) == (p1.session_id, t1, 1)
    turns = turns_of(linker, p1.session_id)
    [tool_result] = turns[t1]["next_state"]
    assert tool_result["role"] == "tool" and '"AGENTS.md"' in tool_result["content"]
    assert turns[t1]["tool_calls"][0]["function"]["arguments"] == '{"path": "."}'  # stored as sent
    assert (turns[t2]["turn_type"], turns[t2]["type_rule"]) == ("main", "default_main")  # a tool result is input


def test_interleaved_openclaw_sessions_stay_apart(linker):
    p_chat, _ = serve(linker, fixture_body("chat_turn1.json")["messages"], reply=CHAT_REPLY)
    p_tool, _ = serve(linker, fixture_body("tool_turn1.json")["messages"], reply=TOOL_REPLY)
    q_chat, _ = serve(linker, fixture_body("chat_turn2.json")["messages"])
    q_tool, _ = serve(linker, fixture_body("tool_turn2.json")["messages"])
    assert p_chat.session_id != p_tool.session_id
    assert (q_chat.session_id, q_tool.session_id) == (p_chat.session_id, p_tool.session_id)
    assert linker.store.status_counts() == {"sessions": 2, "turns": 4, "main_turns": 4, "turns_with_next_state": 2}


def test_a_reply_the_client_rewrote_differently_does_not_link(linker):
    b1, b2 = fixture_body("chat_turn1.json"), fixture_body("chat_turn2.json")
    serve(linker, b1["messages"], reply={"response_text": "Hello from a different stub."})
    p2, _ = serve(linker, b2["messages"])
    assert p2.link_rule == "new" and p2.parent_turn_id is None


def test_content_parts_and_strings_with_the_same_text_link(linker):
    p1, t1 = serve(linker, [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
                   reply={"response_text": "hello"})
    p2, _ = serve(linker, [user("hi there"), {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                           user("next")])
    assert (p2.session_id, p2.parent_turn_id) == (p1.session_id, t1)


def test_two_callers_opening_with_hi_stay_apart(linker):
    a, _ = serve(linker, [user("hi")], reply={"response_text": "hello"}, caller="key-a")
    b, _ = serve(linker, [user("hi")], reply={"response_text": "hello"}, caller="key-b")
    assert a.session_id != b.session_id and b.link_rule == "new"
    a2, _ = serve(linker, [user("hi"), assistant("hello"), user("more")], caller="key-b")
    assert a2.session_id == b.session_id


def test_same_caller_with_different_user_fields_stays_apart(linker):
    a, _ = serve(linker, [user("hi")], reply={"response_text": "hello"}, user="alice")
    b, _ = serve(linker, [user("hi")], reply={"response_text": "hello"}, user="bob")
    assert a.session_id != b.session_id and b.link_rule == "new"


def test_caller_key_is_stored_only_as_a_salted_hash(tmp_path, linker):
    serve(linker, [user("hi")], caller="sk-live-caller-key-123")
    assert b"sk-live-caller-key-123" not in b"".join(p.read_bytes() for p in tmp_path.iterdir())


def test_regenerate_and_edit_record_branches(linker):
    p0, t0 = serve(linker, [user("hi")], reply={"response_text": "A"})
    p1, t1 = serve(linker, [user("hi"), assistant("A"), user("tell me more")], reply={"response_text": "B"})
    regen, t_regen = serve(linker, [user("hi"), assistant("A"), user("tell me more")], reply={"response_text": "B2"})
    assert regen.session_id == p0.session_id and regen.link_rule == "resend"
    assert (regen.branch_id, regen.parent_turn_id, regen.turn_index) == (1, t0, 1)
    assert (regen.turn_type, regen.type_rule) == ("side", "no_new_input")
    edit, t_edit = serve(linker, [user("hi"), assistant("A"), user("no, shorter")])
    assert (edit.branch_id, edit.parent_turn_id, edit.turn_type) == (2, t0, "main")
    session = linker.store.get_session(p0.session_id)
    assert [(b["branch_id"], b["parent_turn_id"], b["sibling_turn_id"]) for b in session["branches"]] == [
        (0, None, None), (1, t0, t1), (2, t0, None)]
    # The first continuation stays turn t0's next state; a branch does not overwrite it.
    assert turns_of(linker, p0.session_id)[t0]["next_state"] == [user("tell me more")]
    # Each branch continues on its own: the regenerated reply links its follow-up to branch 1.
    follow, _ = serve(linker, [user("hi"), assistant("A"), user("tell me more"), assistant("B2"), user("thanks")])
    assert (follow.branch_id, follow.parent_turn_id) == (1, t_regen)


def test_retry_after_an_abort_stays_on_the_branch_and_the_abort_is_untrainable(linker):
    _, t0 = serve(linker, [user("hi")], reply={"response_text": "A"})
    msgs = [user("hi"), assistant("A"), user("go on")]
    aborted, t_abort = serve(linker, msgs, status="aborted", reply={"response_text": "par"})
    retry, t_retry = serve(linker, msgs, reply={"response_text": "partial no more"})
    assert (retry.branch_id, retry.parent_turn_id, retry.turn_index) == (0, t0, 1)
    assert retry.turn_type == "main"
    turns = turns_of(linker, aborted.session_id)
    assert (turns[t_abort]["status"], turns[t_abort]["trainable"], turns[t_abort]["untrainable_reason"]) == (
        "aborted", False, "aborted")
    assert turns[t_abort]["close_reason"] == "aborted"
    assert turns[t_retry]["trainable"] is True


def test_header_session_id_wins_over_inference_and_logs_it(linker, caplog):
    p0, t0 = serve(linker, [user("hi")], reply={"response_text": "A"})
    with caplog.at_level(logging.INFO, logger="clawrl.sessions"):
        p1, _ = serve(linker, [user("hi"), assistant("A"), user("more")], hints=SessionHints(session_id="mine"))
    assert p1.session_id == "mine" and p1.parent_turn_id is None
    assert any("X-Session-Id mine overrides the inferred session " + p0.session_id in r.message for r in caplog.records)
    assert turns_of(linker, p0.session_id)[t0]["next_state"] is None  # another session's request is not its next state


def test_header_session_without_a_matching_prefix_continues_its_latest_turn(linker):
    h = SessionHints(session_id="s1")
    p0, t0 = serve(linker, [user("first")], reply={"response_text": "A"}, hints=h)
    # The client compacted its history, so no prefix matches; the header still links it.
    p1, _ = serve(linker, [user("summary of earlier"), user("second")], hints=h)
    assert (p1.session_id, p1.parent_turn_id, p1.link_rule) == ("s1", t0, "header")
    assert turns_of(linker, "s1")[t0]["next_state"] == [user("summary of earlier"), user("second")]


def test_a_header_side_run_with_its_own_messages_leaves_the_main_turn_open(linker):
    h = SessionHints(session_id="s1")
    _, t0 = serve(linker, [user("first")], reply={"response_text": "A"}, hints=h)
    title, t_title = serve(linker, [user("Name this chat in three words")],
                           hints=SessionHints(session_id="s1", turn_type="side"))
    assert (title.parent_turn_id, title.next_state_for, title.branch_id) == (t0, None, 1)
    compacted, _ = serve(linker, [user("summary of earlier"), user("second")], hints=h)
    assert (compacted.parent_turn_id, compacted.next_state_for) == (t0, t0)  # the main turn, not the title run


def test_a_header_session_id_of_another_caller_is_not_merged(linker):
    a, _ = serve(linker, [user("hi")], caller="key-a", hints=SessionHints(session_id="1"))
    b, _ = serve(linker, [user("yo")], caller="key-b", hints=SessionHints(session_id="1"))
    assert a.session_id == "1" and b.session_id != "1" and b.session_id.startswith("1@")


def test_header_turn_type_wins_and_logs_the_disagreement(linker, caplog):
    with caplog.at_level(logging.INFO, logger="clawrl.sessions"):
        plan, _ = serve(linker, [user("hello there")], hints=SessionHints(turn_type="side"))
    assert (plan.turn_type, plan.type_rule) == ("side", "header")
    assert any("X-Turn-Type side overrides rule default_main (main)" in r.message for r in caplog.records)


def test_invalid_turn_type_header_raises_the_specific_error():
    with pytest.raises(InvalidTurnType) as e:
        SessionHints.from_request({"X-Turn-Type": "banana"}, {})
    assert "\n" not in str(e.value) and "banana" in str(e.value)
    assert isinstance(e.value, SessionInputError)


def test_hints_come_from_headers_or_the_body():
    h = SessionHints.from_request({"x-session-id": " abc ", "X-Turn-Type": "Main", "X-Session-Done": "1"}, {})
    assert (h.session_id, h.turn_type, h.done) == ("abc", "main", True)
    assert SessionHints.from_request({}, {"session_id": "from-body"}).session_id == "from-body"
    assert SessionHints.from_request({"X-Session-Id": "hdr"}, {"session_id": "body"}).session_id == "hdr"
    for bad in ({"X-Session-Done": "yes"}, {"X-Session-Id": ""}, {"X-Session-Id": "x" * 500}):
        with pytest.raises(SessionInputError):
            SessionHints.from_request(bad, {})
    with pytest.raises(SessionInputError):
        SessionHints.from_request({}, {"session_id": 5})


@pytest.mark.parametrize("bad", [[], "hi", [{"content": "no role"}], [{"role": "user", "content": 5}],
                                 [{"role": "assistant", "tool_calls": [{"function": {}}]}]])
def test_malformed_messages_raise_a_session_input_error(linker, bad):
    with pytest.raises(SessionInputError):
        linker.begin(bad)


@pytest.mark.parametrize("text,rule", [
    ("Read HEARTBEAT.md if it exists (workspace context). Follow it strictly. If nothing needs attention, reply HEARTBEAT_OK.", "heartbeat"),
    ("Pre-compaction memory flush. Store durable memories only in memory/2026-05-01.md.", "memory_flush"),
    ("[cron:abc123 morning-brief] Send the daily summary", "cron"),
    ("[Wed 2026-12-02 07:00 UTC] check mail\n\nRuntime: agent=main | session=agent:main:cron:abc | sessionId=x", "cron"),
    ("Generate a short title for this conversation.", "title_or_summary"),
    ("Summarize the chat so far in three bullet points.", "title_or_summary"),
])
def test_background_and_title_prompts_are_side_turns(linker, text, rule):
    plan, _ = serve(linker, [{"role": "system", "content": "You are helpful."}, user(text)])
    assert (plan.turn_type, plan.type_rule) == ("side", rule)


@pytest.mark.parametrize("text", ["Write a title for my blog post about tides", "What is a heartbeat?",
                                  "Summarize this file: notes.md"])
def test_ordinary_requests_that_mention_side_words_stay_main(linker, text):
    plan, _ = serve(linker, [user(text)])
    assert (plan.turn_type, plan.type_rule) == ("main", "default_main")


def test_a_side_run_on_the_history_does_not_become_the_next_state(linker):
    p0, t0 = serve(linker, [user("hi")], reply={"response_text": "A"})
    flush, _ = serve(linker, [user("hi"), assistant("A"), user("Pre-compaction memory flush. Store durable memories now.")])
    assert (flush.session_id, flush.parent_turn_id, flush.branch_id, flush.next_state_for) == (p0.session_id, t0, 1, None)
    assert flush.type_rule == "memory_flush"
    main, _ = serve(linker, [user("hi"), assistant("A"), user("and then?")])
    assert (main.branch_id, main.parent_turn_id, main.next_state_for) == (0, t0, t0)
    assert turns_of(linker, p0.session_id)[t0]["next_state"] == [user("and then?")]


def test_a_request_with_no_new_input_is_a_side_turn(linker):
    _, t0 = serve(linker, [user("hi")], reply={"response_text": "A"})
    plan, _ = serve(linker, [user("hi"), assistant("A")])  # "continue": nothing new after the reply
    assert (plan.parent_turn_id, plan.turn_type, plan.type_rule) == (t0, "side", "no_new_input")


def test_links_survive_a_restart(tmp_path):
    store = TurnStore(tmp_path)
    b1, b2 = fixture_body("tool_turn1.json"), fixture_body("tool_turn2.json")
    p1, t1 = serve(SessionLinker(store, 60.0), b1["messages"], reply=TOOL_REPLY)
    store.close()
    store = TurnStore(tmp_path)
    p2, _ = serve(SessionLinker(store, 60.0), b2["messages"])
    assert (p2.session_id, p2.parent_turn_id) == (p1.session_id, t1)
    assert store.get_session(p1.session_id)["turns"][0]["next_state"][0]["role"] == "tool"
    store.close()


def test_session_done_closes_the_last_turn_without_a_next_state(linker):
    p0, t0 = serve(linker, [user("hi")], reply={"response_text": "A"})
    p1, t1 = serve(linker, [user("hi"), assistant("A"), user("bye")], hints=SessionHints(done=True))
    turns = turns_of(linker, p0.session_id)
    assert turns[t0]["close_reason"] == "next_state"
    assert (turns[t1]["next_state"], turns[t1]["close_reason"]) == (None, "session_done")
    assert turns[t1]["next_state_at"] is not None
    # A request that still extends it continues the session, but the closed turn gets no next state.
    p2, _ = serve(linker, [user("hi"), assistant("A"), user("bye"), assistant("ok"), user("wait")])
    assert (p2.session_id, p2.parent_turn_id) == (p0.session_id, t1)
    assert turns_of(linker, p0.session_id)[t1]["next_state"] is None


def test_the_same_opening_after_a_session_ended_starts_a_new_main_session(linker):
    """A user who asks the first question of an ended session again is starting over, not
    regenerating: the new turn is main and trains (its twin was closed by the next state)."""
    p0, t0 = serve(linker, [user("What is 7+5?")], reply={"response_text": "12"})
    serve(linker, [user("What is 7+5?"), assistant("12"), user("thanks")], hints=SessionHints(done=True))
    p2, _ = serve(linker, [user("What is 7+5?")])
    assert p2.session_id != p0.session_id
    assert (p2.turn_type, p2.type_rule) == ("main", "default_main")


def test_idle_timeout_closes_only_idle_sessions(linker):
    idle, t_idle = serve(linker, [user("old")], now=1000.0)
    busy, t_busy = serve(linker, [user("new")], now=1050.0)
    assert linker.close_idle_sessions(now=1070.0) == 1  # timeout 60 s: only the first is idle
    assert turns_of(linker, idle.session_id)[t_idle]["close_reason"] == "idle_timeout"
    assert turns_of(linker, busy.session_id)[t_busy]["close_reason"] is None
    assert linker.close_idle_sessions(now=1070.0) == 0
    # The same opening after the session timed out starts a new session, not a regenerate.
    again, _ = serve(linker, [user("old")], now=2000.0)
    assert again.session_id != idle.session_id and again.link_rule == "new"


def test_sessions_cli_lists_sessions_and_shows_turns(tmp_path, capsys):
    store = TurnStore(tmp_path)
    linker = SessionLinker(store, 60.0)
    p1, _ = serve(linker, fixture_body("chat_turn1.json")["messages"], reply=CHAT_REPLY)
    serve(linker, fixture_body("chat_turn2.json")["messages"], reply={"response_text": "The sea is wide."})
    store.close()
    assert clawrl_main(["sessions", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["SESSION", "TURNS", "MAIN"] and out[1].split()[:4] == [p1.session_id, "2", "2", "1"]
    assert clawrl_main(["sessions", "--run-dir", str(tmp_path), p1.session_id]) == 0
    out = capsys.readouterr().out
    assert "Hello from stub." in out and "Too long. One line" in out and "The sea is wide." in out
    assert clawrl_main(["sessions", "--run-dir", str(tmp_path), "nope"]) == 2
    assert capsys.readouterr().err.strip() == f"clawrl: no session nope in {tmp_path}"


def test_export_cli_writes_one_turn_per_line_with_tokens(tmp_path, capsys):
    store = TurnStore(tmp_path)
    linker = SessionLinker(store, 60.0)
    serve(linker, fixture_body("tool_turn1.json")["messages"], reply=TOOL_REPLY)
    serve(linker, fixture_body("tool_turn2.json")["messages"])
    store.close()
    out_file = tmp_path / "turns.jsonl"
    assert clawrl_main(["export", "--run-dir", str(tmp_path), "--out", str(out_file)]) == 0
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(rows) == 2
    first = rows[0]
    assert first["prompt_ids"] == list(range(10)) and first["response_ids"] == [100, 101, 102]
    assert first["logprobs"] == [-0.5] * 3 and first["weight_versions"] == [0] * 3
    assert (first["turn_type"], first["type_rule"]) == ("main", "default_main")
    assert first["next_state"][0]["role"] == "tool"
    assert clawrl_main(["export", "--run-dir", str(tmp_path)]) == 0  # default: stdout
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_cli_refuses_a_missing_run_dir_or_store(tmp_path, capsys):
    for cmd in (["sessions"], ["export"]):
        assert clawrl_main(cmd + ["--run-dir", str(tmp_path / "absent")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not exist" in err
        assert clawrl_main(cmd + ["--run-dir", str(tmp_path)]) == 2
        assert "no turn store" in capsys.readouterr().err
    assert not (tmp_path / "clawrl.sqlite").exists()  # reading never creates a store
