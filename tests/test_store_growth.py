"""The turn store's content-addressed layout (schema version 3, issue 20): a long OpenClaw session
grows by its new messages only, every reader gets back exactly what was recorded, a version-2 store
opens and reads back identically, redaction applies to what is stored, and a turn is never
committed without its blobs."""
import importlib.util
import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clawrl.buffer import RolloutBuffer
from clawrl.config import TrainConfig
from clawrl.methods.opd.teacher import OpdStore
from clawrl.schema import TURNS
from clawrl.sessions import SessionLinker
from clawrl.store import PROMPT_CHUNK_TOKENS, StoreError, TurnRecord, TurnStore, pack
from test_buffer import judge_all

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "openclaw-2026.9.6"
_spec = importlib.util.spec_from_file_location("store_growth", ROOT / "benchmarks" / "store_growth.py")
store_growth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(store_growth)

SECRET = "sk-ant-api03-abcdefghijklmnopqrstuvwxyz0123456789"
TOOL_SECRET = "ghp_" + "A1b2" * 9


def fixture_body(name):
    return json.loads((FIXTURES / name).read_text())["body"]


def turn_record(session="s", **over) -> TurnRecord:
    fields = dict(
        session_id=session, branch_id=0, parent_turn_id=None, turn_index=0, caller_hash="c", link_rule="new",
        turn_type="main", type_rule="default_main", messages=[{"role": "user", "content": "hi"}], history_len=1,
        tools=None, prompt_ids=[1, 2, 3], response_ids=[7, 8], logprobs=[-0.1, -0.2], weight_versions=[0, 0],
        response_text="yo", tool_calls=None, tool_parse_error=None, finish_reason="stop", status="complete",
        request_key="rk", reply_key="pk", created_at=1.0,
    )
    fields.update(over)
    return TurnRecord(**fields)


def record(store, session="s", **over) -> int:
    known = store.get_session(session) is not None
    store.apply_link(session_id=session, caller_hash="c", user=None, source="inferred", now=time.time(),
                     branch_id=0 if known else None)
    return store.record_turn(turn_record(session, **over))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer  # only the growth tests render real prompts

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


# --- growth ----------------------------------------------------------------------------------------


def test_a_long_openclaw_session_grows_by_its_new_messages_only(tmp_path, tokenizer):
    session = list(store_growth.openclaw_session(40, tokenizer))
    sizes = store_growth.record_session(tmp_path / "blobs", session)
    inline = store_growth.copy_to_inline_layout(tmp_path / "blobs", tmp_path / "inline")
    # What each turn adds to the conversation: the request's messages beyond the last request's,
    # plus the reply. The 40 KB system prompt and 10 KB of tools are not among them.
    new_bytes = [len(json.dumps(t["messages"][-3:])) for t in session[1:]]
    assert max(new_bytes) < 1500
    early, late = sizes[19] - sizes[1], sizes[39] - sizes[21]
    # Turns 20-39 carry about 10 KB more history per request than turns 2-19, yet grow the store alike.
    assert abs(late - early) / 18 < 1024, (early, late)
    assert store_growth.per_turn(sizes) < 8 * 1024
    # The inline layout of version 2 stores the whole request and prompt again: over 100 KB a turn.
    assert store_growth.per_turn(inline) > 100 * 1024
    assert store_growth.per_turn(inline) / store_growth.per_turn(sizes) > 15


def test_growth_does_not_depend_on_the_size_of_the_repeated_prefix(tmp_path, tokenizer):
    """A 40 KB system prompt and one of 40 bytes make stores that grow by the same bytes per turn."""
    session = list(store_growth.openclaw_session(24, tokenizer))
    small = []
    for t in session:
        messages = [{"role": "system", "content": "You are a personal assistant."}] + t["messages"][1:]
        text = tokenizer.apply_chat_template(messages, tools=t["tools"], add_generation_prompt=True, tokenize=False)
        small.append({**t, "messages": messages, "prompt_ids": tokenizer.encode(text, add_special_tokens=False)})
    big_sizes = store_growth.record_session(tmp_path / "big", session)
    small_sizes = store_growth.record_session(tmp_path / "small", small)
    assert big_sizes[0] - small_sizes[0] > 40_000  # the first turn stores the prompt once
    assert abs(store_growth.per_turn(big_sizes) - store_growth.per_turn(small_sizes)) < 1024


def test_the_benchmark_reports_both_layouts_from_one_run(tiny_model_dir):
    r = store_growth.measure(6, tiny_model_dir)
    assert r["migrated_store_reads_identical"] is True
    assert r["inline"]["per_turn"] > 10 * r["blobs"]["per_turn"] and r["ratio"] > 10
    assert r["blobs"]["blob_kinds"]["tools"] == (1, len(json.dumps(fixture_body("tool_turn1.json")["tools"],
                                                                 separators=(",", ":"))))
    assert r["command"] == "python benchmarks/store_growth.py --turns 6"


