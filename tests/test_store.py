"""The durable turn store: crash safety, exact token arrays, concurrency, relabelling."""
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from clawrl.sessions import SessionLinker
from clawrl.store import StoreError, TurnRecord, TurnStore, UnknownTurn


def record(store, session="s", **over):
    fields = dict(
        session_id=session, branch_id=0, parent_turn_id=None, turn_index=0, caller_hash="c", link_rule="new",
        turn_type="main", type_rule="default_main", messages=[{"role": "user", "content": "hi"}], history_len=1,
        tools=None, prompt_ids=[1, 2, 3], response_ids=[7, 8], logprobs=[-0.1, -0.2], weight_versions=[0, 0],
        response_text="yo", tool_calls=None, tool_parse_error=None, finish_reason="stop", status="complete",
        request_key="rk", reply_key="pk", created_at=time.time(),
    )
    fields.update(over)
    known = store.get_session(session) is not None
    store.apply_link(session_id=session, caller_hash="c", user=None, source="inferred", now=time.time(),
                     branch_id=0 if known else None)
    return store.record_turn(TurnRecord(**fields))


_WRITER = textwrap.dedent("""
    import sys
    from clawrl.sessions import SessionLinker
    from clawrl.store import TurnStore
    linker = SessionLinker(TurnStore(sys.argv[1]), 60.0)
    history = []
    for i in range(100000):
        history.append({"role": "user", "content": f"message {i}"})
        plan = linker.begin(history)
        turn_id = linker.record(plan, prompt_ids=list(range(i, i + 50)), response_ids=[i, i + 1],
                                logprobs=[-i / 7.0, -1.0], weight_versions=[i, i], response_text=f"reply {i}")
        print(turn_id, i, flush=True)  # acknowledged: record() has returned
        history.append({"role": "assistant", "content": f"reply {i}"})
""")


