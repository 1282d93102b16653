"""The durable turn store: every turn clawrl serves, with its exact tokens, in one SQLite file.

Why SQLite: a turn must be on disk before its last response byte is sent, from several threads,
and be readable by the CLI while the server runs. WAL mode lets readers run beside the writer;
``synchronous=FULL`` fsyncs every commit, so a turn acknowledged by :meth:`TurnStore.record_turn`
survives ``kill -9`` and power loss. The file is ``run_dir/clawrl.sqlite``.

Threads: each thread gets its own connection; writes are serialised by one lock per store (and by
SQLite's own lock across processes). Only one server process should write a run directory.

What a turn holds (table ``turns``): the request messages (normalised JSON, see
``clawrl.sessions``), tools, prompt/response token ids, per-token logprobs and weight versions
(packed little-endian arrays: int32 ids, float64 logprobs, int64 versions), response text, tool
calls and any tool-call parse error, finish reason, status (``complete`` | ``aborted`` |
``error``), type (``main`` | ``side``) and the rule that decided it, trainable flag and reason, next
state and close reason, session, branch, parent turn, turn index, caller hash, timestamps
(created, completed, next_state_at) and the link keys (``request_key``, ``reply_key``) that make up
the persisted session-link index.

Content-addressed blobs (table ``blobs``, schema version 3): a client re-sends the whole
conversation with every request, an OpenClaw one with a 40 KB system prompt and 10 KB of tools, and
turn k's prompt ids repeat turn k-1's. So each message, the tools list and each
``PROMPT_CHUNK_TOKENS``-token chunk of the prompt ids is stored once, keyed by its sha256, and a turn
keeps the list of blobs it is made of (``message_blobs``, ``tools_blob``, ``prompt_blobs``): a long
session grows by its new messages and tokens only. The blobs are written in the turn's own
transaction, so a turn never points to a missing blob. Every read API (:meth:`TurnStore.get_turn`,
:meth:`TurnStore.iter_turns`, and :func:`load_messages`, :func:`load_tools`, :func:`load_prompt` for
modules with their own queries) reassembles exactly what was recorded; turns written before
version 3 hold their messages, tools and prompt ids inline and are read as they are.

Secrets: every stored string passes through ``clawrl.redact``. A turn whose prompt or response held
a secret is stored with ``trainable=0, reason='secret_redacted'`` and *without* its token arrays
(only their lengths): the ids decode back to the secret, and redacting them is impossible without
re-tokenising, which would break token-in/token-out; an untrainable turn needs no tokens anyway.

Close reasons: ``next_state`` (the session's next request supplied it), ``session_done``
(``X-Session-Done: 1``), ``idle_timeout`` (no request for ``sessions.idle_timeout_s``), ``aborted``
or ``error`` (a turn whose reply the client never got can have no next state).

Untrainable reasons: ``aborted``, ``error``, ``secret_redacted``, ``empty_response``,
``excluded_by_admin``.

Admin functions (the gateway wraps them in HTTP): :meth:`TurnStore.status_counts`,
:meth:`TurnStore.list_sessions`, :meth:`TurnStore.get_session`, :meth:`TurnStore.relabel_turn`;
:meth:`TurnStore.iter_turns` feeds ``clawrl export``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sqlite3
import sys
import threading
import time
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from clawrl.redact import redact_json
from clawrl.schema import TURNS, TableSet

log = logging.getLogger(__name__)

STORE_FILENAME = "clawrl.sqlite"
# Prompt ids are stored in chunks of this many tokens. Turn k's prompt repeats turn k-1's, so every
# chunk before the first token that differs is shared; a turn re-stores at most the chunk where
# they part. Smaller chunks waste less there but make longer blob lists. Changing it is safe: a
# turn lists its own chunks.
PROMPT_CHUNK_TOKENS = 256
TURN_STATUSES = ("complete", "aborted", "error")
TURN_TYPES = ("main", "side")
RELABELS = ("main", "side", "excluded")


class StoreError(RuntimeError):
    """The store cannot be opened or used; the message is one line."""


class SchemaTooNew(ValueError):
    """The store was written by a newer clawrl; the message is one line."""


def _migrate(c: sqlite3.Connection, tables: TableSet, path: Path) -> None:
    """Apply the migrations ``tables`` lacks (its version: ``meta_key`` in ``meta``, or user_version)."""
    if tables.meta_key is None:
        version = c.execute("PRAGMA user_version").fetchone()[0]
    else:
        row = c.execute("SELECT value FROM meta WHERE key = ?", (tables.meta_key,)).fetchone()
        version = int(row[0]) if row else 0
    latest = len(tables.migrations)
    if version > latest:
        raise SchemaTooNew(f"{path} has {tables.what} schema version {version}; this clawrl knows {latest}")
    for i in range(version, latest):
        for stmt in tables.migrations[i].split(";"):
            if stmt.strip():
                c.execute(stmt)
        log.info("%s tables in %s migrated to schema version %d", tables.what, path, i + 1)
    if tables.meta_key is None:
        c.execute(f"PRAGMA user_version = {latest}")
    else:
        c.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                  (tables.meta_key, str(latest)))


class UnknownTurn(KeyError):
    """No turn has this id."""

    def __str__(self) -> str:
        return f"no turn with id {self.args[0]}"




# --- packed token arrays -------------------------------------------------------------------------


def pack(values: Sequence, typecode: str) -> bytes:
    """Little-endian packed array: 'i' int32 ids, 'q' int64 versions, 'd' float64 logprobs."""
    a = array(typecode, values)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack(blob: Optional[bytes], typecode: str) -> Optional[list]:
    if blob is None:
        return None
    a = array(typecode)
    a.frombytes(blob)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _loads(text: Optional[str]):
    return None if text is None else json.loads(text)


# --- content-addressed blobs ---------------------------------------------------------------------

_Blob = tuple[bytes, str, object]  # (digest, kind, body)


def _blob(kind: str, body: str | bytes) -> _Blob:
    raw = body.encode() if isinstance(body, str) else body
    return hashlib.sha256(kind.encode() + b"\0" + raw).digest(), kind, body


def _prompt_chunks(prompt_ids: Sequence[int]) -> list[_Blob]:
    packed, step = pack(prompt_ids, "i"), 4 * PROMPT_CHUNK_TOKENS
    return [_blob("ids", packed[i : i + step]) for i in range(0, len(packed), step)]


def _put_blobs(c: sqlite3.Connection, blobs: Sequence[_Blob]) -> list[int]:
    """Inside the caller's write transaction: the blob id of each of ``blobs``, inserting those the
    store lacks (one row per distinct content)."""
    ids: dict[bytes, int] = {}
    digests = list(dict.fromkeys(d for d, _, _ in blobs))
    for i in range(0, len(digests), 500):  # SQLite's bound-parameter limit
        chunk = digests[i : i + 500]
        ids.update(c.execute(f"SELECT digest, blob_id FROM blobs WHERE digest IN ({','.join('?' * len(chunk))})",
                             chunk))
    for digest, kind, body in blobs:
        if digest not in ids:
            ids[digest] = c.execute("INSERT INTO blobs (digest, kind, body) VALUES (?, ?, ?)",
                                    (digest, kind, body)).lastrowid
    return [ids[d] for d, _, _ in blobs]


def _blob_bodies(c: sqlite3.Connection, blob_ids: Sequence[int]) -> list:
    """The bodies of ``blob_ids``, in their order (an id may repeat)."""
    bodies: dict[int, object] = {}
    distinct = list(dict.fromkeys(blob_ids))
    for i in range(0, len(distinct), 500):
        chunk = distinct[i : i + 500]
        bodies.update(c.execute(f"SELECT blob_id, body FROM blobs WHERE blob_id IN ({','.join('?' * len(chunk))})",
                                chunk))
    missing = [b for b in distinct if b not in bodies]
    if missing:  # the turn and its blobs are written in one transaction: this is a damaged file
        raise StoreError(f"the turn store lacks blob(s) {', '.join(map(str, missing[:5]))} that a turn refers to")
    return [bodies[b] for b in blob_ids]


def load_messages(c: sqlite3.Connection, inline: str, message_blobs: Optional[str]) -> list:
    """A turn's request messages from its ``messages`` and ``message_blobs`` columns (either layout)."""
    if message_blobs is None:  # written before schema version 3
        return json.loads(inline)
    return [json.loads(body) for body in _blob_bodies(c, json.loads(message_blobs))]


