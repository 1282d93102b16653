"""Bytes the turn store grows by per turn of a long OpenClaw session: the content-addressed layout
(schema version 3) against the inline layout of version 2, measured in the same run (issue 20).

The session is made from the real OpenClaw requests in ``tests/fixtures/openclaw-2026.9.6``: their
40 KB system prompt, 12 tools, user-message format with its runtime line, the internal-context
trailer that ends every request and is left out of the next one's history, and the tool call
and tool result as OpenClaw writes them back into the history (ids rewritten, arguments compacted).
Each task the user asks is two turns: the model calls ``ls``, then answers from the result. Every
request goes through ``SessionLinker`` as the gateway's would, with prompt ids from the model's chat
template and tokenizer (the embedded default model unless ``--model``).

The inline layout is measured by copying every recorded row into a store created with the
version-2 schema, with messages, tools and prompt ids written inline exactly as version 2 wrote
them; then that store is opened with this clawrl (migrated to version 3) and must read back every
turn unchanged. Sizes are of the database file after a WAL checkpoint, after each turn.

    python benchmarks/store_growth.py [--turns 60] [--model DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from transformers import AutoTokenizer

from clawrl.embedded.build import default_model_path
from clawrl.schema import TURNS
from clawrl.sessions import SessionLinker
from clawrl.store import STORE_FILENAME, TurnStore, load_messages, load_prompt, load_tools

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "openclaw-2026.9.6"


def _body(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())["body"]


def openclaw_session(turns: int, tokenizer) -> Iterator[dict]:
    """The requests and replies of one OpenClaw session of ``turns`` turns, built from the fixtures."""
    first, second = _body("tool_turn1.json"), _body("tool_turn2.json")
    system, user, trailer = first["messages"]
    tools = first["tools"]
    call, result = second["messages"][2], second["messages"][3]
    question = "What files are in the workspace?"
    assert question in json.dumps(user), "the fixture's user message changed"
    history = [system]
    for k in range(turns):
        task = k // 2
        if k % 2 == 0:
            asked = copy.deepcopy(user)
            asked["content"] = asked["content"].replace(question, f"What files are in the folder notes/{task}?")
            history.append(asked)
        messages = history + [trailer]
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        if k % 2 == 0:  # the model calls ls
            args = {"path": f"notes/{task}"}
            reply_text, tool_calls = "", [{"id": f"call_{task}", "type": "function",
                                           "function": {"name": "ls", "arguments": json.dumps(args)}}]
            sampled = f'<tool_call>\n{{"name": "ls", "arguments": {json.dumps(args)}}}\n</tool_call>'
        else:  # and answers from the result
            reply_text, tool_calls = f"notes/{task} holds AGENTS.md, SOUL.md, USER.md and day-{task}.md.", None
            sampled = reply_text
        response_ids = tokenizer.encode(sampled, add_special_tokens=False)
        yield {"messages": messages, "tools": tools, "prompt_ids": prompt_ids, "response_ids": response_ids,
               "response_text": reply_text, "tool_calls": tool_calls}
        if k % 2 == 0:  # OpenClaw's history rewrites the call id and compacts the arguments
            said = copy.deepcopy(call)
            said["tool_calls"][0]["id"] = f"call{task}"
            said["tool_calls"][0]["function"]["arguments"] = json.dumps(args, separators=(",", ":"))
            got = copy.deepcopy(result)
            got["tool_call_id"] = f"call{task}"
            got["content"] += f'\n"day-{task}.md"'
            history += [said, got]
        else:
            history.append({"role": "assistant", "content": reply_text})


def file_size(conn: sqlite3.Connection, path: Path) -> int:
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(path)


def record_session(run_dir: Path, session: list[dict]) -> list[int]:
    """Serve the session's turns through the linker into a new store; the file size after each."""
    store = TurnStore(run_dir)
    linker = SessionLinker(store, idle_timeout_s=3600.0)
    sizes = []
    for turn in session:
        plan = linker.begin(turn["messages"], turn["tools"], caller_key="bench-key")
        n = len(turn["response_ids"])
        linker.record(plan, prompt_ids=turn["prompt_ids"], response_ids=turn["response_ids"], logprobs=[-0.5] * n,
                      weight_versions=[0] * n, response_text=turn["response_text"], tool_calls=turn["tool_calls"],
                      finish_reason="tool_calls" if turn["tool_calls"] else "stop")
        sizes.append(file_size(store.connection(), store.path))
    assert len(store.list_sessions()) == 1, "the session's turns did not link into one session"
    store.close()
    return sizes