def test_sessions_share_the_system_prompt_and_tools_blobs(tmp_path):
    store = TurnStore(tmp_path)
    body = fixture_body("chat_turn1.json")
    for s in ("a", "b", "c"):
        record(store, s, messages=body["messages"], tools=body["tools"], prompt_ids=list(range(2000)))
    c = store.connection()
    system = json.dumps(body["messages"][0], ensure_ascii=False, separators=(",", ":"))
    assert c.execute("SELECT COUNT(*) FROM blobs WHERE kind = 'message' AND body = ?", (system,)).fetchone()[0] == 1
    assert c.execute("SELECT COUNT(*) FROM blobs WHERE kind = 'tools'").fetchone()[0] == 1
    chunks = -(-2000 // PROMPT_CHUNK_TOKENS)
    assert c.execute("SELECT COUNT(*) FROM blobs WHERE kind = 'ids'").fetchone()[0] == chunks
    # A new turn stores its inline columns empty: nothing is kept twice.
    assert c.execute("SELECT DISTINCT messages, tools, prompt_ids FROM turns").fetchall() == [("", None, None)]
    store.close()


# --- exact round trip --------------------------------------------------------------------------------


ODD_MESSAGES = [
    {"role": "system", "content": "ünïcödé ✓ \u2028 \"quotes\" \\ back\\slash \x00 nul"},
    {"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\", \"n\": 1.5e-7}"}}]},
    {"role": "tool", "content": "same", "tool_call_id": "c1"},
    {"role": "tool", "content": "same", "tool_call_id": "c1"},  # a message repeated in one request
    {"role": "user", "content": "", "extra": {"nested": [1, 2.0, None, True, {"k": []}]}},
]


@pytest.mark.parametrize("n_prompt", [0, 1, PROMPT_CHUNK_TOKENS - 1, PROMPT_CHUNK_TOKENS, PROMPT_CHUNK_TOKENS + 1,
                                      3 * PROMPT_CHUNK_TOKENS + 7])
def test_messages_tools_and_prompt_ids_round_trip_exactly_through_every_reader(tmp_path, n_prompt):
    store = TurnStore(tmp_path)
    prompt = [(i * 7919) % 2**31 for i in range(n_prompt)][:-1] + [2**31 - 1] if n_prompt else []
    tools = fixture_body("tool_turn1.json")["tools"]
    t0 = record(store, messages=ODD_MESSAGES, history_len=5, tools=tools, prompt_ids=prompt)
    t1 = record(store, messages=ODD_MESSAGES[:2], tools=[], prompt_ids=prompt[:5], turn_index=1)
    t2 = record(store, messages=[], tools=None, prompt_ids=prompt, turn_index=2)
    got = {t["turn_id"]: t for t in store.iter_turns()}
    assert got[t0]["messages"] == ODD_MESSAGES and got[t0]["tools"] == tools and got[t0]["prompt_ids"] == prompt
    assert got[t1]["messages"] == ODD_MESSAGES[:2] and got[t1]["tools"] == [] and got[t1]["prompt_ids"] == prompt[:5]
    assert got[t2]["messages"] == [] and got[t2]["tools"] is None and got[t2]["prompt_ids"] == prompt
    assert got[t0]["prompt_tokens"] == n_prompt and store.get_turn(t0) == got[t0]
    # The OPD teacher's reader and the trainer's payload reader give the same.
    opd = OpdStore(store).turn(t0)
    assert (opd["messages"], opd["tools"], opd["prompt_ids"], opd["history_len"]) == (ODD_MESSAGES, tools, prompt, 5)
    assert OpdStore(store).turn(t1)["tools"] == []
    store.close()


