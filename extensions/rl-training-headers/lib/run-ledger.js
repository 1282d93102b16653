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
    /** sessionId -> trigger of the latest run that started in it (OpenClaw runs one at a time per session) */
    this.latestTriggerBySession = new Map();
    /** sessionId -> reason it ended (new, reset, deleted, compaction, ...) */
    this.endedSessions = new Map();
  }

  /** Record a run from an agent hook context (`runId`, `sessionId`, `trigger`). */
  noteRun(ctx) {
    if (!ctx || typeof ctx.runId !== "string") return;
    remember(this.runs, ctx.runId, { sessionId: ctx.sessionId, trigger: ctx.trigger });
    if (typeof ctx.sessionId === "string" && typeof ctx.trigger === "string") {
      remember(this.latestTriggerBySession, ctx.sessionId, ctx.trigger);
    }
  }

  forgetRun(runId) {
    this.runs.delete(runId);
  }

  noteSessionEnded(sessionId, reason) {
    if (typeof sessionId === "string" && sessionId !== "") remember(this.endedSessions, sessionId, reason ?? "unknown");
  }

  /** The trigger of the run that issued this model call: exact by run id, else the session's latest run. */
  triggerFor({ sessionId, requestId }) {
    const run = this.runs.get(runIdOfRequest(requestId));
    if (run?.trigger) return run.trigger;
    return typeof sessionId === "string" ? this.latestTriggerBySession.get(sessionId) : undefined;
  }

  /**
   * Headers for one model request. `forcedTurnType` is set by callers that know the request is
   * never user-driven (one-shot completions such as compaction summaries).
   */
  headersFor({ sessionId, requestId, forcedTurnType }) {
    const headers = {};
    if (typeof sessionId === "string" && sessionId !== "") {
      headers[SESSION_ID_HEADER] = sessionId;
      if (this.endedSessions.has(sessionId)) headers[SESSION_DONE_HEADER] = "1";
    }
    const turnType = forcedTurnType ?? turnTypeForTrigger(this.triggerFor({ sessionId, requestId }));
    if (turnType) headers[TURN_TYPE_HEADER] = turnType;
    return headers;
  }
}
