"""Session linking, turn types and next states: which conversation a request continues.

clawrl learns from what happens *after* a reply (the user's correction, the tool's result), so each
turn t must be paired with the request that follows it. Stock OpenClaw (2026.9.6, see
``tests/fixtures/openclaw-2026.9.6/README.md``) sends no session headers; it re-sends the whole
history each time. We therefore link requests by conversation prefix.

Use (the gateway does this for every chat request)::

    linker = SessionLinker(TurnStore(run_dir), idle_timeout_s=cfg.sessions.idle_timeout_s)
    hints = SessionHints.from_request(request.headers, body)      # raises SessionInputError -> 400
    plan = linker.begin(body["messages"], body.get("tools"), caller_key=api_key, user=body.get("user"),
                        hints=hints)                              # links; stores the previous turn's next state
    ... generate ...
    turn_id = linker.record(plan, prompt_ids=..., response_ids=..., logprobs=..., weight_versions=...,
                            response_text=..., tool_calls=..., tool_parse_error=..., finish_reason=...,
                            status="complete")                   # durable before the last byte is sent
    linker.close_idle_sessions()                                  # call periodically
    linker.store.status_counts() / list_sessions() / get_session(id) / relabel_turn(id, label, actor)

``begin`` and ``record`` are synchronous (SQLite commits); call them via ``asyncio.to_thread``.
``response_text`` and ``tool_calls`` must be what the client received: the assistant content after
tool-call extraction, and tool calls in OpenAI form (``{"id", "type", "function": {"name",
"arguments"}}``), because the client's next request carries exactly that as history.

**Headers.** ``X-Session-Id`` (or body ``session_id``) names the session; ``X-Turn-Type`` is ``main``
or ``side`` (anything else raises :class:`InvalidTurnType`); ``X-Session-Done: 1`` marks the last
request of a session. A header always wins over inference; where they disagree, a log line says so.
A header session id already used by another caller gets that caller's hash appended, so two users
choosing the same id are never merged.

**Normalisation** (what counts as "the same history"):
- trailing messages the client does not keep in history are set aside before linking: OpenClaw's
  internal-context user message (``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>``), which it sends at the
  end of every request and drops from the next one;
- tool-call ids are dropped (OpenClaw rewrites ``call_1`` to ``call1``), tool messages lose their
  ``tool_call_id``;
- tool arguments are compared as parsed JSON (OpenClaw re-serialises them without spaces);
- content as a list of text parts equals the string of their concatenated text; ``None`` equals "".

**Link keys.** A chained hash over the normalised messages, seeded with a per-store salt, the
caller's API-key hash and the body ``user`` field (two callers who both open with "hi" never
merge). Turn t stores ``request_key`` (its history) and, when complete, ``reply_key`` (its history
plus its reply as the client will echo it). Both live in the store, so links survive restarts.

**Link rules** (``link_rule`` of a turn), tried in order:
- ``resend``: the same history was sent before. If that turn completed, this is a regenerate: a new
  branch beside it (same parent); if it was aborted or failed, this is a retry on the same branch.
  A history whose session has ended (done, idle) is not resent: it opens a new session.
- ``prefix``: the longest history prefix that ends in a stored reply; that turn p is the parent.
  If p is open, everything after its reply (tool results, the next user message) becomes p's next
  state. If p already has a next state, p's prefix is being extended a second time (an edit, or a
  regenerate racing its twin): a new branch from p. A side turn (below) also opens a branch from p
  and leaves p open: a heartbeat or title request is not the reaction to p's reply. If p was closed
  (done, idle), the session continues but p keeps no next state.
- ``header``: a header session id with no matching prefix (the client compacted its history, or a
  side run sends its own messages) continues that session's latest complete main turn; its next
  state is the messages after the request's last assistant message.
- ``new``: a new session.

**Turn types** (``type_rule`` of a turn; the first that applies wins). "New input" is what the
request adds after the parent's reply (without a parent: after the last assistant message).
- ``header``: ``X-Turn-Type`` given.
- ``heartbeat`` (side): new user text is a heartbeat poll ("Read HEARTBEAT.md ...", ``HEARTBEAT_OK``).
- ``memory_flush`` (side): "Pre-compaction memory flush" / "Store durable memories ...".
- ``cron`` (side): a scheduled run (``[cron:...]`` prefix, or an OpenClaw runtime line with a
  ``cron``/``heartbeat`` session key).
- ``title_or_summary`` (side): new user text asks for a title, slug or summary of the
  conversation/chat/session/thread.
- ``no_new_input`` (side): the request adds no user or tool message, or re-sends a history that was
  already answered (a regenerate).
- ``default_main`` (main): everything else: a user message or tool results the agent must act on.
The admin can relabel later (``TurnStore.relabel_turn``, rule ``admin``).

**Next state**: set on turn t when the session's next request arrives (rule ``prefix``/``header``
above); when the session ends (``X-Session-Done`` or idle for ``idle_timeout_s``), its open turns are
closed without one, with reason ``session_done`` / ``idle_timeout``.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from clawrl.store import TurnRecord, TurnRef, TurnStore

log = logging.getLogger(__name__)

TRANSIENT_PREFIXES = ("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>",)
_MAX_SESSION_ID = 200


class SessionInputError(ValueError):
    """A request's session headers or messages are malformed; the gateway answers 400 with this line."""


