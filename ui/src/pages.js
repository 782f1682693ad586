// The other pages: templates with their builds' logs (streamed), pools, volumes and drives,
// secrets (names and hosts only: the API never answers values), workers (admin), usage charts.
import { h, clear, fmtTime, fmtBytes, fmtNum } from "./dom.js";
import { get, all, textStream, session } from "./api.js";
import { barChart } from "./chart.js";

function table(label, columns, rows) {
  if (!rows.length) return h("p", { class: "muted" }, `No ${label.toLowerCase()}.`);
  return h("div", { class: "scroll-x" }, h("table", { "aria-label": label },
    h("thead", {}, h("tr", {}, columns.map(([t]) => h("th", {}, t)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, columns.map(([, f]) => h("td", {}, f(r))))))));
}

function page(main, title, load) {
  const body = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  const reload = () => load(body).catch((e) => clear(body, h("p", { class: "result bad", role: "alert" }, `${e.code || "error"}: ${e.message}`)));
  clear(main, h("div", { class: "toolbar" }, h("h1", {}, title), h("span", { class: "spacer" }),
    h("button", { onclick: reload }, "Refresh")), body);
  reload();
  return () => {};
}

const MAX_LOG_CHARS = 4 << 20;

export function templatesPage(main) {
  let abort = null;
  const log = h("pre", { class: "log", hidden: true, "aria-label": "Build log", "aria-live": "off" });
  const logTitle = h("h2", { hidden: true });
  function showLog(t) {
    if (abort) abort.abort();
    abort = new AbortController();
    log.hidden = logTitle.hidden = false;
    logTitle.textContent = `Build ${t.build_id} of ${t.name}`;
    log.textContent = "";
    let buf = "", total = 0, scheduled = false;
    const flush = () => {
      scheduled = false;
      total += buf.length;
      log.append(buf);
      buf = "";
      if (total > MAX_LOG_CHARS) { // keep the page responsive on a huge log: drop its head
        log.textContent = "[… earlier output dropped …]\n" + log.textContent.slice(-MAX_LOG_CHARS / 2);
        total = log.textContent.length;
      }
      log.scrollTop = log.scrollHeight;
    };
    textStream(`/v1/templates/${encodeURIComponent(t.name)}/builds/${t.build_id}/logs`, (chunk) => {
      buf += chunk;
      if (!scheduled) { scheduled = true; requestAnimationFrame(flush); }
    }, abort.signal).then(() => { flush(); log.append("\n[end of log]\n"); })
      .catch((e) => { if (e.name !== "AbortError") log.append(`\n[${e.code || "error"}: ${e.message}]\n`); });
  }
  const cleanup = page(main, "Templates", async (body) => {
    const items = await all("/v1/templates");
    const detailed = items;
    clear(body, table("Templates", [
      ["Name", (t) => h("span", { class: "mono" }, t.name)],
      ["Status", (t) => h("span", { class: "badge status-" + t.status }, t.status)],
      ["Progress / error", (t) => t.error || t.progress || ""],
      ["Built", (t) => fmtTime(t.built_at || t.created_at)],
      ["Size", (t) => fmtBytes(t.size_bytes)],
      ["Build", (t) => t.build_id ? h("button", { class: "small", onclick: () => showLog(t) }, "Log " + t.build_id) : "built in"],
    ], detailed), logTitle, log);
  });
  return () => { if (abort) abort.abort(); cleanup(); };
}

export function poolsPage(main) {
  return page(main, "Pools", async (body) => {
    const templates = (await all("/v1/templates")).filter((t) => t.status !== "missing");
    const poolOf = (t) => get(`/v1/templates/${encodeURIComponent(t.name)}/pool` + (t.tenant_id && session.whoami.scope === "admin" ? "?tenant_id=" + encodeURIComponent(t.tenant_id) : ""))
      .then((p) => ({ ...p, tenant_id: t.tenant_id }), () => null);
    const pools = (await Promise.all(templates.map(poolOf))).filter(Boolean);
    clear(body, table("Pools", [
      ["Template", (p) => h("span", { class: "mono" }, p.template)],
      ["Min – max", (p) => `${p.min} – ${p.max}`],
      ["Desired now", (p) => p.desired],
      ["Ready", (p) => p.ready],
      ["Starting (refill)", (p) => p.starting],
      ["Claimed", (p) => p.claimed],
      ["Schedule", (p) => (p.schedule || []).map((s) => `${s.from}–${s.to}: ${s.min}`).join(", ")],
      ["Last error", (p) => p.last_error || ""],
    ], pools));
  });
}

