// Unit tests of the plugin's OpenClaw-free logic: `node --test test/`.
import assert from "node:assert/strict";
import test from "node:test";
import {
  RunLedger,
  resolveProviderIds,
  runIdOfRequest,
  sessionCloseRequest,
  turnTypeForTrigger,
} from "../lib/run-ledger.js";

test("only user-triggered runs are main; every host-initiated trigger is side", () => {
  assert.equal(turnTypeForTrigger("user"), "main");
  for (const trigger of ["heartbeat", "memory", "cron", "manual", "overflow", "something-new"]) {
    assert.equal(turnTypeForTrigger(trigger), "side", trigger);
  }
  assert.equal(turnTypeForTrigger(undefined), undefined);
  assert.equal(turnTypeForTrigger(""), undefined);
});

test("run id is read from OpenClaw's <runId>:model:<n> request id", () => {
  assert.equal(runIdOfRequest("3db2c843-59:model:1"), "3db2c843-59");
  assert.equal(runIdOfRequest("a:b:model:12"), "a:b");
  assert.equal(runIdOfRequest("no-marker"), undefined);
  assert.equal(runIdOfRequest(undefined), undefined);
});

test("a heartbeat run in a user's session is side while the user's run stays main", () => {
  const ledger = new RunLedger();
  ledger.noteRun({ runId: "r-user", sessionId: "s1", trigger: "user" });
  ledger.noteRun({ runId: "r-beat", sessionId: "s1", trigger: "heartbeat" });
  assert.deepEqual(ledger.headersFor({ sessionId: "s1", requestId: "r-user:model:2" }),
    { "X-Session-Id": "s1", "X-Turn-Type": "main" });
  assert.deepEqual(ledger.headersFor({ sessionId: "s1", requestId: "r-beat:model:1" }),
    { "X-Session-Id": "s1", "X-Turn-Type": "side" });
});

test("without a known run the turn type is omitted, not guessed", () => {
  const ledger = new RunLedger();
  assert.deepEqual(ledger.headersFor({ sessionId: "s1", requestId: "r-x:model:1" }), { "X-Session-Id": "s1" });
  assert.deepEqual(ledger.headersFor({}), {});
});

test("a request id OpenClaw did not format falls back to the session's latest run", () => {
  const ledger = new RunLedger();
  ledger.noteRun({ runId: "r1", sessionId: "s1", trigger: "memory" });
  assert.equal(ledger.headersFor({ sessionId: "s1" })["X-Turn-Type"], "side");
  ledger.forgetRun("r1");
  assert.equal(ledger.headersFor({ sessionId: "s1", requestId: "r1:model:1" })["X-Turn-Type"], "side");
});

test("one-shot completions are always side", () => {
  const ledger = new RunLedger();
  ledger.noteRun({ runId: "r1", sessionId: "s1", trigger: "user" });
  assert.equal(ledger.headersFor({ sessionId: "s1", forcedTurnType: "side" })["X-Turn-Type"], "side");
});

test("a reset announced twice closes the session once, and again after a new run", () => {
  const ledger = new RunLedger();
  ledger.noteRun({ runId: "r1", sessionId: "s1", trigger: "user", modelProviderId: "clawrl", modelId: "tiny" });
  assert.deepEqual(ledger.claimClose("s1"), { trigger: "user", provider: "clawrl", model: "tiny" });
  assert.equal(ledger.claimClose("s1"), null);
  ledger.noteRun({ runId: "r2", sessionId: "s1", trigger: "user", modelProviderId: "clawrl", modelId: "tiny" });
  assert.notEqual(ledger.claimClose("s1"), null);
  assert.deepEqual(ledger.claimClose("never-ran"), {});
  assert.equal(ledger.claimClose(undefined), null);
});

test("the close request carries the done headers and only parameters clawrl implements", () => {
  const { url, init } = sessionCloseRequest({
    baseUrl: "http://127.0.0.1:8000/v1/", apiKey: "k", model: "tiny", sessionId: "s1", reason: "new",
  });
  assert.equal(url, "http://127.0.0.1:8000/v1/chat/completions");
  assert.equal(init.headers["X-Session-Id"], "s1");
  assert.equal(init.headers["X-Session-Done"], "1");
  assert.equal(init.headers["X-Turn-Type"], "side");
  assert.equal(init.headers.Authorization, "Bearer k");
  assert.deepEqual(Object.keys(JSON.parse(init.body)).sort(), ["max_completion_tokens", "messages", "model", "stream"]);
});

test("provider ids default to clawrl and a malformed list is refused", () => {
  assert.deepEqual(resolveProviderIds(undefined), ["clawrl"]);
  assert.deepEqual(resolveProviderIds({}), ["clawrl"]);
  assert.deepEqual(resolveProviderIds({ providers: ["a", " b ", "a"] }), ["a", "b"]);
  for (const bad of [[], [""], "clawrl", [1]]) {
    assert.throws(() => resolveProviderIds({ providers: bad }), /non-empty list/);
  }
});
