"""From sampled token ids to what the client sees: text deltas, stop-string trimming, tool calls.

One ``ChoiceDecoder`` per choice serves both the streaming and the non-streaming path, so the two
can never disagree on the text. The token ids themselves are never touched here: they go to the
store exactly as the engine sampled them; this module only decides what text to show.
"""
from __future__ import annotations

from functools import lru_cache

from clawrl.gateway.toolcalls import TOOL_CLOSE, TOOL_OPEN, Content, ToolCall, ToolCallExtractor, held_suffix_len


def hidden_special_ids(tokenizer) -> frozenset[int]:
    """Ids of special tokens that never reach the client's text (eos, chat markers, padding).

    The tool-call tags are kept even when a tokenizer marks them special (the embedded one does;
    some HF models do too): they are how the parser finds a call, and dropping them would turn
    every tool call into plain content. They are looked up among the added tokens, not by
    ``convert_tokens_to_ids``: a vocabulary without them (SmolLM2's) answers with the unknown id,
    which is its ``<|endoftext|>``.
    """
    added = tokenizer.added_tokens_decoder.items()
    special = {i for i, tok in added if tok.special} | set(tokenizer.all_special_ids)
    return frozenset(special - {i for i, tok in added if tok.content in (TOOL_OPEN, TOOL_CLOSE)})


class IncrementalDecoder:
    """Decode a growing list of ids into text deltas.

    Decodes a short window (the previous delta's tokens plus the new ones) and emits the new end,
    holding it back while it ends in U+FFFD: a multi-byte character split across tokens.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._hidden = hidden_special_ids(tokenizer)
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids up to here are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self._hidden], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        before = self._decode(self.ids[self._prefix: self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        before = self._decode(self.ids[self._prefix: self._read])
        now = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return now[len(before):]


class StopTrimmer:
    """Cut the text at the first stop string; hold back any end that could begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""
        self.stopped: str | None = None  # the stop string that matched
        self._sent = 0

    def feed(self, delta: str) -> str:
        if self.stopped is not None:
            return ""
        self.text += delta
        hits = [(p, s) for s in self.stops if (p := self.text.find(s, self._sent)) >= 0]
        if hits:
            p, self.stopped = min(hits)
            out, self._sent = self.text[self._sent: p], p
            return out
        cut = len(self.text) - held_suffix_len(self.text[self._sent:], self.stops)
        out, self._sent = self.text[self._sent: cut], cut
        return out

    def finish(self) -> str:
        if self.stopped is not None:
            return ""
        out, self._sent = self.text[self._sent:], len(self.text)
        return out


class ChoiceDecoder:
    """ids -> text -> stop trimming -> tool-call extraction, for one choice.

    ``prefill`` is assistant text placed in the prompt (forced tool calls): the client must see
    the whole call, so the parser starts from it although the model did not sample it.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...], tool_names: set[str], single_call: bool, prefill: str):
        self.detok = IncrementalDecoder(tokenizer)
        self.trimmer = StopTrimmer(stops)
        self.tools = ToolCallExtractor(tool_names, single=single_call)
        self.content = ""
        self._pending = self._track(self.tools.feed(prefill)) if prefill else []

    def _track(self, events: list[Content | ToolCall]) -> list[Content | ToolCall]:
        self.content += "".join(e.text for e in events if isinstance(e, Content))
        return events

    @property
    def stopped(self) -> bool:
        """A stop string was seen: anything the engine samples after it is not shown."""
        return self.trimmer.stopped is not None

    def push(self, ids: list[int]) -> list[Content | ToolCall]:
        events, self._pending = self._pending, []
        return events + self._track(self.tools.feed(self.trimmer.feed(self.detok.push(ids))))

    def finish(self) -> list[Content | ToolCall]:
        events, self._pending = self._pending, []
        tail = self.trimmer.feed(self.detok.flush()) + self.trimmer.finish()
        return events + self._track(self.tools.feed(tail) + self.tools.finish())


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2 and Qwen): printable stand-ins for all 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


@lru_cache(maxsize=8)
def _token_table(tokenizer) -> dict:
    return {}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The exact bytes a token stands for (OpenAI's ``logprobs.content[].bytes``)."""
    cache = _token_table(tokenizer)
    if token_id in cache:
        return cache[token_id]
    piece = tokenizer.convert_ids_to_tokens(token_id)
    added = tokenizer.added_tokens_decoder.get(token_id)
    if added is not None:
        raw = added.content.encode()
    elif piece and all(c in _BYTE_OF_CHAR for c in piece):
        raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
    elif piece and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        raw = bytes([int(piece[3:5], 16)])  # sentencepiece byte fallback
    else:
        raw = tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()
    cache[token_id] = raw
    return raw


def logprob_entry(tokenizer, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict:
    """One element of OpenAI's ``logprobs.content``."""
    def one(tid: int, lp: float) -> dict:
        raw = token_bytes(tokenizer, tid)
        return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": lp, "bytes": list(raw)}

    entry = one(token_id, logprob)
    entry["top_logprobs"] = [one(t, lp) for t, lp in (top or [])]
    return entry
