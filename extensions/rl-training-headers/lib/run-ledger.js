/**
 * What the plugin knows about OpenClaw runs and sessions, and the headers that follows from it.
 *
 * OpenClaw's provider hooks see each model request (its session id and request id) but not *why*
 * the run exists; its typed agent hooks see why (`ctx.trigger`: user, heartbeat, memory, cron, ...)
 * but not the request. This ledger joins the two by run id: OpenClaw names each model call
 * `<runId>:model:<n>` (stream option `requestId`), and every agent hook context carries `runId`.
 *
 * Kept free of OpenClaw imports so it can be unit-tested with `node --test`.
 */

export const SESSION_ID_HEADER = "X-Session-Id";
export const TURN_TYPE_HEADER = "X-Turn-Type";
export const SESSION_DONE_HEADER = "X-Session-Done";
export const DEFAULT_PROVIDER_IDS = Object.freeze(["clawrl"]);

/** Bounds memory in a long-lived Gateway: runs and ended sessions beyond this are forgotten oldest-first. */
const MAX_REMEMBERED = 4096;

/**
 * Turn type of a run trigger. Only a turn the user drives is `main`; heartbeats, memory flushes,
 * cron jobs, compaction and other host-initiated runs (`manual`, `overflow`, ...) are `side`, because
 * their prompt was written by OpenClaw, not said by the user. Unknown (no trigger seen): undefined,
 * so no header is sent and the server falls back to its own inference rather than a guess.
 */
export function turnTypeForTrigger(trigger) {
  if (typeof trigger !== "string" || trigger === "") return undefined;
  return trigger === "user" ? "main" : "side";
}

/** The run id inside an OpenClaw model-call request id (`<runId>:model:<n>`), or undefined. */
export function runIdOfRequest(requestId) {
  if (typeof requestId !== "string") return undefined;
  const at = requestId.lastIndexOf(":model:");
  return at > 0 ? requestId.slice(0, at) : undefined;
}

/** Provider ids from the plugin config; rejects a malformed list loudly instead of silently tagging nothing. */
export function resolveProviderIds(pluginConfig) {
  const ids = pluginConfig?.providers;
  if (ids === undefined) return [...DEFAULT_PROVIDER_IDS];
  if (!Array.isArray(ids) || ids.length === 0 || ids.some((id) => typeof id !== "string" || id.trim() === "")) {
    throw new Error("rl-training-headers: config.providers must be a non-empty list of provider ids");
  }
  return [...new Set(ids.map((id) => id.trim()))];
}

function remember(map, key, value) {
  map.delete(key);
  map.set(key, value);
  if (map.size > MAX_REMEMBERED) map.delete(map.keys().next().value);
}

export class RunLedger {
  constructor() {
    /** runId -> { sessionId, trigger } */
    this.runs = new Map();
    /** sessionId -> { trigger, provider, model } of the latest run in it (OpenClaw runs one at a time per session) */
    this.latestRunBySession = new Map();
    /** sessions already closed since their last run: before_reset and session_end both announce one reset */
    this.closed = new Set();
  }

  /** Record a run from an agent hook context (`runId`, `sessionId`, `trigger`, `modelProviderId`, `modelId`). */
  noteRun(ctx) {
    if (!ctx || typeof ctx.runId !== "string") return;
    remember(this.runs, ctx.runId, { sessionId: ctx.sessionId, trigger: ctx.trigger });
    if (typeof ctx.sessionId === "string") {
      remember(this.latestRunBySession, ctx.sessionId,
        { trigger: ctx.trigger, provider: ctx.modelProviderId, model: ctx.modelId });
      this.closed.delete(ctx.sessionId);
    }
  }

  forgetRun(runId) {
    this.runs.delete(runId);
  }

  /**
   * Claim the close of a session that OpenClaw says has ended. Returns the session's latest run
   * (`{ provider, model }` may be undefined) the first time, and null for a repeated announcement.
   */
  claimClose(sessionId) {
    if (typeof sessionId !== "string" || sessionId === "" || this.closed.has(sessionId)) return null;
    this.closed.add(sessionId);
    if (this.closed.size > MAX_REMEMBERED) this.closed.delete(this.closed.values().next().value);
    return this.latestRunBySession.get(sessionId) ?? {};
  }

  /** The trigger of the run that issued this model call: exact by run id, else the session's latest run. */
  triggerFor({ sessionId, requestId }) {
    const run = this.runs.get(runIdOfRequest(requestId));
    if (run?.trigger) return run.trigger;
    return typeof sessionId === "string" ? this.latestRunBySession.get(sessionId)?.trigger : undefined;
  }

  /**
   * Headers for one model request. `forcedTurnType` is set by callers that know the request is
   * never user-driven (one-shot completions such as compaction summaries).
   */
  headersFor({ sessionId, requestId, forcedTurnType }) {
    const headers = {};
    if (typeof sessionId === "string" && sessionId !== "") headers[SESSION_ID_HEADER] = sessionId;
    const turnType = forcedTurnType ?? turnTypeForTrigger(this.triggerFor({ sessionId, requestId }));
    if (turnType) headers[TURN_TYPE_HEADER] = turnType;
    return headers;
  }
}

/**
 * The request that tells clawrl a session ended. OpenClaw sends no model request after `/new`,
 * `/reset` or a deletion, so the plugin sends this one itself: a side turn of one token, in the
 * ended session, carrying `X-Session-Done: 1`. Only parameters clawrl implements are used.
 */
export function sessionCloseRequest({ baseUrl, apiKey, model, sessionId, reason }) {
  const headers = {
    "Content-Type": "application/json",
    [SESSION_ID_HEADER]: sessionId,
    [TURN_TYPE_HEADER]: "side",
    [SESSION_DONE_HEADER]: "1",
  };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  return {
    url: `${baseUrl.replace(/\/+$/, "")}/chat/completions`,
    init: {
      method: "POST",
      headers,
      body: JSON.stringify({
        model,
        messages: [{ role: "user", content: `[OpenClaw session ended: ${reason ?? "unknown"}]` }],
        max_completion_tokens: 1,
        stream: false,
      }),
    },
  };
}