def test_turn_survives_kill_9(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        while len(acked) < 25:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            acked.append(tuple(map(int, line.split())))
    finally:
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate()
    acked += [tuple(map(int, line.split())) for line in rest.splitlines() if line.strip()]
    assert proc.returncode == -signal.SIGKILL
    store = TurnStore(tmp_path)
    for turn_id, i in acked:
        turn = store.get_turn(turn_id)
        assert turn["prompt_ids"] == list(range(i, i + 50)) and turn["response_ids"] == [i, i + 1]
        assert turn["logprobs"] == [-i / 7.0, -1.0] and turn["response_text"] == f"reply {i}"
    # Every turn before the last acknowledged one has its next state: the link index survived too.
    sessions = store.list_sessions()
    assert len(sessions) == 1 and sessions[0]["turns"] >= len(acked)
    turns = {t["turn_id"]: t for t in store.get_session(sessions[0]["session_id"])["turns"]}
    for turn_id, i in acked[:-1]:
        assert turns[turn_id]["next_state"] == [{"role": "user", "content": f"message {i + 1}"}]
    store.close()


def test_token_arrays_round_trip_exactly(tmp_path):
    store = TurnStore(tmp_path)
    logprobs = [-1e-12, -0.1 + 1e-17, -123.456789012345678, 0.0]
    turn_id = record(store, prompt_ids=[0, 2**31 - 1, 151643], response_ids=[5, 6, 7, 8], logprobs=logprobs,
                     weight_versions=[0, 1, 2**40, 2**40])
    turn = store.get_turn(turn_id)
    assert turn["prompt_ids"] == [0, 2**31 - 1, 151643] and turn["response_ids"] == [5, 6, 7, 8]
    assert turn["logprobs"] == logprobs and turn["weight_versions"] == [0, 1, 2**40, 2**40]
    assert (turn["prompt_tokens"], turn["response_tokens"]) == (3, 4)
    store.close()


def test_store_is_wal_with_full_sync_under_run_dir(tmp_path):
    store = TurnStore(tmp_path / "run")
    assert store.path == tmp_path / "run" / "clawrl.sqlite"
    conn = store.connection()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.close()


def test_mismatched_token_arrays_are_refused(tmp_path):
    store = TurnStore(tmp_path)
    with pytest.raises(ValueError, match="2 ids but 1 logprobs"):
        record(store, logprobs=[-0.1])
    with pytest.raises(ValueError, match="status"):
        record(store, status="done")
    assert store.status_counts()["turns"] == 0
    store.close()


def test_turns_recorded_from_many_threads_are_all_stored(tmp_path):
    store = TurnStore(tmp_path)
    linker = SessionLinker(store, 60.0)
    ids, errors = [], []

    def worker(w):
        try:
            for i in range(10):
                plan = linker.begin([{"role": "user", "content": f"worker {w} message {i}"}])
                ids.append(linker.record(plan, prompt_ids=[w, i], response_ids=[1], logprobs=[-1.0],
                                         weight_versions=[0], response_text="ok"))
        except Exception as e:  # surfaced below; a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(ids)) == 60 and store.status_counts()["turns"] == 60
    assert sorted(tuple(store.get_turn(i)["prompt_ids"]) for i in ids) == [(w, i) for w in range(6) for i in range(10)]
    store.close()


def test_cli_can_read_while_the_server_holds_the_store(tmp_path):
    writer = TurnStore(tmp_path)
    record(writer)
    reader = TurnStore(tmp_path, create=False)
    record(writer, session="s2")
    assert reader.status_counts()["sessions"] == 2
    reader.close()
    writer.close()


def test_relabel_records_each_correction(tmp_path):
    store = TurnStore(tmp_path)
    turn_id = record(store)
    store.relabel_turn(turn_id, "side", actor="admin-a", now=10.0)
    store.relabel_turn(turn_id, "excluded", actor="admin-b", now=11.0)
    turn = store.get_turn(turn_id)
    assert (turn["turn_type"], turn["type_rule"], turn["trainable"], turn["untrainable_reason"]) == (
        "side", "admin", False, "excluded_by_admin")
    store.relabel_turn(turn_id, "main", actor="admin-a", now=12.0)
    turn = store.get_turn(turn_id)
    assert (turn["turn_type"], turn["trainable"], turn["untrainable_reason"]) == ("main", True, None)
    assert [(c["old_label"], c["new_label"], c["actor"], c["at"]) for c in store.corrections(turn_id)] == [
        ("main", "side", "admin-a", 10.0), ("side", "excluded", "admin-b", 11.0), ("excluded", "main", "admin-a", 12.0)]
    assert store.status_counts()["main_turns"] == 1
    store.close()


def test_relabel_cannot_make_an_aborted_turn_trainable(tmp_path):
    store = TurnStore(tmp_path)
    turn_id = record(store, status="aborted", reply_key=None)
    store.relabel_turn(turn_id, "excluded", actor="a")
    store.relabel_turn(turn_id, "main", actor="a")
    turn = store.get_turn(turn_id)
    assert (turn["trainable"], turn["untrainable_reason"]) == (False, "aborted")
    store.close()


def test_relabel_refuses_unknown_turns_and_labels(tmp_path):
    store = TurnStore(tmp_path)
    turn_id = record(store)
    with pytest.raises(UnknownTurn, match="no turn with id 999"):
        store.relabel_turn(999, "main", actor="a")
    with pytest.raises(ValueError, match="label must be one of"):
        store.relabel_turn(turn_id, "great", actor="a")
    assert store.corrections() == []
    store.close()


def test_empty_response_is_stored_untrainable(tmp_path):
    store = TurnStore(tmp_path)
    turn = store.get_turn(record(store, response_ids=[], logprobs=[], weight_versions=[], response_text=""))
    assert (turn["status"], turn["trainable"], turn["untrainable_reason"]) == ("complete", False, "empty_response")
    store.close()


def test_unusable_run_dirs_give_one_line_store_errors(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(StoreError, match="cannot create run directory"):
        TurnStore(tmp_path / "a_file")
    (tmp_path / "clawrl.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError, match="file is not a database"):
        TurnStore(tmp_path)
    with pytest.raises(StoreError, match="no turn store"):
        TurnStore(tmp_path / "empty", create=False)


def test_a_newer_schema_is_refused(tmp_path):
    TurnStore(tmp_path).close()
    with sqlite3.connect(tmp_path / "clawrl.sqlite") as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match="schema version 99"):
        TurnStore(tmp_path)


def test_record_turn_is_cheap_enough_for_the_request_path(tmp_path):
    store = TurnStore(tmp_path)
    linker = SessionLinker(store, 60.0)
    system = {"role": "system", "content": "x" * 40_000}  # OpenClaw's system prompt is about 40 KB
    history = [system]
    t0 = time.perf_counter()
    for i in range(20):
        history.append({"role": "user", "content": f"message {i}"})
        plan = linker.begin(history)
        linker.record(plan, prompt_ids=list(range(16_000)), response_ids=list(range(64)), logprobs=[-0.5] * 64,
                      weight_versions=[0] * 64, response_text=f"reply {i}")
        history.append({"role": "assistant", "content": f"reply {i}"})
    per_turn = (time.perf_counter() - t0) / 20
    assert per_turn < 0.25, f"begin + record took {per_turn * 1000:.0f} ms per turn"
    store.close()


def test_every_table_is_declared_by_the_schema_module_alone():
    """One owner of the schema: no other core module creates or alters a table."""
    core = Path(__file__).resolve().parents[1] / "core" / "clawrl"
    owners = sorted(p.name for p in core.rglob("*.py") if re.search(r"\b(CREATE|ALTER) TABLE\b", p.read_text()))
    assert owners == ["schema.py"]


def test_a_table_set_newer_than_this_clawrl_is_refused(tmp_path):
    from clawrl.schema import BUFFER, TableSet

    store = TurnStore(tmp_path)
    store.register(BUFFER)
    older = TableSet(BUFFER.what, BUFFER.meta_key, BUFFER.migrations[:1])
    latest = len(BUFFER.migrations)
    with pytest.raises(ValueError, match=f"has rollout buffer schema version {latest}; this clawrl knows 1"):
        store.register(older)
    store.close()
