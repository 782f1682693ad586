// The API as the dashboard calls it: the key from sessionStorage in an Authorization header on
// every call, atoll's error envelope turned into ApiError, NDJSON streams read with fetch (an
// EventSource cannot send the header), and the admin's chosen tenant as ?tenant_id=.
const KEY = "atoll.key";
const TENANT = "atoll.tenant";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  set key(v) { v ? sessionStorage.setItem(KEY, v) : sessionStorage.removeItem(KEY); },
  get tenant() { return sessionStorage.getItem(TENANT) || ""; },
  set tenant(v) { v ? sessionStorage.setItem(TENANT, v) : sessionStorage.removeItem(TENANT); },
  whoami: null,
  onUnauthorized: null, // set by main: a 401 signs out with a message
};

function withTenant(path) {
  const t = session.whoami && session.whoami.scope === "admin" ? session.tenant : "";
  if (!t || path.includes("tenant_id=") || !path.startsWith("/v1/") || path.startsWith("/v1/tenants") || path.startsWith("/v1/workers")) return path;
  return path + (path.includes("?") ? "&" : "?") + "tenant_id=" + encodeURIComponent(t);
}

async function failure(r) {
  let code = "http_" + r.status, message = `${r.status} ${r.statusText}`;
  try {
    const body = await r.json();
    if (body && body.error) ({ code, message } = body.error);
  } catch { /* not JSON */ }
  const err = new ApiError(r.status, code, message);
  if (r.status === 401 && session.onUnauthorized) session.onUnauthorized(err);
  return err;
}

export async function raw(path, opts = {}, key = session.key) {
  const headers = { ...(opts.headers || {}), Authorization: "Bearer " + key };
  const r = await fetch(withTenant(path), { ...opts, headers });
  if (!r.ok) throw await failure(r);
  return r;
}

export async function get(path, opts) {
  const r = await raw(path, opts);
  return r.status === 204 ? null : r.json();
}

export async function send(method, path, body) {
  const opts = { method };
  if (body !== undefined) {
    opts.body = JSON.stringify(body);
    opts.headers = { "Content-Type": "application/json" };
  }
  const r = await raw(path, opts);
  return r.status === 204 ? null : r.json();
}

// Every page of a paged list (items, next_cursor).
export async function all(path, limit = 500) {
  const items = [];
  let cursor = null;
  do {
    const sep = path.includes("?") ? "&" : "?";
    const page = await get(path + sep + "limit=" + limit + (cursor ? "&cursor=" + encodeURIComponent(cursor) : ""));
    items.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor);
  return items;
}

// Reads an NDJSON answer line by line, calling onLine(obj) for each, until it ends or `signal`
// aborts it. Resolves when the stream ends.
export async function ndjson(path, onLine, signal) {
  const r = await raw(path, { signal, headers: { Accept: "application/x-ndjson" } });
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    const lines = buf.split("\n");
    buf = lines.pop(); // the unfinished line, if any
    for (const line of lines) if (line.trim()) onLine(JSON.parse(line));
  }
}

// Reads a text answer in chunks (a build log), calling onText(str) per chunk.
export async function textStream(path, onText, signal) {
  const r = await raw(path, { signal });
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    onText(dec.decode(value, { stream: true }));
  }
}

export function wsUrl(path) {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return proto + "//" + location.host + path;
}
