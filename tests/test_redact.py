"""Secrets never reach the store; a turn whose tokens held one is untrainable and keeps no tokens."""
import pytest

from clawrl.redact import redact_json, redact_text
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore
from test_sessions import assistant, serve, turns_of, user

SECRETS = [  # (text, the secret in it, kind)
    ("Authorization: Bearer abcDEF123456.xyz", "abcDEF123456.xyz", "bearer"),
    ("AUTHORIZATION: BEARER abc123def456", "abc123def456", "bearer"),
    ("key sk-proj-Abc123def456GHI789jkl ok", "sk-proj-Abc123def456GHI789jkl", "openai_key"),
    ("ANTHROPIC sk-ant-api03-abcdefghijklmnopqrstuvwx", "sk-ant-api03-abcdefghijklmnopqrstuvwx", "anthropic_key"),
    ("token ghp_" + "a1B2" * 9, "ghp_" + "a1B2" * 9, "github_token"),
    ("github_pat_11ABCDEFG0123456789_abcdefghijklmnop", "11ABCDEFG0123456789_abcdefghijklmnop", "github_token"),
    ("aws AKIAIOSFODNN7EXAMPLE here", "AKIAIOSFODNN7EXAMPLE", "aws_access_key"),
    ("slack xoxb-123456789012-abcdefghijkl", "123456789012-abcdefghijkl", "slack_token"),
    ("maps AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "google_api_key"),
    ("hf hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "hf_token"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\nafter",
     "b3BlbnNzaC1rZXktdjEAAAAA", "private_key"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA (truncated paste", "MIIEowIBAAKCAQEA", "private_key"),
    ("OPENAI_API_KEY=abcd1234secret", "abcd1234secret", "assignment"),
    ("AWS_SECRET_ACCESS_KEY = wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI/K7MDENG", "assignment"),
    ('config = {"password": "correct horse battery"}', "correct horse battery", "assignment"),
    ("db password: hunter2!", "hunter2!", "assignment"),
    ("api-key: 'k3y-v4lue'", "k3y-v4lue", "assignment"),
]


@pytest.mark.parametrize("text,secret,kind", SECRETS)
def test_each_secret_format_is_redacted(text, secret, kind):
    out, kinds = redact_text(text)
    assert kinds == {kind} and f"[REDACTED:{kind}]" in out
    assert secret not in out
    assert redact_text(out) == (out, set())  # redacted text is stable


@pytest.mark.parametrize("text", [
    "We use Bearer authentication for the API.",
    "password = getpass()",
    "api_key=None",
    "api_key = os.environ['OPENAI_API_KEY']",
    "client = Client(api_key=settings.api_key)",
    "PASSWORD=${DB_PASSWORD}",
    "the task-list and sk-short are fine",
    "Read HEARTBEAT.md and reply HEARTBEAT_OK",
])
def test_ordinary_text_is_left_alone(text):
    assert redact_text(text) == (text, set())


def test_redact_json_walks_nested_values():
    value = {"a": ["x", {"b": "Bearer abcDEF123456.xyz"}], "n": 3, "none": None}
    out, kinds = redact_json(value)
    assert out == {"a": ["x", {"b": "Bearer [REDACTED:bearer]"}], "n": 3, "none": None} and kinds == {"bearer"}


SECRET = "sk-ant-api03-SuperSecretValue1234567890"


@pytest.fixture
def store(tmp_path):
    store = TurnStore(tmp_path)
    yield store
    store.close()


def test_a_secret_in_the_prompt_is_redacted_and_the_turn_keeps_no_tokens(tmp_path, store):
    linker = SessionLinker(store, 60.0)
    p0, t0 = serve(linker, [user("hi")], reply={"response_text": "hello"})
    p1, t1 = serve(linker, [user("hi"), assistant("hello"), user(f"my key is {SECRET}, use it")])
    turns = turns_of(linker, p0.session_id)
    # Turn 0's own tokens were clean: it stays trainable, its next state is stored redacted.
    assert turns[t0]["trainable"] is True
    assert turns[t0]["next_state"] == [user("my key is [REDACTED:anthropic_key], use it")]
    assert (turns[t1]["trainable"], turns[t1]["untrainable_reason"]) == (False, "secret_redacted")
    full = store.get_turn(t1)
    assert full["prompt_ids"] is None and full["response_ids"] is None and full["logprobs"] is None
    assert full["prompt_tokens"] == 10 and full["response_tokens"] == 3
    assert "[REDACTED:anthropic_key]" in full["messages"][-1]["content"]
    # Linking still works: keys were computed on the raw text before redaction.
    p2, _ = serve(linker, [user("hi"), assistant("hello"), user(f"my key is {SECRET}, use it"), assistant("ok"),
                           user("thanks")])
    assert p2.parent_turn_id == t1
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert SECRET.encode() not in raw


def test_a_secret_in_the_response_or_tool_call_makes_the_turn_untrainable(store):
    linker = SessionLinker(store, 60.0)
    _, t0 = serve(linker, [user("show env")], reply={"response_text": "AWS key: AKIAIOSFODNN7EXAMPLE"})
    call = {"id": "c", "type": "function", "function": {"name": "exec", "arguments": '{"command": "export PASSWORD=hunter22"}'}}
    _, t1 = serve(linker, [user("run it")], reply={"response_text": "", "tool_calls": [call]})
    for turn_id in (t0, t1):
        turn = store.get_turn(turn_id)
        assert (turn["trainable"], turn["untrainable_reason"], turn["response_ids"]) == (False, "secret_redacted", None)
    assert store.get_turn(t0)["response_text"] == "AWS key: [REDACTED:aws_access_key]"
    assert "hunter22" not in store.get_turn(t1)["tool_calls"][0]["function"]["arguments"]