def version_2_store(run_dir: Path) -> sqlite3.Connection:
    """An empty store as clawrl wrote it before content-addressed blobs (turn schema version 2),
    with the store's own settings (WAL, synchronous=FULL)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    c = sqlite3.connect(run_dir / STORE_FILENAME, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=FULL")
    for block in TURNS.migrations[:2]:
        for stmt in block.split(";"):
            if stmt.strip():
                c.execute(stmt)
    c.execute("PRAGMA user_version = 2")
    return c


def copy_to_inline_layout(src: Path, dst: Path) -> list[int]:
    """Write every turn of the store in ``src`` into a version-2 store in ``dst``, with messages, tools
    and prompt ids inline as version 2 wrote them; the file size after each turn."""
    dst.mkdir(parents=True)
    old = version_2_store(dst)
    new = sqlite3.connect(src / STORE_FILENAME)
    for table in ("meta", "sessions", "branches"):
        rows = new.execute(f"SELECT * FROM {table}").fetchall()
        old.executemany(f"INSERT INTO {table} VALUES ({','.join('?' * len(rows[0]))})", rows)
    cur = new.execute("SELECT * FROM turns ORDER BY turn_id")
    columns = [d[0] for d in cur.description]
    v2_columns = [c for c in columns if c not in ("message_blobs", "tools_blob", "prompt_blobs")]
    sizes = []
    for row in cur.fetchall():
        t = dict(zip(columns, row))
        t["messages"] = json.dumps(load_messages(new, t["messages"], t["message_blobs"]), ensure_ascii=False,
                                   separators=(",", ":"))
        tools = load_tools(new, t["tools"], t["tools_blob"])
        t["tools"] = None if tools is None else json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
        t["prompt_ids"] = load_prompt(new, t["prompt_ids"], t["prompt_blobs"])
        old.execute(f"INSERT INTO turns ({', '.join(v2_columns)}) VALUES ({','.join('?' * len(v2_columns))})",
                    [t[c] for c in v2_columns])
        sizes.append(file_size(old, dst / STORE_FILENAME))
    new.close()
    old.close()
    return sizes


def per_turn(sizes: list[int]) -> float:
    """Bytes per turn after the first (which holds the schema and the session's shared prefix)."""
    return (sizes[-1] - sizes[0]) / (len(sizes) - 1)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(turns: int, model: Path) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    session = list(openclaw_session(turns, tokenizer))
    with tempfile.TemporaryDirectory() as tmp:
        blobbed, inline = Path(tmp) / "blobs", Path(tmp) / "inline"
        new_sizes = record_session(blobbed, session)
        old_sizes = copy_to_inline_layout(blobbed, inline)
        a, b = TurnStore(blobbed, create=False), TurnStore(inline, create=False)  # b is migrated to version 3
        identical = all(x == y for x, y in zip(a.iter_turns(), b.iter_turns(), strict=True))
        c = a.connection()
        kinds = {k: (n, size) for k, n, size in
                 c.execute("SELECT kind, COUNT(*), SUM(LENGTH(body)) FROM blobs GROUP BY kind")}
        prompt_bytes = b.connection().execute("SELECT AVG(LENGTH(prompt_ids)) FROM turns").fetchone()[0]
        a.close()
        b.close()
    request_bytes = [len(json.dumps(t["messages"], separators=(",", ":"))) + len(json.dumps(t["tools"])) for t in session]
    return {
        "turns": turns, "model": str(model), "commit": commit(),
        "command": f"python benchmarks/store_growth.py --turns {turns}",
        "prompt_tokens": [len(session[0]["prompt_ids"]), len(session[-1]["prompt_ids"])],
        "request_json_bytes": [request_bytes[0], request_bytes[-1]],
        "inline": {"first_turn": old_sizes[0], "per_turn": per_turn(old_sizes), "total": old_sizes[-1],
                   "prompt_ids_per_turn": prompt_bytes},
        "blobs": {"first_turn": new_sizes[0], "per_turn": per_turn(new_sizes), "total": new_sizes[-1],
                  "blob_kinds": kinds},
        "ratio": per_turn(old_sizes) / per_turn(new_sizes),
        "migrated_store_reads_identical": identical,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=60, help="turns in the session (at least 2)")
    ap.add_argument("--model", type=Path, default=None, help="model directory whose tokenizer renders the prompts")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.turns < 2:
        ap.error("--turns must be at least 2")
    r = measure(args.turns, args.model or default_model_path())
    print(f"OpenClaw session of {r['turns']} turns, prompt {r['prompt_tokens'][0]} -> {r['prompt_tokens'][1]} tokens, "
          f"request JSON {r['request_json_bytes'][0]} -> {r['request_json_bytes'][1]} bytes")
    print(f"{'layout':<34}{'first turn':>12}{'per later turn':>16}{'total':>12}")
    for name, key in (("inline (schema v2)", "inline"), ("content-addressed blobs (v3)", "blobs")):
        s = r[key]
        print(f"{name:<34}{s['first_turn']:>12,}{s['per_turn']:>16,.0f}{s['total']:>12,}")
    print(f"per-turn growth, inline / blobs: {r['ratio']:.1f}x")
    print(f"of which prompt_ids inline: {r['inline']['prompt_ids_per_turn']:,.0f} bytes per turn")
    print("blobs by kind (count, bytes): " + ", ".join(f"{k} {n} {b:,}" for k, (n, b) in r["blobs"]["blob_kinds"].items()))
    print(f"the v2 store, migrated, reads back every turn identically: {r['migrated_store_reads_identical']}")
    print(f"commit {r['commit']}; {r['command']}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0 if r["migrated_store_reads_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