class InvalidTurnType(SessionInputError):
    """``X-Turn-Type`` is neither ``main`` nor ``side``."""


# --- headers -------------------------------------------------------------------------------------


def _latin1(text: str) -> bool:
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class SessionHints:
    """What the client said about the session, from headers (or body ``session_id``)."""

    session_id: Optional[str] = None
    turn_type: Optional[str] = None
    done: bool = False

    def __post_init__(self):
        if self.turn_type is not None and self.turn_type not in ("main", "side"):
            raise InvalidTurnType(f"X-Turn-Type must be 'main' or 'side', not {self.turn_type!r}")
        sid = self.session_id
        # Latin-1: the id is echoed in the X-Session-Id response header, which can carry nothing else
        # (a body session_id of "\u0100" once failed there, after the turn was stored, as a 503).
        if sid is not None and (not isinstance(sid, str) or not sid.strip() or len(sid) > _MAX_SESSION_ID
                                or not sid.isprintable() or not _latin1(sid)):
            raise SessionInputError(f"session id must be a printable Latin-1 string of 1-{_MAX_SESSION_ID} "
                                    "characters (it is echoed in the X-Session-Id header)")

    @classmethod
    def from_request(cls, headers: Mapping[str, str], body: Mapping) -> "SessionHints":
        h = {k.lower(): v for k, v in headers.items()}
        sid = h.get("x-session-id")
        if sid is None and body.get("session_id") is not None:
            sid = body["session_id"]
            if not isinstance(sid, str):
                raise SessionInputError("body field session_id must be a string")
        turn_type = h.get("x-turn-type")
        done = h.get("x-session-done", "0").strip().lower()
        if done not in ("0", "1", "true", "false", ""):
            raise SessionInputError(f"X-Session-Done must be 1 or 0, not {done!r}")
        return cls(
            session_id=sid.strip() if sid is not None else None,
            turn_type=turn_type.strip().lower() if turn_type is not None else None,
            done=done in ("1", "true"),
        )


# --- normalisation -------------------------------------------------------------------------------