export function storesPage(main) {
  return page(main, "Volumes & drives", async (body) => {
    const [volumes, drives] = await Promise.all([all("/v1/volumes"), all("/v1/drives")]);
    const size = (s) => `${fmtNum(s.used_mb, 1)} / ${s.size_mb} MB`;
    clear(body,
      h("h2", {}, "Volumes"),
      table("Volumes", [["Name", (v) => v.name], ["Used / size", size], ["Attached to", (v) => v.attached_to ? h("a", { href: "#/sandboxes/" + v.attached_to }, v.attached_to) : "—"], ["Worker", (v) => v.worker_id], ["Created", (v) => fmtTime(v.created_at)]], volumes),
      h("h2", {}, "Drives"),
      table("Drives", [["Name", (d) => d.name], ["Used / size", size], ["Mounted by", (d) => d.attached_to.length ? d.attached_to.join(", ") : "—"], ["Worker", (d) => d.worker_id], ["Created", (d) => fmtTime(d.created_at)]], drives));
  });
}

export function secretsPage(main) {
  return page(main, "Secrets", async (body) => {
    const secrets = await all("/v1/secrets");
    clear(body, h("p", { class: "help" }, "Names and the hosts each is sent to; values are never shown (the API does not answer them)."),
      table("Secrets", [
        ["Name", (s) => h("span", { class: "mono" }, s.name)],
        ["Tenant", (s) => s.tenant_id || ""],
        ["Hosts", (s) => s.hosts.join(", ")],
        ["Plain HTTP", (s) => (s.allow_http ? "yes" : "no")],
        ["Updated", (s) => fmtTime(s.updated_at)],
      ], secrets));
  });
}

export function workersPage(main) {
  return page(main, "Workers", async (body) => {
    const workers = await all("/v1/workers");
    const cap = (w) => `${w.allocated.cpus ?? "?"} / ${w.capacity.cpus ?? "?"} CPU, ${w.allocated.memory_mb ?? "?"} / ${w.capacity.memory_mb ?? "?"} MB`;
    clear(body, table("Workers", [
      ["Name", (w) => h("span", { class: "mono" }, w.name)],
      ["State", (w) => h("span", { class: "badge worker-" + w.state }, w.state)],
      ["Why", (w) => w.state_reason || ""],
      ["Allocated / capacity", cap],
      ["Sandboxes", (w) => w.sandboxes],
      ["Drain", (w) => w.state === "draining" ? (w.evacuated ? "evacuated" : "evacuating") : ""],
    ], workers));
  });
}

const COMPUTE = ["cpu_seconds", "memory_gb_seconds"];
const RETAINED = ["standby_memory_gb_seconds", "snapshot_gb_seconds", "volume_gb_seconds", "drive_gb_seconds"];

export function usagePage(main) {
  return page(main, "Usage", async (body) => {
    const to = new Date();
    const from = new Date(to.getTime() - 30 * 86400e3);
    const range = `from=${from.toISOString().slice(0, 10)}&to=${encodeURIComponent(to.toISOString())}`;
    const days = await get(`/v1/usage?group_by=day&${range}`);
    const admin = session.whoami.scope === "admin" && !session.tenant;
    const tenants = admin ? await get(`/v1/usage?group_by=tenant&${range}`) : null;
    const sum = (it, keys) => keys.reduce((a, k) => a + (it[k] || 0), 0);
    const bars = days.items.map((d) => ({ label: d.day, short: d.day.slice(5), parts: [sum(d, COMPUTE), sum(d, RETAINED)] }));
    const cols = [
      ["CPU s", (u) => fmtNum(u.cpu_seconds)],
      ["Memory GB·s", (u) => fmtNum(u.memory_gb_seconds)],
      ["Standby memory GB·s", (u) => fmtNum(u.standby_memory_gb_seconds)],
      ["Snapshot GB·s", (u) => fmtNum(u.snapshot_gb_seconds)],
      ["Volumes + drives GB·s", (u) => fmtNum(u.volume_gb_seconds + u.drive_gb_seconds)],
      ["Egress", (u) => fmtBytes(u.egress_bytes)],
      ["Build s", (u) => fmtNum(u.build_seconds)],
      ["Cost", (u) => fmtNum(u.cost, 4)],
    ];
    clear(body,
      h("p", { class: "help" }, `The last 30 days (${days.from} to ${days.to}), UTC.`),
      barChart("Per day: compute (CPU s + memory GB·s) vs retained state (GB·s)", bars, ["compute", "retained"]),
      tenants ? barChart("Per tenant: compute vs retained state", tenants.items.map((t) => ({ label: t.tenant_id, short: t.tenant_id.length > 14 ? "…" + t.tenant_id.slice(-12) : t.tenant_id, parts: [sum(t, COMPUTE), sum(t, RETAINED)] })), ["compute", "retained"]) : null,
      h("h2", {}, "Per day"),
      table("Usage per day", [["Day", (u) => u.day], ...cols], days.items),
      tenants ? [h("h2", {}, "Per tenant"), table("Usage per tenant", [["Tenant", (u) => u.tenant_id], ...cols], tenants.items)] : null,
      h("h2", {}, "Total"),
      table("Usage total", cols, [days.total]));
  });
}