def test_the_buffer_and_judges_read_the_reassembled_turns(tmp_path):
    store = TurnStore(tmp_path)
    linker = SessionLinker(store, 60.0)
    b1, b2 = fixture_body("chat_turn1.json"), fixture_body("chat_turn2.json")
    prompt = list(range(900))
    plan = linker.begin(b1["messages"], b1["tools"], caller_key="k")
    t1 = linker.record(plan, prompt_ids=prompt, response_ids=[5, 6], logprobs=[-1.0, -2.0], weight_versions=[3, 3],
                       response_text="Hello from stub.")
    plan = linker.begin(b2["messages"], b2["tools"], caller_key="k")
    linker.record(plan, prompt_ids=prompt + [1, 2], response_ids=[5], logprobs=[-1.0], weight_versions=[3],
                  response_text="ok")
    buffer = RolloutBuffer(store, TrainConfig())
    assert buffer.sync() == 1
    [(_, turn)] = buffer.pending_turns(8)
    assert turn["turn_id"] == t1 and turn["messages"] == store.get_turn(t1)["messages"]
    assert turn["messages"][0] == b1["messages"][0]  # the 40 KB system prompt, whole
    [judge_input] = OpdStore(store).unjudged(8)
    assert judge_input.turn_id == t1 and "Too long" in judge_input.next_state[0]["content"]
    assert judge_all(buffer) == 1  # the rules judge reads the reassembled turn: a complaint, -1
    [sample] = buffer.take_batch(8, current_version=3)
    assert (sample.turn_id, sample.reward) == (t1, -1.0)
    assert sample.prompt_ids == prompt and sample.response_ids == [5, 6] and sample.rollout_logprobs == [-1.0, -2.0]
    store.close()


# --- migration ---------------------------------------------------------------------------------------


def version_2_store(run_dir: Path) -> sqlite3.Connection:
    """An empty store as clawrl wrote it before content-addressed blobs (turn schema version 2),
    with one session."""
    c = store_growth.version_2_store(run_dir)
    c.execute("INSERT INTO sessions (session_id, caller_hash, source, created_at, last_seen_at) "
              "VALUES ('old', 'c', 'inferred', 0, 0)")
    c.execute("INSERT INTO branches (session_id, branch_id, created_at) VALUES ('old', 0, 0)")
    return c


def insert_version_2_turn(c, messages, tools, prompt_ids, close_reason="next_state", next_state="[]") -> int:
    """A turn row exactly as version 2's record_turn wrote it: messages, tools and prompt ids inline."""
    dumps = lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":"))  # noqa: E731
    return c.execute(
        "INSERT INTO turns (session_id, branch_id, turn_index, caller_hash, link_rule, turn_type, type_rule, status, "
        "trainable, messages, history_len, tools, prompt_ids, response_ids, logprobs, weight_versions, prompt_tokens, "
        "response_tokens, response_text, close_reason, next_state, created_at, completed_at, request_key) "
        "VALUES ('old', 0, 0, 'c', 'new', 'main', 'default_main', 'complete', 1, ?, ?, ?, ?, ?, ?, ?, ?, 2, 'r', ?, ?, "
        "0, 0, 'rk')",
        (dumps(messages), len(messages), None if tools is None else dumps(tools),
         None if prompt_ids is None else pack(prompt_ids, "i"), pack([7, 8], "i"), pack([-0.5, -0.25], "d"),
         pack([1, 1], "q"), 0 if prompt_ids is None else len(prompt_ids), close_reason, next_state),
    ).lastrowid


def test_a_version_2_store_opens_and_reads_back_identical_turns(tmp_path):
    body = fixture_body("tool_turn2.json")
    prompt = list(range(1000, 1700))
    c = version_2_store(tmp_path)
    old_full = insert_version_2_turn(c, body["messages"], body["tools"], prompt,
                                     next_state='[{"role":"user","content":"thanks"}]')
    old_bare = insert_version_2_turn(c, [], None, None)
    c.close()
    store = TurnStore(tmp_path)  # migrates to version 3
    assert store.connection().execute("PRAGMA user_version").fetchone()[0] == len(TURNS.migrations) == 3
    full = store.get_turn(old_full)
    assert full["messages"] == body["messages"] and full["tools"] == body["tools"] and full["prompt_ids"] == prompt
    assert (full["response_ids"], full["logprobs"], full["weight_versions"]) == ([7, 8], [-0.5, -0.25], [1, 1])
    bare = store.get_turn(old_bare)
    assert (bare["messages"], bare["tools"], bare["prompt_ids"]) == ([], None, None)
    opd = OpdStore(store).turn(old_full)
    assert (opd["messages"], opd["tools"], opd["prompt_ids"]) == (body["messages"], body["tools"], prompt)
    # New turns go into blobs beside the old rows; the same prompt in either layout is one GRPO group.
    new = record(store, "old", messages=body["messages"], tools=body["tools"], prompt_ids=prompt, turn_index=1,
                 request_key="rk")
    assert store.get_turn(new)["messages"] == body["messages"] and store.get_turn(new)["prompt_ids"] == prompt
    assert [t["turn_id"] for t in store.iter_turns()] == [old_full, old_bare, new]
    store.close_idle_sessions(now=1e12, idle_timeout_s=1)
    buffer = RolloutBuffer(store, TrainConfig())
    buffer.sync()
    groups = dict(store.connection().execute("SELECT turn_id, group_id FROM samples").fetchall())
    assert groups[old_full] == groups[new] != groups[old_bare]
    store.close()
    assert TurnStore(tmp_path).get_turn(old_full) == full  # and again after a reopen (no second migration)


