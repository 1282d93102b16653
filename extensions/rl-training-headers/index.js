/**
 * OpenClaw plugin: tag model requests to clawrl providers with the session they belong to, whether
 * the user drove the turn, and when the session ended.
 *
 * clawrl trains on what the user said and did next; a heartbeat poll or a memory flush is OpenClaw
 * talking to itself and must never be trained as a user turn. Stock OpenClaw sends no session
 * information, so this plugin adds it:
 *
 * - provider hooks on each configured provider id (default `clawrl`):
 *   `wrapStreamFn` (agent runs) and `wrapSimpleCompletionStreamFn` (one-shot completions) add the
 *   headers per request; `resolveTransportTurnState` adds `X-Session-Id` on every transport path.
 * - typed agent hooks learn why each run exists: `before_model_resolve` (`ctx.trigger`), and when
 *   sessions end: `session_end`, `before_reset`.
 */
import { definePluginEntry } from "openclaw/plugin-sdk/plugin-entry";
import { RunLedger, resolveProviderIds, SESSION_ID_HEADER } from "./lib/run-ledger.js";

function withHeaders(streamFn, headersOf) {
  return (model, context, options) =>
    streamFn(model, context, { ...options, headers: { ...options?.headers, ...headersOf(options ?? {}) } });
}

export default definePluginEntry({
  id: "rl-training-headers",
  name: "clawrl training headers",
  description: "Adds X-Session-Id, X-Turn-Type and X-Session-Done to model requests sent to clawrl providers.",
  register(api) {
    const providerIds = resolveProviderIds(api.pluginConfig);
    const ledger = new RunLedger();

    // Needs plugins.entries.rl-training-headers.hooks.allowConversationAccess=true (OpenClaw gates
    // every hook that carries the run trigger). Without it X-Turn-Type is omitted, never guessed.
    api.on("before_model_resolve", (_event, ctx) => {
      ledger.noteRun(ctx);
    });
    api.on("agent_end", (_event, ctx) => {
      ledger.forgetRun(ctx?.runId);
    });
    api.on("session_end", (event, ctx) => {
      ledger.noteSessionEnded(event?.sessionId ?? ctx?.sessionId, event?.reason);
      api.logger?.info?.(`rl-training-headers: session ${event?.sessionId} ended (${event?.reason ?? "unknown"})`);
    });
    api.on("before_reset", (event, ctx) => {
      ledger.noteSessionEnded(ctx?.sessionId, event?.reason ?? "reset");
    });

    for (const id of providerIds) {
      api.registerProvider({
        id,
        label: `${id} (clawrl training headers)`,
        auth: [],
        wrapStreamFn: (ctx) =>
          ctx.streamFn
            ? withHeaders(ctx.streamFn, (options) =>
                ledger.headersFor({ sessionId: options.sessionId, requestId: options.requestId }))
            : undefined,
        wrapSimpleCompletionStreamFn: (ctx) =>
          ctx.streamFn
            ? withHeaders(ctx.streamFn, (options) =>
                ledger.headersFor({ sessionId: options.sessionId, forcedTurnType: "side" }))
            : undefined,
        resolveTransportTurnState: (ctx) =>
          ctx.sessionId ? { headers: { [SESSION_ID_HEADER]: ctx.sessionId } } : undefined,
      });
    }
    api.logger?.info?.(`rl-training-headers: tagging requests to provider(s) ${providerIds.join(", ")}`);
  },
});