def load_tools(c: sqlite3.Connection, inline: Optional[str], tools_blob: Optional[int]) -> Optional[list]:
    """A turn's tools from its ``tools`` and ``tools_blob`` columns (either layout); None: no tools."""
    if tools_blob is None:
        return _loads(inline)
    return json.loads(_blob_bodies(c, [tools_blob])[0])


def load_prompt(c: sqlite3.Connection, inline: Optional[bytes], prompt_blobs: Optional[str]) -> Optional[bytes]:
    """A turn's packed prompt ids (``unpack(.., 'i')`` them) from its ``prompt_ids`` and
    ``prompt_blobs`` columns (either layout); None: stored without tokens (a secret)."""
    if prompt_blobs is None:
        return inline
    return b"".join(_blob_bodies(c, json.loads(prompt_blobs)))


# --- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnRef:
    """What linking needs to know about a stored turn."""

    turn_id: int
    session_id: str
    branch_id: int
    parent_turn_id: Optional[int]
    turn_index: int
    status: str
    close_reason: Optional[str]
    next_state: Optional[list]


@dataclass
class TurnRecord:
    """One served turn, as handed to :meth:`TurnStore.record_turn` (unredacted; the store redacts)."""

    session_id: str
    branch_id: int
    parent_turn_id: Optional[int]
    turn_index: int
    caller_hash: str
    link_rule: str
    turn_type: str
    type_rule: str
    messages: list  # normalised request messages, trailer included (what the prompt was built from)
    history_len: int  # how many of them the client keeps in history (the rest is a set-aside trailer)
    tools: Optional[list]
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    logprobs: Sequence[float]
    weight_versions: Sequence[int]
    response_text: str
    tool_calls: Optional[list]
    tool_parse_error: Optional[str]
    finish_reason: Optional[str]
    status: str
    request_key: str
    reply_key: Optional[str]
    created_at: float
    completed_at: float = field(default_factory=time.time)
    temperature: float = 1.0  # the logprobs' temperature (1 for greedy turns)
    session_done: bool = False  # X-Session-Done: close this turn and the session's other open turns


