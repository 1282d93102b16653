"""``clawrl sessions`` and ``clawrl export``: read a run's turn store from the command line.

Both open the store read-only in spirit (they never create one): a missing run directory or store
is a one-line error, exit 2, so a typo in ``--run-dir`` cannot leave an empty store behind.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from clawrl.errors import CliError
from clawrl.store import STORE_FILENAME, StoreError, TurnStore


def _open(run_dir: str) -> TurnStore:
    if not Path(run_dir).is_dir():
        raise CliError(f"run directory {run_dir} does not exist")
    try:
        return TurnStore(run_dir, create=False)
    except StoreError as e:
        raise CliError(f"{e} (is {run_dir} a clawrl run directory? it should hold {STORE_FILENAME})") from None


def _when(t) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _table(rows: list[list], headers: list[str]) -> str:
    cells = [headers] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _one_line(text, width: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _next_state_text(next_state) -> str:
    if not next_state:
        return ""
    return " | ".join(f"{m['role']}: {m['content'] if isinstance(m['content'], str) else '[parts]'}" for m in next_state)


def sessions_cli(args) -> int:
    store = _open(args.run_dir)
    try:
        if args.session_id is None:
            rows = [
                [s["session_id"], s["turns"], s["main_turns"], s["turns_with_next_state"], s["branches"],
                 s["open_turns"], _when(s["last_seen_at"])]
                for s in store.list_sessions()
            ]
            print(_table(rows, ["SESSION", "TURNS", "MAIN", "NEXT_STATE", "BRANCHES", "OPEN", "LAST_SEEN"]))
            return 0
        session = store.get_session(args.session_id)
        if session is None:
            raise CliError(f"no session {args.session_id} in {args.run_dir}")
        rows = [
            [t["turn_id"], t["branch_id"], t["turn_index"], t["parent_turn_id"], t["turn_type"], t["type_rule"],
             t["status"], "yes" if t["trainable"] else f"no ({t['untrainable_reason']})",
             _one_line(t["response_text"] or (t["tool_calls"] and f"tool calls: {[c['function']['name'] for c in t['tool_calls']]}") or ""),
             _one_line(_next_state_text(t["next_state"]) or f"({t['close_reason'] or 'open'})")]
            for t in session["turns"]
        ]
        print(f"session {session['session_id']} ({session['source']}), {len(session['branches'])} branch(es)")
        print(_table(rows, ["TURN", "BRANCH", "INDEX", "PARENT", "TYPE", "RULE", "STATUS", "TRAINABLE", "RESPONSE",
                            "NEXT_STATE"]))
        return 0
    finally:
        store.close()


def export_cli(args) -> int:
    store = _open(args.run_dir)
    out = sys.stdout if args.out in (None, "-") else None
    try:
        if out is None:
            try:
                out = open(args.out, "w", encoding="utf-8")
            except OSError as e:
                raise CliError(f"cannot write {args.out}: {e.strerror}") from None
        n = 0
        for turn in store.iter_turns():
            out.write(json.dumps(turn, ensure_ascii=False) + "\n")
            n += 1
        if out is not sys.stdout:
            out.close()
            print(f"wrote {n} turns to {args.out}", file=sys.stderr)
        return 0
    finally:
        store.close()