# --- redaction ---------------------------------------------------------------------------------------


def test_secrets_are_redacted_in_the_blobs_and_never_reach_the_file(tmp_path):
    body = fixture_body("tool_turn2.json")
    tools = json.loads(json.dumps(body["tools"]))
    tools[0]["function"]["description"] += f" Authenticate with {TOOL_SECRET}."
    leaky = json.loads(json.dumps(body["messages"]))
    leaky[1]["content"] += f"\nmy key is {SECRET}"
    leaky[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": ".", "token": SECRET})
    store = TurnStore(tmp_path)
    clean = record(store, messages=body["messages"], tools=body["tools"], prompt_ids=list(range(600)))
    leaked = record(store, messages=leaky, tools=tools, prompt_ids=list(range(600)), turn_index=1)
    turn = store.get_turn(leaked)
    assert (turn["trainable"], turn["untrainable_reason"], turn["prompt_ids"]) == (False, "secret_redacted", None)
    assert turn["messages"][1]["content"].endswith("my key is [REDACTED:anthropic_key]")
    assert "[REDACTED:anthropic_key]" in turn["messages"][2]["tool_calls"][0]["function"]["arguments"]
    assert turn["tools"][0]["function"]["description"].endswith("Authenticate with [REDACTED:github_token].")
    # The messages without a secret are still the clean turn's blobs.
    c = store.connection()
    refs = {t: json.loads(c.execute("SELECT message_blobs FROM turns WHERE turn_id = ?", (t,)).fetchone()[0])
            for t in (clean, leaked)}
    assert refs[clean][0] == refs[leaked][0] and refs[clean][3] == refs[leaked][3] and refs[clean][1] != refs[leaked][1]
    assert c.execute("SELECT prompt_blobs FROM turns WHERE turn_id = ?", (leaked,)).fetchone()[0] is None
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert SECRET.encode() not in raw and TOOL_SECRET.encode() not in raw


# --- durability --------------------------------------------------------------------------------------


def test_a_turn_that_fails_to_insert_leaves_no_blobs_behind(tmp_path):
    store = TurnStore(tmp_path)
    record(store, messages=[{"role": "user", "content": "kept"}], prompt_ids=list(range(300)))
    before = store.connection().execute("SELECT COUNT(*) FROM blobs").fetchone()[0]
    with pytest.raises(sqlite3.IntegrityError):  # created_at NOT NULL fails after the blobs were written
        record(store, messages=[{"role": "user", "content": "lost"}], prompt_ids=list(range(5000, 5300)),
               created_at=None)
    assert store.connection().execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == before
    store.close()


def test_a_missing_blob_is_reported_not_read_as_empty(tmp_path):
    store = TurnStore(tmp_path)
    t = record(store, messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with store.transaction() as c:
        blob = json.loads(c.execute("SELECT message_blobs FROM turns WHERE turn_id = ?", (t,)).fetchone()[0])[1]
        c.execute("DELETE FROM blobs WHERE blob_id = ?", (blob,))
    with pytest.raises(StoreError, match=f"lacks blob\\(s\\) {blob} "):
        store.get_turn(t)
    store.close()


_WRITER = textwrap.dedent("""
    import json, sys
    from clawrl.sessions import SessionLinker
    from clawrl.store import TurnStore
    body = json.loads(open(sys.argv[2]).read())["body"]
    linker = SessionLinker(TurnStore(sys.argv[1]), 600.0)
    history = list(body["messages"][:1])
    for i in range(100000):
        history.append({"role": "user", "content": f"message {i}"})
        plan = linker.begin(history, body["tools"])
        linker.record(plan, prompt_ids=list(range(8000 + 20 * i)), response_ids=[i], logprobs=[-1.0],
                      weight_versions=[0], response_text=f"reply {i}")
        print(i, flush=True)
        history.append({"role": "assistant", "content": f"reply {i}"})
""")


def test_every_turn_committed_before_kill_9_reads_back_whole(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(FIXTURES / "chat_turn1.json")],
                            stdout=subprocess.PIPE, text=True)
    acked = -1
    try:
        while acked < 15:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            acked = int(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    store = TurnStore(tmp_path)
    turns = list(store.iter_turns())  # every committed turn, acknowledged or not, with all its blobs
    assert len(turns) >= acked + 1
    system = fixture_body("chat_turn1.json")["messages"][0]
    for i, t in enumerate(turns):
        assert t["messages"][0] == system and t["messages"][-1] == {"role": "user", "content": f"message {i}"}
        assert t["prompt_ids"] == list(range(8000 + 20 * i))
    store.close()
