// The caller's sandboxes, kept live by one GET /v1/sandboxes/watch stream (NDJSON over fetch)
// from sign-in to sign-out: pages read `store.sandboxes` and subscribe to changes. Each change of
// a sandbox seen here is also kept as a timeline entry (what the sandbox page shows).
import { ndjson, ApiError } from "./api.js";

const listeners = new Set();
let pending = null;

export const store = {
  sandboxes: new Map(),
  timelines: new Map(), // id -> [{at, text}]
  deleted: new Set(),
  synced: false,
  status: "connecting",
  error: null,
};

function notify() {
  if (pending) return;
  pending = requestAnimationFrame(() => {
    pending = null;
    for (const fn of listeners) fn();
  });
}

export function subscribe(fn) {
  listeners.add(fn);
  return () => listeners.delete(fn);
}

function describe(prev, sb) {
  if (!prev) return sb.state === "creating" ? "creating" : `${store.synced ? "created" : "seen"}: ${sb.state}`;
  if (prev.state === sb.state && prev.standby_tier === sb.standby_tier) {
    if (sb.failure_reason && sb.failure_reason !== prev.failure_reason) return "failed: " + sb.failure_reason;
    return null;
  }
  switch (sb.state) {
    case "standby":
      return `paused to the ${sb.standby_tier} tier` + (sb.standby_reason ? ` (${sb.standby_reason})` : "");
    case "running":
      return prev.state === "standby" ? `resumed from the ${prev.standby_tier} tier` : "running";
    case "failed":
      return "failed" + (sb.failure_reason ? ": " + sb.failure_reason : "");
    case "deleted":
      return "deleted";
    default:
      return sb.state;
  }
}

function apply(sb) {
  const prev = store.sandboxes.get(sb.id);
  const text = describe(prev, sb);
  if (text) {
    const t = store.timelines.get(sb.id) || [];
    t.push({ at: new Date().toISOString(), text });
    store.timelines.set(sb.id, t);
  }
  if (sb.state === "deleted") {
    store.sandboxes.delete(sb.id);
    store.deleted.add(sb.id);
  } else {
    store.sandboxes.set(sb.id, sb);
  }
}

let controller = null;

export function start() {
  stop();
  const mine = (controller = new AbortController());
  store.sandboxes.clear();
  store.synced = false;
  let retry = 1000;
  const run = async () => {
    while (!mine.signal.aborted) {
      store.status = "connecting";
      notify();
      const fresh = new Map();
      let syncedOnce = false;
      if (!store.synced) store.sandboxes = new Map(); // a first snapshot cut short: start it again
      try {
        await ndjson("/v1/sandboxes/watch", (line) => {
          if (line.type === "sandbox") {
            if (syncedOnce) apply(line.sandbox);
            else if (!store.synced) store.sandboxes.set(line.sandbox.id, line.sandbox); // shown as it comes
            else fresh.set(line.sandbox.id, line.sandbox);
          } else if (line.type === "synced") {
            syncedOnce = true;
            if (store.synced) { // a reconnect's snapshot replaces what was known; what vanished meanwhile was deleted
              for (const id of [...store.sandboxes.keys()]) if (!fresh.has(id)) apply({ ...store.sandboxes.get(id), state: "deleted" });
              for (const sb of fresh.values()) apply(sb);
            }
            store.synced = true;
            store.status = "live";
            store.error = null;
            retry = 1000;
          }
          if (syncedOnce || !store.synced) notify();
        }, mine.signal);
      } catch (e) {
        if (mine.signal.aborted) return;
        if (e instanceof ApiError && e.status === 401) return; // signed out by api.js
        store.error = e.message;
      }
      if (mine.signal.aborted) return;
      store.status = "reconnecting";
      notify();
      await new Promise((ok) => setTimeout(ok, retry));
      retry = Math.min(retry * 2, 15000);
    }
  };
  run();
}

export function stop() {
  if (controller) controller.abort();
  controller = null;
}

// A change the page made itself (an answer of pause/resume) shows at once, before the stream has it.
export function put(sb) {
  apply(sb);
  notify();
}