def _content(content) -> object:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SessionInputError("message content must be a string, a list of content parts, or null")
    parts = []
    for p in content:
        if not isinstance(p, dict):
            raise SessionInputError("each content part must be an object")
        parts.append({"type": "text", "text": p["text"]} if p.get("type") == "text" and isinstance(p.get("text"), str) else p)
    if all(p.get("type") == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_call(call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise SessionInputError("each tool call needs a function with a name")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # unparseable arguments compare as the raw string
    elif args is None:
        args = {}
    return {"name": fn["name"], "arguments": args}


def normalize_message(m) -> dict:
    """The canonical form used for linking and storage (see the module docstring)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise SessionInputError("each message must be an object with a string 'role'")
    out = {"role": m["role"], "content": _content(m.get("content"))}
    if m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise SessionInputError("tool_calls must be a list")
        out["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
    if isinstance(m.get("name"), str) and m["role"] != "tool":
        out["name"] = m["name"]
    return out


def _text(m: dict) -> str:
    c = m["content"]
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c if isinstance(p.get("text"), str))


def is_transient(m: dict) -> bool:
    """A message the client sends at the end of a request but does not keep in its history."""
    return m["role"] == "user" and _text(m).lstrip().startswith(TRANSIENT_PREFIXES)


def history_length(messages: Sequence[dict]) -> int:
    """How many leading normalised messages the client keeps (trailing transient ones set aside)."""
    n = len(messages)
    while n and is_transient(messages[n - 1]):
        n -= 1
    return n


def _canon(m: dict) -> bytes:
    return json.dumps(m, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def _extend(key: str, m: dict) -> str:
    return hashlib.sha256(key.encode() + b"\0" + _canon(m)).hexdigest()


# --- turn types ----------------------------------------------------------------------------------

_SIDE_RULES: list[tuple[str, re.Pattern]] = [
    ("heartbeat", re.compile(r"read heartbeat\.md|\bHEARTBEAT_OK\b", re.I)),
    ("memory_flush", re.compile(r"pre-compaction memory flush|store durable memories", re.I)),
    ("cron", re.compile(r"^\s*(?:\[[^\]\n]*\]\s*)?\[cron[:\]\s]|\bsession=agent:[^\s|]*:(?:cron|heartbeat)\b", re.I | re.M)),
    (
        "title_or_summary",
        re.compile(
            r"\b(?:title|slug|summary|summari[sz]e)\b.{0,80}\b(?:conversation|chat|session|thread|transcript)\b"
            r"|\b(?:conversation|chat|session|thread|transcript)\b.{0,80}\b(?:title|slug|summary|summari[sz]e)\b",
            re.I | re.S,
        ),
    ),
]


def classify(new_input: Sequence[dict], resend: bool = False) -> tuple[str, str]:
    """(type, rule) for a request, from what it adds to its parent (see the module docstring)."""
    user_text = "\n".join(_text(m) for m in new_input if m["role"] == "user")
    for rule, pattern in _SIDE_RULES:
        if user_text and pattern.search(user_text):
            return "side", rule
    if resend or not any(m["role"] in ("user", "tool") for m in new_input):
        return "side", "no_new_input"
    return "main", "default_main"


# --- linking -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnPlan:
    """Where a request sits, decided by :meth:`SessionLinker.begin`; pass it back to ``record``."""

    session_id: str
    branch_id: int
    parent_turn_id: Optional[int]
    turn_index: int
    turn_type: str
    type_rule: str
    link_rule: str
    next_state_for: Optional[int]  # the parent turn whose next state this request supplied
    messages: list  # normalised request messages, trailer included
    history_len: int
    tools: Optional[list]
    caller_hash: str
    request_key: str
    done: bool
    created_at: float


@dataclass(frozen=True)
class _Link:
    rule: str
    parent: Optional[TurnRef]  # the turn whose reply this request continues
    resent: Optional[TurnRef]  # the stored turn with this very history (rule "resend")
    prefix_len: int  # history messages before the request's new input (the parent's history and reply)


class SessionLinker:
    """Links requests into sessions and branches, classifies them, and records their turns."""

    def __init__(self, store: TurnStore, idle_timeout_s: float):
        self.store = store
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()  # a link decision reads then writes; two must not interleave
        # Linked but not yet recorded, by request key: an identical request arriving meanwhile is a
        # resend of it, exactly as if it had been stored (else concurrent twins all become main).
        self._in_flight: dict[str, TurnPlan] = {}

    def caller_hash(self, caller_key: Optional[str]) -> str:
        """The salted hash that stands for an API key; the key itself is never stored."""
        return hmac.new(self.store.salt.encode(), (caller_key or "").encode(), hashlib.sha256).hexdigest()[:32]

    def begin(
        self,
        messages: Sequence[Mapping],
        tools: Optional[list] = None,
        caller_key: Optional[str] = None,
        user: Optional[str] = None,
        hints: SessionHints = SessionHints(),
        now: Optional[float] = None,
    ) -> TurnPlan:
        """Link a request before it is served; stores its parent's next state. Raises SessionInputError."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise SessionInputError("messages must be a non-empty list")
        if user is not None and not isinstance(user, str):
            raise SessionInputError("body field user must be a string")
        norm = [normalize_message(m) for m in messages]
        hist_len = history_length(norm)
        history = norm[:hist_len]
        caller = self.caller_hash(caller_key)
        chain = [hashlib.sha256(f"{self.store.salt}\0{caller}\0{user or ''}".encode()).hexdigest()]
        for m in history:
            chain.append(_extend(chain[-1], m))  # chain[i]: key of history[:i]
        now = time.time() if now is None else now

        with self._lock:
            inferred = self._infer(history, chain, session_id=None)
            session_id, source = self._session_for(hints, inferred, caller)
            link = inferred
            if hints.session_id is not None and (inferred is None or self._session_of(inferred) != session_id):
                if inferred is not None:
                    log.info("X-Session-Id %s overrides the inferred session %s", session_id, self._session_of(inferred))
                link = self._infer(history, chain, session_id=session_id) or self._header_link(session_id, history)
            if link is None:
                link = _Link("new", None, None, _reply_end(history))
            new_input = history[link.prefix_len:]
            regenerate = _is_regenerate(link, new_input)
            turn_type, type_rule = classify(new_input, resend=regenerate)
            if hints.turn_type is not None:
                if hints.turn_type != turn_type:
                    log.info("X-Turn-Type %s overrides rule %s (%s) in session %s",
                             hints.turn_type, type_rule, turn_type, session_id)
                turn_type, type_rule = hints.turn_type, "header"
            place = _place(link, turn_type, regenerate)
            branch_id = self.store.apply_link(
                session_id=session_id, caller_hash=caller, user=user, source=source, now=now,
                branch_id=place.branch_id, fork=place.fork,
                next_state=(place.parent_turn_id, new_input) if place.supplies_next_state else None,
            )
            plan = TurnPlan(
                session_id=session_id, branch_id=branch_id, parent_turn_id=place.parent_turn_id,
                turn_index=place.turn_index, turn_type=turn_type, type_rule=type_rule, link_rule=link.rule,
                next_state_for=place.parent_turn_id if place.supplies_next_state else None, messages=norm,
                history_len=hist_len, tools=tools, caller_hash=caller, request_key=chain[-1], done=hints.done,
                created_at=now,
            )
            self._in_flight.setdefault(plan.request_key, plan)
        log.info("request linked: session %s branch %d turn %d (%s, %s/%s)%s", plan.session_id, plan.branch_id,
                 plan.turn_index, plan.link_rule, plan.turn_type, plan.type_rule,
                 f"; next state of turn {plan.next_state_for} stored" if plan.next_state_for else "")
        return plan

    def _infer(self, history: list, chain: list, session_id: Optional[str]) -> Optional[_Link]:
        def mine(refs):
            return [r for r in refs if session_id is None or r.session_id == session_id]

        # The same history re-sent after its session ended is a new conversation that opens alike
        # (e.g. the same first question), however the earlier turn itself was closed.
        resent = mine(self.store.turns_by_request_key(chain[-1]))
        ended = self.store.ended_sessions([r.session_id for r in resent])
        resent = [r for r in resent if r.session_id not in ended]
        ends = [i + 1 for i, m in enumerate(history) if m["role"] == "assistant"]
        found = self.store.turns_by_reply_keys([chain[n] for n in ends])
        parent, prefix_len = None, 0
        for n in reversed(ends):
            refs = mine(found.get(chain[n], []))
            if refs:
                parent, prefix_len = refs[0], n
                break
        if resent:
            return _Link("resend", parent, resent[0], prefix_len)
        twin = self._in_flight.get(chain[-1])
        if twin is not None and mine([twin]):
            return _Link("resend", parent, _pending_ref(twin), prefix_len)
        if parent:
            return _Link("prefix", parent, None, prefix_len)
        return None

    @staticmethod
    def _session_of(link: _Link) -> str:
        return (link.resent or link.parent).session_id

    def _session_for(self, hints: SessionHints, inferred: Optional[_Link], caller: str) -> tuple[str, str]:
        if hints.session_id is None:
            return (self._session_of(inferred) if inferred else uuid.uuid4().hex), "inferred"
        sid = hints.session_id
        owner = self.store.session_caller(sid)
        if owner is not None and owner != caller:
            sid = f"{sid}@{caller[:8]}"
            log.info("session id %s belongs to another caller; this caller's session is %s", hints.session_id, sid)
        return sid, "header"

    def _header_link(self, session_id: str, history: list) -> Optional[_Link]:
        latest = self.store.latest_turn(session_id)
        if latest is None:
            return None
        log.info("no stored prefix matches in session %s; X-Session-Id continues its latest main turn %d",
                 session_id, latest.turn_id)
        return _Link("header", latest, None, _reply_end(history))

    def record(
        self,
        plan: TurnPlan,
        *,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        logprobs: Sequence[float],
        weight_versions: Sequence[int],
        response_text: str,
        tool_calls: Optional[list] = None,
        tool_parse_error: Optional[str] = None,
        finish_reason: Optional[str] = None,
        status: str = "complete",
        temperature: float = 1.0,
    ) -> int:
        """Durably store the served turn and return its id; it is committed (fsynced) on return.

        ``status``: ``complete``, ``aborted`` (client went away; stored untrainable, closed) or
        ``error``. ``tool_parse_error``: why a tool-call block in the output was not a valid call
        (several reasons joined by newlines). With ``n`` > 1 choices, call once per choice with the
        same plan: each becomes a turn, and the one the client keeps in its history gets the next state.
        ``temperature``: the temperature the logprobs were taken at (``SamplingParams.logprob_temperature``).
        """
        try:
            return self._record(plan, prompt_ids, response_ids, logprobs, weight_versions, response_text,
                                tool_calls, tool_parse_error, finish_reason, status, temperature)
        finally:
            self.release(plan)

    def release(self, plan: TurnPlan) -> None:
        """Drop ``plan``'s in-flight claim: it is recorded (identical requests now find it in the
        store) or it will never be (the request failed before serving)."""
        with self._lock:
            if self._in_flight.get(plan.request_key) is plan:
                del self._in_flight[plan.request_key]

    def _record(self, plan, prompt_ids, response_ids, logprobs, weight_versions, response_text, tool_calls,
                tool_parse_error, finish_reason, status, temperature) -> int:
        reply = normalize_message({"role": "assistant", "content": response_text, "tool_calls": tool_calls})
        reply_key = _extend(plan.request_key, reply) if status == "complete" else None
        return self.store.record_turn(TurnRecord(
            session_id=plan.session_id, branch_id=plan.branch_id, parent_turn_id=plan.parent_turn_id,
            turn_index=plan.turn_index, caller_hash=plan.caller_hash, link_rule=plan.link_rule,
            turn_type=plan.turn_type, type_rule=plan.type_rule, messages=plan.messages,
            history_len=plan.history_len, tools=plan.tools, prompt_ids=prompt_ids, response_ids=response_ids,
            logprobs=logprobs, weight_versions=weight_versions, response_text=response_text or "",
            tool_calls=tool_calls or None, tool_parse_error=tool_parse_error, finish_reason=finish_reason,
            status=status, request_key=plan.request_key, reply_key=reply_key, created_at=plan.created_at,
            temperature=temperature,
            session_done=plan.done,
        ))

    def close_idle_sessions(self, now: Optional[float] = None) -> int:
        """Close turns of sessions idle past ``idle_timeout_s`` (reason ``idle_timeout``); returns the count."""
        return self.store.close_idle_sessions(time.time() if now is None else now, self.idle_timeout_s)


@dataclass(frozen=True)
class _Placement:
    branch_id: Optional[int]  # None: open a new branch
    fork: tuple  # (parent turn, sibling turn) of a new branch
    parent_turn_id: Optional[int]
    turn_index: int
    supplies_next_state: bool  # the request's new input becomes the parent's next state


def _pending_ref(plan: TurnPlan) -> TurnRef:
    """An in-flight twin as the stored turn it will be: answered (so a twin is a regenerate), with
    no turn id yet (its regenerates branch beside it without naming it as their sibling)."""
    return TurnRef(turn_id=None, session_id=plan.session_id, branch_id=plan.branch_id,
                   parent_turn_id=plan.parent_turn_id, turn_index=plan.turn_index, status="complete",
                   close_reason=None, next_state=None)


def _is_regenerate(link: _Link, new_input: list) -> bool:
    """The same history re-sent after it was answered (directly, or racing the first answer)."""
    if link.resent is not None:
        return link.resent.status == "complete"
    p = link.parent
    return p is not None and p.close_reason == "next_state" and new_input == p.next_state


def _place(link: _Link, turn_type: str, regenerate: bool) -> _Placement:
    """Branch, parent and index of a request, and whether it supplies its parent's next state."""
    r, p = link.resent, link.parent
    if r is not None:  # a regenerate branches beside r; a retry of an aborted r takes its place
        return _Placement(None if regenerate else r.branch_id, (r.parent_turn_id, r.turn_id), r.parent_turn_id,
                          r.turn_index, False)
    if p is None:
        return _Placement(None, (None, None), None, 0, False)
    if p.close_reason == "next_state" or (turn_type == "side" and p.close_reason is None):
        # p's prefix extended a second time; or a side run (heartbeat, title, ...) that must not
        # pass for the reaction to p's reply: a branch from p that leaves p's next state alone.
        return _Placement(None, (p.turn_id, None), p.turn_id, p.turn_index + 1, False)
    if p.close_reason is not None:
        log.info("turn %d was closed (%s); its session continues but it keeps no next state", p.turn_id, p.close_reason)
    return _Placement(p.branch_id, (None, None), p.turn_id, p.turn_index + 1, p.close_reason is None)


def _reply_end(history: list) -> int:
    """Where new input starts when no stored reply matches: after the last assistant message."""
    return 1 + max((i for i, m in enumerate(history) if m["role"] == "assistant"), default=-1)
