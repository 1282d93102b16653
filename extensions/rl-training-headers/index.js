/**
 * OpenClaw plugin: tag model requests to clawrl providers with the session they belong to, whether
 * the user drove the turn, and when the session ended.
 *
 * clawrl trains on what the user said and did next; a heartbeat poll or a memory flush is OpenClaw
 * talking to itself and must never be trained as a user turn. Stock OpenClaw sends no session
 * information, so this plugin adds it:
 *
 * - provider hooks on each configured provider id (default `clawrl`): `wrapStreamFn` (agent runs)
 *   and `wrapSimpleCompletionStreamFn` (one-shot completions, always `side`) add the headers per
 *   request; `resolveTransportTurnState` adds `X-Session-Id` on every other transport path.
 * - typed agent hooks learn why each run exists (`before_model_resolve`: `ctx.trigger`) and when a
 *   session ends (`before_reset`, `session_end`), upon which one closing request is sent.
 */
import { definePluginEntry } from "openclaw/plugin-sdk/plugin-entry";
import { RunLedger, resolveProviderIds, sessionCloseRequest, SESSION_ID_HEADER } from "./lib/run-ledger.js";

// OpenClaw may register a plugin more than once per process (Gateway hooks and provider runtime);
// one ledger per process lets a hook seen by one registration inform requests made by another.
const LEDGER_KEY = Symbol.for("clawrl.rl-training-headers.ledger");
const ledger = (globalThis[LEDGER_KEY] ??= new RunLedger());

function withHeaders(streamFn, headersOf) {
  return (model, context, options) =>
    streamFn(model, context, { ...options, headers: { ...options?.headers, ...headersOf(options ?? {}) } });
}

/** "provider/model" of the agents' default model, the fallback when a session's last run is unknown. */
function defaultModelRef(config) {
  const primary = config?.agents?.defaults?.model;
  const ref = typeof primary === "string" ? primary : primary?.primary;
  const slash = typeof ref === "string" ? ref.indexOf("/") : -1;
  return slash > 0 ? { provider: ref.slice(0, slash), model: ref.slice(slash + 1) } : {};
}

export default definePluginEntry({
  id: "rl-training-headers",
  name: "clawrl training headers",
  description: "Adds X-Session-Id, X-Turn-Type and X-Session-Done to model requests sent to clawrl providers.",
  register(api) {
    const providerIds = resolveProviderIds(api.pluginConfig);
    const log = api.logger;

    async function closeSession(sessionId, reason) {
      const lastRun = ledger.claimClose(sessionId);
      if (lastRun === null) return;
      const { provider, model } = lastRun.provider ? lastRun : defaultModelRef(api.config);
      if (!providerIds.includes(provider)) {
        log?.info?.(`rl-training-headers: session ${sessionId} ended (${reason}); its model ${provider ?? "unknown"} is not a clawrl provider, nothing sent`);
        return;
      }
      const baseUrl = api.config?.models?.providers?.[provider]?.baseUrl;
      if (!baseUrl) {
        log?.warn?.(`rl-training-headers: session ${sessionId} ended but provider ${provider} has no baseUrl; X-Session-Done not sent`);
        return;
      }
      try {
        const auth = await api.runtime.modelAuth.resolveApiKeyForProvider({ provider, cfg: api.config });
        const { url, init } = sessionCloseRequest({ baseUrl, apiKey: auth?.apiKey, model, sessionId, reason });
        const response = await fetch(url, { ...init, signal: AbortSignal.timeout(30_000) });
        await response.arrayBuffer();
        log?.info?.(`rl-training-headers: session ${sessionId} ended (${reason}); X-Session-Done sent to ${provider}, HTTP ${response.status}`);
      } catch (error) {
        log?.warn?.(`rl-training-headers: session ${sessionId} ended (${reason}); X-Session-Done failed: ${error?.message ?? error}`);
      }
    }

    // OpenClaw gates every hook that carries the run trigger behind
    // plugins.entries.rl-training-headers.hooks.allowConversationAccess=true. Without it these are
    // not registered, X-Turn-Type is omitted (never guessed) and closes use the default model.
    api.on("before_model_resolve", (_event, ctx) => {
      ledger.noteRun(ctx);
    });
    api.on("agent_end", (_event, ctx) => {
      ledger.forgetRun(ctx?.runId);
    });
    api.on("before_reset", (event, ctx) => closeSession(ctx?.sessionId, event?.reason ?? "reset"));
    api.on("session_end", (event, ctx) => closeSession(event?.sessionId ?? ctx?.sessionId, event?.reason ?? "unknown"));

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
    log?.info?.(`rl-training-headers: tagging requests to provider(s) ${providerIds.join(", ")}`);
  },
});
