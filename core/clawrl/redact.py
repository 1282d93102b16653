"""Remove secrets from text before it is stored.

Users paste keys into chats and agents read ``.env`` files, so conversation text routinely holds
credentials. The turn store is kept for as long as a run lives and is exported for training, so
nothing that looks like a credential may reach it: every string the store persists (messages,
tools, response text, tool calls, parse errors, next states) passes through :func:`redact_json`.

Each match is replaced by ``[REDACTED:<kind>]``; the kinds found are returned so the caller can
tell that a turn held a secret (the store then marks it untrainable, see ``clawrl.store``). The
patterns favour recall on well-known key formats and stay narrow on free-form assignments
(``password=...``), where code like ``password=getpass()`` or ``api_key=None`` must not count,
because a false positive costs a trainable turn.

Kinds: ``private_key`` (PEM), ``bearer``, ``anthropic_key`` (sk-ant-...), ``openai_key`` (sk-...),
``github_token`` (ghp_/gho_/ghu_/ghs_/ghr_/github_pat_), ``aws_access_key`` (AKIA/ASIA...),
``slack_token`` (xoxb-/xoxp-/...), ``google_api_key`` (AIza...), ``hf_token`` (hf_...),
``assignment`` (``api_key=...``, ``password: ...``, ``"secret": "..."``).
"""
from __future__ import annotations

import functools
import re

_PLACEHOLDER = "[REDACTED:{}]"

# One alternation, scanned once; order matters: the PEM block first (it may contain anything),
# sk-ant- before sk-.
_TOKEN_KINDS: list[tuple[str, str]] = [
    ("private_key", r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?:.*?-----END [A-Z ]*PRIVATE KEY-----|.*\Z)"),
    # A bearer credential has a digit or punctuation in it; "Bearer authentication" is prose.
    ("bearer", r"(?<=\b(?i:bearer) )\s*(?=[\w.~+/=-]*[\d._~+/-])[\w.~+/=-]{8,}"),
    ("anthropic_key", r"\bsk-ant-[\w-]{16,}"),
    ("openai_key", r"\bsk-[\w-]{16,}"),
    ("github_token", r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,})"),
    ("aws_access_key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    ("slack_token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    ("google_api_key", r"\bAIza[\w-]{35}"),
    ("hf_token", r"\bhf_[A-Za-z0-9]{30,}"),
]
_TOKENS = re.compile("|".join(f"(?P<{kind}>{rx})" for kind, rx in _TOKEN_KINDS), re.S)

_SECRET_NAMES = (
    r"api[_-]?key|apikey|api[_-]?secret|secret[_-]?key|client[_-]?secret|secret|access[_-]?token"
    r"|access[_-]?key|auth[_-]?token|refresh[_-]?token|private[_-]?key|password|passwd|passphrase"
)
# name (any identifier ending in one: OPENAI_API_KEY, DB_PASSWORD), optional closing quote, ':' or
# '=', then a quoted value or a bare word. A bare word followed by '(' or '.' is code, not a secret.
_ASSIGNMENT = re.compile(
    r"""(?P<head>(?:%s)\b["']?\s*[:=]\s*)"""
    r"""(?:(?P<q>["'])(?P<qval>[^"'\n]{4,})(?P=q)|(?P<val>[^\s"',;(){}\[\]<>]{4,})(?![\w.(\[]))""" % _SECRET_NAMES,
    re.I,
)
# Values that are clearly not secrets: placeholders, env references, null-ish literals, dotted names.
_NOT_A_SECRET = re.compile(
    r"^(?:none|null|nil|true|false|undefined|\*+|x+|\.\.\.|your[_-].*|<.*>|\$\{?\w+\}?"
    r"|\[REDACTED(?::\w+)?\]|os\.environ.*|process\.env.*|env\(.*"
    r"|(?!eyJ)[a-z_]\w*(?:\.[a-z_]\w*)+)$",  # a dotted name is code: settings.api_key
    re.I,
)


def _replace_assignment(m: re.Match, found: set[str]) -> str:
    value = m.group("qval") if m.group("qval") is not None else m.group("val")
    if _NOT_A_SECRET.match(value):
        return m.group(0)
    found.add("assignment")
    q = m.group("q") or ""
    return f"{m.group('head')}{q}{_PLACEHOLDER.format('assignment')}{q}"


@functools.lru_cache(maxsize=4096)
def redact_text(text: str) -> tuple[str, frozenset[str]]:
    """Return ``text`` with secrets replaced, and the kinds of secret that were found.

    Cached: every request re-sends the same system prompt, tools and history, and the store
    redacts each turn's full request.
    """
    found: set[str] = set()

    def token(m: re.Match) -> str:
        found.add(m.lastgroup)
        return _PLACEHOLDER.format(m.lastgroup)

    text = _ASSIGNMENT.sub(lambda m: _replace_assignment(m, found), _TOKENS.sub(token, text))
    return text, frozenset(found)


def redact_json(value):
    """Redact every string inside a JSON-like value (dict keys included). Returns (value, kinds)."""
    found: set[str] = set()

    def walk(v):
        if isinstance(v, str):
            out, kinds = redact_text(v)
            found.update(kinds)
            return out
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {walk(k): walk(x) for k, x in v.items()}
        return v

    return walk(value), found


# Config keys that name a secret: api_key, admin_key, hf_token, secret, password; not
# micro_batch_tokens or max_new_tokens.
_SECRET_KEY = re.compile(r"(key|secret|passw(or)?d|(^|_)token)$", re.IGNORECASE)


def is_secret_key(key: str) -> bool:
    """Whether config key ``key`` (its last dotted part) names a secret, whose value never leaves
    the process (WandB's config, a run's stored ``run_config.yaml``)."""
    return bool(_SECRET_KEY.search(key.rsplit(".", 1)[-1]))


def public_config(value, secrets_as_null: bool = False):
    """A config (nested dicts) fit to leave the process: secret-looking strings redacted, and every
    entry whose key names a secret left out, or, with ``secrets_as_null``, kept with the value None
    (so that a file still lists every key)."""
    if isinstance(value, dict):
        return {k: None if is_secret_key(str(k)) else public_config(v, secrets_as_null) for k, v in value.items()
                if secrets_as_null or not is_secret_key(str(k))}
    if isinstance(value, (list, tuple)):
        return [public_config(v, secrets_as_null) for v in value]
    if isinstance(value, str):
        return redact_text(value)[0]
    return value
