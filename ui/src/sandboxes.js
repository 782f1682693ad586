// The sandboxes table: every sandbox of the watch stream (store.js), filtered by state, tier,
// template, worker and metadata, with counts by state and tier. Virtualised: only the rows in
// view are in the DOM, so 10,000 sandboxes scroll without freezing the page.
import { h, clear, fmtTime, resultLine } from "./dom.js";
import { send } from "./api.js";
import { store, subscribe, put } from "./store.js";

const ROW_H = 34;
const STATES = ["creating", "running", "standby", "failed"];
const TIERS = ["memory", "disk", "archive"];
const COLUMNS = [
  ["Id", "id"], ["State", "state"], ["Tier", "tier"], ["Template", "template"],
  ["Worker", "worker"], ["Metadata", "metadata"], ["Created", "created"],
];

function parseMetadata(text) {
  const want = [];
  for (const part of text.split(/[,\s]+/)) {
    if (!part) continue;
    const eq = part.indexOf("=");
    want.push(eq < 0 ? [part, null] : [part.slice(0, eq), part.slice(eq + 1)]);
  }
  return want;
}

export function sandboxesPage(main) {
  const f = { state: "", tier: "", template: "", worker: "", metadata: "" };
  const select = (id, label, values) => {
    const s = h("select", { id: "f-" + id, onchange: () => { f[id] = s.value; render(true); } },
      h("option", { value: "" }, "any"), values.map((v) => h("option", { value: v }, v)));
    return [h("label", { for: "f-" + id }, label), s];
  };
  const [stateLabel, stateSel] = select("state", "State", STATES);
  const [tierLabel, tierSel] = select("tier", "Tier", TIERS);
  const [tplLabel, tplSel] = select("template", "Template", []);
  const [wkLabel, wkSel] = select("worker", "Worker", []);
  const md = h("input", {
    id: "f-metadata", placeholder: "key=value", size: 16,
    oninput: () => { f.metadata = md.value; render(true); },
  });
  const counts = h("div", { class: "counts", "aria-label": "Counts" });
  const shown = h("span", { class: "muted" });
  const result = resultLine();
  const createBtn = h("button", {
    onclick: async () => {
      createBtn.disabled = true;
      result.show("Creating a sandbox…");
      const t0 = performance.now();
      try {
        const sb = await send("POST", "/v1/sandboxes", {});
        put(sb);
        result.show(`Created ${sb.id} (${sb.state}) in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
      } catch (e) {
        result.show(`Create failed: ${e.code}: ${e.message}`, false);
      }
      createBtn.disabled = false;
    },
  }, "New sandbox");

  const header = h("div", { class: "vrow head", role: "row" }, COLUMNS.map(([t]) => h("span", { role: "columnheader" }, t)));
  const spacer = h("div", { class: "spacer-rows" });
  const body = h("div", { class: "vbody", role: "rowgroup" });
  const scroller = h("div", { class: "vscroll", tabindex: "0", "aria-label": "Sandboxes, scrollable" }, spacer, body);
  const table = h("div", { class: "vtable", role: "table", "aria-label": "Sandboxes", "aria-rowcount": "0" }, header, scroller);
  const empty = h("p", { class: "muted empty" });

  clear(main,
    h("div", { class: "toolbar" }, h("h1", {}, "Sandboxes"), shown, h("span", { class: "spacer" }), createBtn),
    result,
    counts,
    h("div", { class: "filters", role: "search" }, stateLabel, stateSel, tierLabel, tierSel, tplLabel, tplSel, wkLabel, wkSel,
      h("label", { for: "f-metadata" }, "Metadata"), md),
    table,
    empty,
  );

  let rows = [];
  let knownTemplates = "", knownWorkers = "";

  function refreshOptions(sel, values, known) {
    const key = values.join("\n");
    if (key === known) return known;
    const cur = sel.value;
    clear(sel, h("option", { value: "" }, "any"), values.map((v) => h("option", { value: v }, v)));
    sel.value = values.includes(cur) ? cur : "";
    return key;
  }

  function render(filtersChanged) {
    const all = [...store.sandboxes.values()];
    const byState = {}, byTier = {};
    const templates = new Set(), workers = new Set();
    for (const sb of all) {
      byState[sb.state] = (byState[sb.state] || 0) + 1;
      if (sb.standby_tier) byTier[sb.standby_tier] = (byTier[sb.standby_tier] || 0) + 1;
      templates.add(sb.template);
      if (sb.worker) workers.add(sb.worker);
    }
    knownTemplates = refreshOptions(tplSel, [...templates].sort(), knownTemplates);
    knownWorkers = refreshOptions(wkSel, [...workers].sort(), knownWorkers);
    clear(counts,
      h("span", { class: "chip" }, "total ", h("b", {}, all.length)),
      STATES.map((s) => h("span", { class: "chip state-" + s }, s + " ", h("b", {}, byState[s] || 0))),
      TIERS.map((t) => h("span", { class: "chip" }, t + " tier ", h("b", {}, byTier[t] || 0))),
    );
    const want = parseMetadata(f.metadata);
    rows = all.filter((sb) =>
      (!f.state || sb.state === f.state) &&
      (!f.tier || sb.standby_tier === f.tier) &&
      (!f.template || sb.template === f.template) &&
      (!f.worker || sb.worker === f.worker) &&
      want.every(([k, v]) => (v === null ? k in (sb.metadata || {}) : (sb.metadata || {})[k] === v)));
    rows.sort((a, b) => (a.created_at < b.created_at ? 1 : a.created_at > b.created_at ? -1 : a.id < b.id ? 1 : -1));
    shown.textContent = rows.length === all.length ? `${all.length} sandboxes` : `${rows.length} of ${all.length} shown`;
    table.setAttribute("aria-rowcount", String(rows.length + 1));
    spacer.style.height = rows.length * ROW_H + "px";
    empty.textContent = !store.synced ? (all.length ? `Loading… (${all.length} so far)` : "Loading…") : rows.length ? "" : all.length ? "No sandbox matches these filters." : "No sandboxes yet.";
    if (filtersChanged) scroller.scrollTop = 0;
    paint();
  }

  function cell(text, cls) {
    return h("span", { role: "cell", class: cls }, text);
  }

  function paint() {
    const top = scroller.scrollTop;
    const height = scroller.clientHeight || 600;
    const first = Math.max(0, Math.floor(top / ROW_H) - 5);
    const last = Math.min(rows.length, Math.ceil((top + height) / ROW_H) + 5);
    const out = [];
    for (let i = first; i < last; i++) {
      const sb = rows[i];
      const md = Object.entries(sb.metadata || {}).map(([k, v]) => k + "=" + v).join(" ");
      out.push(h("div", { class: "vrow", role: "row", "aria-rowindex": String(i + 2), style: `top:${i * ROW_H}px` },
        h("span", { role: "cell", class: "mono" }, h("a", { href: "#/sandboxes/" + sb.id }, sb.id)),
        cell(sb.state, "badge state-" + sb.state),
        cell(sb.standby_tier || ""),
        cell(sb.template),
        cell(sb.worker || ""),
        cell(md, "md"),
        cell(fmtTime(sb.created_at), "muted"),
      ));
    }
    body.replaceChildren(...out);
  }

  let ticking = false;
  scroller.addEventListener("scroll", () => {
    if (ticking) return;
    ticking = true;
    requestAnimationFrame(() => { ticking = false; paint(); });
  });
  const ro = new ResizeObserver(() => paint());
  ro.observe(scroller);
  const unsub = subscribe(() => render(false));
  render(false);
  return () => { unsub(); ro.disconnect(); };
}