_TURN_REF_COLUMNS = (
    "turn_id, session_id, branch_id, parent_turn_id, turn_index, status, close_reason, next_state"
)


def _turn_ref(row) -> TurnRef:
    return TurnRef(*row[:7], _loads(row[7]))


class TurnStore:
    """Opens (or creates) ``run_dir/clawrl.sqlite`` and migrates it to the current schema."""

    def __init__(self, run_dir: str | os.PathLike, create: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / STORE_FILENAME
        if not create and not self.path.is_file():
            raise StoreError(f"no turn store at {self.path}")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create run directory {self.run_dir}: {e.strerror}") from None
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._migrate()
        self.salt = self._meta_salt()

    # --- connections and transactions ----------------------------------------------------------

    def connection(self) -> sqlite3.Connection:
        """This thread's connection. Modules that keep their own tables in the store's file (the
        rollout buffer, the OPD teacher) read through it and write through ``transaction``."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                conn.execute("PRAGMA foreign_keys=ON")
            except sqlite3.Error as e:
                raise StoreError(f"cannot open turn store {self.path}: {e}") from None
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    @contextmanager
    def transaction(self):
        """One durable write transaction (BEGIN IMMEDIATE .. COMMIT, fsynced by synchronous=FULL)."""
        conn = self.connection()
        with self._write_lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def register(self, tables: TableSet) -> None:
        """Bring a set of tables another module keeps in this file (``clawrl.schema``: the rollout
        buffer's, OPD's) to its latest version, in one transaction."""
        with self.transaction() as c:
            _migrate(c, tables, self.path)

    def close(self) -> None:
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()

    def _migrate(self) -> None:
        try:
            self.register(TURNS)
        except SchemaTooNew as e:
            raise StoreError(str(e)) from None

    def _meta_salt(self) -> str:
        """A random per-store salt for caller and link hashes, so they cannot be looked up elsewhere."""
        with self.transaction() as c:
            row = c.execute("SELECT value FROM meta WHERE key = 'salt'").fetchone()
            if row:
                return row[0]
            salt = secrets.token_hex(16)
            c.execute("INSERT INTO meta (key, value) VALUES ('salt', ?)", (salt,))
            return salt

    # --- linking (used by clawrl.sessions.SessionLinker) ---------------------------------------

    def turns_by_request_key(self, key: str) -> list[TurnRef]:
        rows = self.connection().execute(
            f"SELECT {_TURN_REF_COLUMNS} FROM turns WHERE request_key = ? ORDER BY turn_id DESC", (key,)
        )
        return [_turn_ref(r) for r in rows]

    def turns_by_reply_keys(self, keys: Sequence[str]) -> dict[str, list[TurnRef]]:
        """Complete turns whose history plus reply hashes to one of ``keys``; newest first per key."""
        out: dict[str, list[TurnRef]] = {}
        keys = list(keys)
        for i in range(0, len(keys), 500):  # SQLite's bound-parameter limit
            chunk = keys[i : i + 500]
            rows = self.connection().execute(
                f"SELECT reply_key, {_TURN_REF_COLUMNS} FROM turns WHERE reply_key IN "
                f"({','.join('?' * len(chunk))}) ORDER BY turn_id DESC",
                chunk,
            )
            for r in rows:
                out.setdefault(r[0], []).append(_turn_ref(r[1:]))
        return out

    def latest_turn(self, session_id: str) -> Optional[TurnRef]:
        """The session's newest turn, preferring complete main turns over side runs and aborts."""
        row = self.connection().execute(
            f"SELECT {_TURN_REF_COLUMNS} FROM turns WHERE session_id = ? "
            "ORDER BY turn_type = 'main' DESC, status = 'complete' DESC, turn_id DESC LIMIT 1",
            (session_id,),
        ).fetchone()
        return _turn_ref(row) if row else None

    def session_caller(self, session_id: str) -> Optional[str]:
        row = self.connection().execute("SELECT caller_hash FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return row[0] if row else None

    def apply_link(
        self,
        *,
        session_id: str,
        caller_hash: str,
        user: Optional[str],
        source: str,
        now: float,
        branch_id: Optional[int],
        fork: tuple[Optional[int], Optional[int]] = (None, None),
        next_state: Optional[tuple[int, list]] = None,
    ) -> int:
        """Write what one request's arrival decides, in one transaction, and return its branch id.

        Creates the session or marks it seen; with ``branch_id=None`` opens a new branch whose
        (parent turn, sibling turn) is ``fork``; with ``next_state=(turn_id, messages)`` stores that
        open turn's next state (redacted) and closes it with reason ``next_state``.
        """
        with self.transaction() as c:
            c.execute(
                "INSERT INTO sessions (session_id, caller_hash, user, source, created_at, last_seen_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET last_seen_at = excluded.last_seen_at",
                (session_id, caller_hash, user, source, now, now),
            )
            if branch_id is None:
                branch_id = c.execute(
                    "SELECT COALESCE(MAX(branch_id) + 1, 0) FROM branches WHERE session_id = ?", (session_id,)
                ).fetchone()[0]
                c.execute(
                    "INSERT INTO branches (session_id, branch_id, parent_turn_id, sibling_turn_id, created_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (session_id, branch_id, fork[0], fork[1], now),
                )
            if next_state is not None:
                turn_id, messages = next_state
                redacted, _ = redact_json(messages)
                c.execute(
                    "UPDATE turns SET next_state = ?, close_reason = 'next_state', next_state_at = ? "
                    "WHERE turn_id = ? AND close_reason IS NULL",
                    (_dumps(redacted), now, turn_id),
                )
        return branch_id

    # --- recording -----------------------------------------------------------------------------

    def record_turn(self, rec: TurnRecord) -> int:
        """Durably commit one turn (redacted) and return its id. Synchronous; call it off the event loop."""
        if rec.status not in TURN_STATUSES:
            raise ValueError(f"turn status must be one of {', '.join(TURN_STATUSES)}, not {rec.status!r}")
        if rec.turn_type not in TURN_TYPES:
            raise ValueError(f"turn type must be main or side, not {rec.turn_type!r}")
        n = len(rec.response_ids)
        if len(rec.logprobs) != n or len(rec.weight_versions) != n:
            raise ValueError(
                f"response has {n} ids but {len(rec.logprobs)} logprobs and {len(rec.weight_versions)} versions"
            )
        messages, k1 = redact_json(rec.messages)
        tools, k2 = redact_json(rec.tools)
        response_text, k3 = redact_json(rec.response_text)
        tool_calls, k4 = redact_json(rec.tool_calls)
        parse_error, k5 = redact_json(rec.tool_parse_error)
        secret = bool(k1 or k2 or k3 or k4 or k5)
        if rec.status != "complete":
            trainable, reason = 0, rec.status
        elif secret:
            trainable, reason = 0, "secret_redacted"
        elif n == 0:
            trainable, reason = 0, "empty_response"
        else:
            trainable, reason = 1, None
        if secret:
            log.warning("turn in session %s held a secret (%s); stored redacted, without tokens, untrainable",
                        rec.session_id, ", ".join(sorted(k1 | k2 | k3 | k4 | k5)))
            arrays = (None, None, None)
        else:
            arrays = (pack(rec.response_ids, "i"), pack(rec.logprobs, "d"), pack(rec.weight_versions, "q"))
        # Digests are computed here, outside the write lock; the transaction only looks them up.
        message_blobs = [_blob("message", _dumps(m)) for m in messages]
        tools_blob = None if tools is None else _blob("tools", _dumps(tools))
        prompt_chunks = None if secret else _prompt_chunks(rec.prompt_ids)
        # A reply the client never received cannot be continued, so it gets no next state.
        close_reason = None if rec.status == "complete" else rec.status
        if close_reason is None and rec.session_done:
            close_reason = "session_done"
        closed_at = rec.completed_at if close_reason else None
        with self.transaction() as c:
            message_ids = _put_blobs(c, message_blobs)
            tools_id = None if tools_blob is None else _put_blobs(c, [tools_blob])[0]
            chunk_ids = None if prompt_chunks is None else _put_blobs(c, prompt_chunks)
            cur = c.execute(
                "INSERT INTO turns (session_id, branch_id, parent_turn_id, turn_index, caller_hash, link_rule, "
                "turn_type, type_rule, status, trainable, untrainable_reason, messages, message_blobs, "
                "history_len, tools_blob, prompt_blobs, response_ids, logprobs, weight_versions, prompt_tokens, "
                "response_tokens, response_text, tool_calls, tool_parse_error, finish_reason, close_reason, "
                "created_at, completed_at, next_state_at, request_key, reply_key, temperature) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    rec.session_id, rec.branch_id, rec.parent_turn_id, rec.turn_index, rec.caller_hash,
                    rec.link_rule, rec.turn_type, rec.type_rule, rec.status, trainable, reason,
                    "", _dumps(message_ids), rec.history_len, tools_id,
                    None if chunk_ids is None else _dumps(chunk_ids), *arrays,
                    len(rec.prompt_ids), n, response_text,
                    None if tool_calls is None else _dumps(tool_calls), parse_error, rec.finish_reason,
                    close_reason, rec.created_at, rec.completed_at, closed_at, rec.request_key,
                    rec.reply_key if rec.status == "complete" else None, rec.temperature,
                ),
            )
            turn_id = cur.lastrowid
            if rec.session_done:
                c.execute(
                    "UPDATE turns SET close_reason = 'session_done', next_state_at = ? "
                    "WHERE session_id = ? AND close_reason IS NULL",
                    (rec.completed_at, rec.session_id),
                )
        return turn_id

    def ended_sessions(self, session_ids: Sequence[str]) -> set[str]:
        """Those of ``session_ids`` that ended: a turn of theirs was closed by ``X-Session-Done`` or
        by the idle timeout."""
        ids = list(set(session_ids))
        if not ids:
            return set()
        rows = self.connection().execute(
            f"SELECT DISTINCT session_id FROM turns WHERE session_id IN ({','.join('?' * len(ids))}) "
            "AND close_reason IN ('session_done', 'idle_timeout')", ids)
        return {r[0] for r in rows}

    def close_idle_sessions(self, now: float, idle_timeout_s: float) -> int:
        """Close the open turns of sessions with no request for ``idle_timeout_s``; returns how many."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE turns SET close_reason = 'idle_timeout', next_state_at = ? WHERE close_reason IS NULL "
                "AND session_id IN (SELECT session_id FROM sessions WHERE last_seen_at < ?)",
                (now, now - idle_timeout_s),
            )
            n = cur.rowcount
        if n:
            log.info("closed %d turn(s) of sessions idle for over %.0f s; they get no next state", n, idle_timeout_s)
        return n

    # --- admin ---------------------------------------------------------------------------------

    def status_counts(self) -> dict:
        c = self.connection()
        sessions = c.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        turns, main, with_next = c.execute(
            "SELECT COUNT(*), COALESCE(SUM(turn_type = 'main'), 0), COALESCE(SUM(next_state IS NOT NULL), 0) FROM turns"
        ).fetchone()
        return {"sessions": sessions, "turns": turns, "main_turns": main, "turns_with_next_state": with_next}

    def list_sessions(self, limit: Optional[int] = None, offset: int = 0) -> list[dict]:
        """Sessions, most recently active first, with turn counts; ``limit=None``: all of them."""
        rows = self.connection().execute(
            "SELECT s.session_id, s.user, s.source, s.created_at, s.last_seen_at, "
            "COUNT(t.turn_id), COALESCE(SUM(t.turn_type = 'main'), 0), COALESCE(SUM(t.next_state IS NOT NULL), 0), "
            "COALESCE(SUM(t.turn_id IS NOT NULL AND t.close_reason IS NULL), 0), "
            "(SELECT COUNT(*) FROM branches b WHERE b.session_id = s.session_id) "
            "FROM sessions s LEFT JOIN turns t ON t.session_id = s.session_id "
            "GROUP BY s.session_id ORDER BY s.last_seen_at DESC LIMIT ? OFFSET ?",
            (-1 if limit is None else limit, offset),
        )
        keys = ("session_id", "user", "source", "created_at", "last_seen_at", "turns", "main_turns",
                "turns_with_next_state", "open_turns", "branches")
        return [dict(zip(keys, r)) for r in rows]

    _SUMMARY_COLUMNS = (
        "turn_id", "session_id", "branch_id", "parent_turn_id", "turn_index", "link_rule", "turn_type",
        "type_rule", "status", "trainable", "untrainable_reason", "prompt_tokens", "response_tokens",
        "response_text", "tool_calls", "tool_parse_error", "finish_reason", "next_state", "close_reason",
        "created_at", "completed_at", "next_state_at",
    )
    _JSON_COLUMNS = ("tool_calls", "next_state")

    def _turn_dicts(self, columns: Sequence[str], where: str, params: tuple) -> Iterator[dict]:
        rows = self.connection().execute(f"SELECT {', '.join(columns)} FROM turns {where} ORDER BY turn_id", params)
        for r in rows:
            d = dict(zip(columns, r))
            for k in self._JSON_COLUMNS:
                if k in d:
                    d[k] = _loads(d[k])
            if "trainable" in d:
                d["trainable"] = bool(d["trainable"])
            yield d

    def get_session(self, session_id: str) -> Optional[dict]:
        """One session with its branches and its turns (type, rule, next state, response text...)."""
        c = self.connection()
        row = c.execute(
            "SELECT session_id, user, source, created_at, last_seen_at FROM sessions WHERE session_id = ?",
            (session_id,),
        ).fetchone()
        if row is None:
            return None
        out = dict(zip(("session_id", "user", "source", "created_at", "last_seen_at"), row))
        out["branches"] = [
            dict(zip(("branch_id", "parent_turn_id", "sibling_turn_id", "created_at"), b))
            for b in c.execute(
                "SELECT branch_id, parent_turn_id, sibling_turn_id, created_at FROM branches "
                "WHERE session_id = ? ORDER BY branch_id",
                (session_id,),
            )
        ]
        out["turns"] = list(self._turn_dicts(self._SUMMARY_COLUMNS, "WHERE session_id = ?", (session_id,)))
        return out

    def get_turn(self, turn_id: int) -> dict:
        """Everything stored about one turn, token arrays unpacked."""
        turns = list(self._full_turns("WHERE turn_id = ?", (turn_id,)))
        if not turns:
            raise UnknownTurn(turn_id)
        return turns[0]

    def iter_turns(self) -> Iterator[dict]:
        """Every turn in id order, with token arrays unpacked (what ``clawrl export`` writes)."""
        return self._full_turns("", ())

    def _full_turns(self, where: str, params: tuple) -> Iterator[dict]:
        columns = self._SUMMARY_COLUMNS + (
            "caller_hash", "messages", "message_blobs", "history_len", "tools", "tools_blob", "prompt_ids",
            "prompt_blobs", "response_ids", "logprobs", "weight_versions", "temperature",
        )
        c = self.connection()
        for d in self._turn_dicts(columns, where, params):
            d["messages"] = load_messages(c, d["messages"], d.pop("message_blobs"))
            d["tools"] = load_tools(c, d["tools"], d.pop("tools_blob"))
            d["prompt_ids"] = unpack(load_prompt(c, d["prompt_ids"], d.pop("prompt_blobs")), "i")
            d["response_ids"] = unpack(d["response_ids"], "i")
            d["logprobs"] = unpack(d["logprobs"], "d")
            d["weight_versions"] = unpack(d["weight_versions"], "q")
            yield d

    def relabel_turn(self, turn_id: int, label: str, actor: str, now: Optional[float] = None) -> dict:
        """Set a turn to ``main``, ``side`` or ``excluded`` (from training) and record the correction.

        ``main``/``side`` set the type with rule ``admin`` and lift an earlier admin exclusion;
        reasons the admin cannot undo (aborted, secret_redacted, ...) stay. Returns the correction.
        """
        if label not in RELABELS:
            raise ValueError(f"label must be one of {', '.join(RELABELS)}, not {label!r}")
        if not actor:
            raise ValueError("a relabel needs an actor")
        now = time.time() if now is None else now
        with self.transaction() as c:
            row = c.execute(
                "SELECT turn_type, trainable, untrainable_reason FROM turns WHERE turn_id = ?", (turn_id,)
            ).fetchone()
            if row is None:
                raise UnknownTurn(turn_id)
            turn_type, trainable, reason = row
            old = "excluded" if reason == "excluded_by_admin" else turn_type
            if label == "excluded":
                if trainable or reason == "excluded_by_admin":
                    c.execute(
                        "UPDATE turns SET trainable = 0, untrainable_reason = 'excluded_by_admin' WHERE turn_id = ?",
                        (turn_id,),
                    )
            else:
                c.execute("UPDATE turns SET turn_type = ?, type_rule = 'admin' WHERE turn_id = ?", (label, turn_id))
                if reason == "excluded_by_admin":
                    c.execute(
                        "UPDATE turns SET trainable = 1, untrainable_reason = NULL WHERE turn_id = ?", (turn_id,)
                    )
            c.execute(
                "INSERT INTO corrections (turn_id, old_label, new_label, actor, at) VALUES (?, ?, ?, ?, ?)",
                (turn_id, old, label, actor, now),
            )
        log.info("turn %d relabelled %s -> %s by %s", turn_id, old, label, actor)
        return {"turn_id": turn_id, "old_label": old, "new_label": label, "actor": actor, "at": now}

    def corrections(self, turn_id: Optional[int] = None) -> list[dict]:
        where, params = ("WHERE turn_id = ?", (turn_id,)) if turn_id is not None else ("", ())
        rows = self.connection().execute(
            f"SELECT correction_id, turn_id, old_label, new_label, actor, at FROM corrections {where} "
            "ORDER BY correction_id",
            params,
        )
        return [dict(zip(("correction_id", "turn_id", "old_label", "new_label", "actor", "at"), r)) for r in rows]
