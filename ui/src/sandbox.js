// One sandbox: its settings and state (live from the watch stream), pause / resume / fork / delete
// with what each did, its timeline, metrics charts, a terminal, a files browser and its
// background processes. Panels that reach the sandbox (files, processes) load on request only:
// listing files resumes a sandbox in standby, and looking at its page should not.
import { h, clear, fmtTime, fmtBytes, fmtNum, resultLine } from "./dom.js";
import { get, send, raw, ndjson, ApiError } from "./api.js";
import { store, subscribe, put } from "./store.js";

import { filesPanel } from "./files.js";
import { lineChart } from "./chart.js";

export function sandboxPage(main, sid) {
  document.title = sid + " · atoll";
  const stops = [];
  const title = h("h1", { class: "mono" }, sid);
  const badge = h("span", { class: "badge" });
  const banner = h("div", { role: "alert", class: "banner", hidden: true });
  const result = resultLine();
  const termStatus = resultLine();
  const info = h("dl", { class: "info" });
  const timeline = h("ol", { class: "timeline", "aria-label": "Timeline" });
  const charts = h("div", { class: "charts" });
  const actions = h("div", { class: "actions" });
  const termBox = h("div", { class: "term-box" });
  const procsBox = h("div", {});
  const filesBox = h("div", {});
  let sb = store.sandboxes.get(sid) || null;
  let term = null;
  let gone = false;

  const tierSel = h("select", { id: "pause-tier", "aria-label": "Standby tier" },
    ["memory", "disk", "archive"].map((t) => h("option", { value: t }, t)));
  const act = (label, fn) => h("button", {
    onclick: async (ev) => {
      const btn = ev.currentTarget;
      btn.disabled = true;
      const t0 = performance.now();
      result.show(label + "…");
      try {
        const text = await fn();
        result.show(`${text} (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
      } catch (e) {
        result.show(`${label} failed: ${e.code || "error"}: ${e.message}`, false);
      }
      btn.disabled = false;
      update();
    },
  }, label);
  const pauseBtn = act("Pause", async () => {
    let closedTerminal = false;
    if (term) { // an attached terminal is activity: the pause would be refused as busy
      await term.close();
      term = null;
      closedTerminal = true;
      termBtn.textContent = "Open terminal";
      termStatus.show("Terminal closed by the pause (opening one resumes the sandbox).");
    }
    let r;
    for (let attempt = 0; ; attempt++) {
      try {
        r = await send("POST", `/v1/sandboxes/${sid}/pause`, { tier: tierSel.value });
        break;
      } catch (e) { // the server may still be letting go of the terminal just closed
        if (!(closedTerminal && e.code === "sandbox_busy" && attempt < 5)) throw e;
        await new Promise((ok) => setTimeout(ok, 300));
      }
    }
    put(r);
    return `Paused: ${r.state}, ${r.standby_tier} tier` + (r.standby_reason ? ` — ${r.standby_reason}` : "");
  });
  const resumeBtn = act("Resume", async () => {
    const r = await send("POST", `/v1/sandboxes/${sid}/resume`);
    put(r);
    return `Resumed: ${r.state}`;
  });
  const forkBtn = act("Fork", async () => {
    const r = await send("POST", `/v1/sandboxes/${sid}/fork`, { count: 1 });
    for (const c of r.items) put(c);
    return "Forked: " + r.items.map((c) => c.id).join(", ");
  });
  const deleteBtn = act("Delete", async () => {
    if (!confirm(`Delete ${sid}? Its files and processes are lost.`)) throw new Error("not deleted");
    await send("DELETE", `/v1/sandboxes/${sid}`);
    put({ ...(sb || { id: sid }), state: "deleted" });
    return "Deleted";
  });
  actions.append(h("label", { for: "pause-tier" }, "Tier"), tierSel, pauseBtn, resumeBtn, forkBtn, deleteBtn);

  const termBtn = h("button", {
    onclick: async () => {
      termBtn.disabled = true;
      if (term) term.close();
      term = null;
      try {
        const { openTerminal } = await import("./terminal.js");
        term = await openTerminal(termBox, sid, (msg, ok) => termStatus.show(msg, ok));
        termBtn.textContent = "Open a new terminal";
      } catch (e) {
        termStatus.show(`Terminal failed: ${e.code || "error"}: ${e.message}`, false);
      }
      termBtn.disabled = gone;
    },
  }, "Open terminal");
  stops.push(() => term && term.close());
  const procsBtn = h("button", { onclick: () => loadProcs() }, "Load processes");

  clear(main,
    h("p", {}, h("a", { href: "#/sandboxes" }, "← Sandboxes")),
    h("div", { class: "toolbar" }, title, badge),
    banner,
    actions,
    result,
    h("div", { class: "cols" },
      h("section", { "aria-labelledby": "h-info" }, h("h2", { id: "h-info" }, "Settings"), info),
      h("section", { "aria-labelledby": "h-timeline" }, h("h2", { id: "h-timeline" }, "Timeline"), timeline),
    ),
    h("section", { "aria-labelledby": "h-metrics" }, h("h2", { id: "h-metrics" }, "Metrics"), charts),
    h("section", { "aria-labelledby": "h-term" }, h("h2", { id: "h-term" }, "Terminal"),
      h("p", { class: "help" }, "Opening a terminal resumes a sandbox in standby; pausing closes it. Tab completes in the shell; Shift+Tab leaves the terminal."), termBtn, termStatus, termBox),
    h("section", { "aria-labelledby": "h-files" }, h("h2", { id: "h-files" }, "Files"), filesBox),
    h("section", { "aria-labelledby": "h-procs" }, h("h2", { id: "h-procs" }, "Background processes"), procsBtn, procsBox),
  );

  filesPanel(filesBox, sid, () => sb, (msg, ok) => result.show(msg, ok));

  function row(k, v) {
    return [h("dt", {}, k), h("dd", {}, v === null || v === undefined || v === "" ? "—" : v)];
  }

  function update() {
    const cur = store.sandboxes.get(sid);
    if (cur) sb = cur;
    if (store.deleted.has(sid) && !cur) gone = true;
    if (gone) {
      banner.hidden = false;
      banner.textContent = `${sid} was deleted. Its page stays for reference; nothing here can act on it any more.`;
      for (const b of main.querySelectorAll("button")) b.disabled = true;
      badge.textContent = "deleted";
      badge.className = "badge state-deleted";
    }
    if (!sb) return;
    if (!gone) {
      badge.textContent = sb.state + (sb.standby_tier ? ` (${sb.standby_tier})` : "");
      badge.className = "badge state-" + sb.state;
      pauseBtn.disabled = sb.state !== "running";
      resumeBtn.disabled = sb.state !== "standby";
      forkBtn.disabled = sb.state !== "running";
    }
    clear(info,
      row("Tenant", sb.tenant_id),
      row("Template", sb.template + (sb.build_id ? ` (build ${sb.build_id})` : "")),
      row("Worker", sb.worker ? `${sb.worker} (${sb.worker_state})` : sb.worker_id),
      row("Resources", `${sb.cpus} CPU, ${sb.memory_mb} MB memory, ${sb.disk_mb} MB disk`),
      row("Standby after", `${sb.idle_timeout_s} s idle (memory), ${sb.disk_after_s} s (disk)`),
      row("Standby reason", sb.standby_reason),
      row("Failure reason", sb.failure_reason),
      row("Resume error", sb.resume_error),
      row("Metadata", Object.entries(sb.metadata || {}).map(([k, v]) => `${k}=${v}`).join(", ")),
      row("Secrets", Object.entries(sb.secrets || {}).map(([k, v]) => `${k} ← ${v}`).join(", ")),
      row("Egress", `${sb.egress.allowed} allowed, ${sb.egress.refused} refused`),
      row("Created", fmtTime(sb.created_at)),
      row("Standby since", fmtTime(sb.standby_since)),
      row("Expires", fmtTime(sb.expires_at)),
    );
    const entries = [{ at: sb.created_at, text: "created from " + sb.template }];
    if (sb.standby_since) entries.push({ at: sb.standby_since, text: `in standby (${sb.standby_tier})` + (sb.standby_reason ? ": " + sb.standby_reason : "") });
    if (sb.state === "failed") entries.push({ at: sb.updated_at, text: "failed: " + (sb.failure_reason || "") });
    for (const e of store.timelines.get(sid) || []) if (!/^seen|^created:/.test(e.text)) entries.push(e);
    entries.sort((a, b) => (a.at < b.at ? -1 : 1));
    clear(timeline, entries.map((e) => h("li", {}, h("time", { datetime: e.at }, fmtTime(e.at)), " ", e.text)));
  }

  async function firstLoad() {
    if (sb) return update();
    try {
      sb = await get(`/v1/sandboxes/${sid}`);
      update();
    } catch (e) {
      banner.hidden = false;
      banner.textContent = e instanceof ApiError && e.status === 404
        ? `No sandbox ${sid} (deleted, or not one of this key's tenant).`
        : `Could not load ${sid}: ${e.message}`;
      gone = true;
      for (const b of main.querySelectorAll("button")) b.disabled = true;
    }
  }

  // metrics: every 5 s while the page is open; asking does not resume a sandbox in standby
  const series = { cpu: [], mem: [], disk: [] };
  async function sample() {
    if (gone || store.deleted.has(sid) || !sb || (sb.state !== "running" && sb.state !== "standby")) return;
    try {
      const m = await get(`/v1/sandboxes/${sid}/metrics`);
      const t = Date.now() / 1000;
      series.cpu.push([t, m.cpu_percent]);
      series.mem.push([t, m.memory_used_mb]);
      series.disk.push([t, m.disk_used_mb]);
      for (const s of Object.values(series)) if (s.length > 120) s.shift();
      clear(charts,
        lineChart("CPU %", series.cpu, 100),
        lineChart(`Memory MB (limit ${m.memory_limit_mb})`, series.mem, m.memory_limit_mb),
        lineChart(`Disk MB (limit ${m.disk_limit_mb})`, series.disk, m.disk_limit_mb),
      );
    } catch (e) {
      if (e.status === 404) gone = true;
    }
  }
  charts.append(h("p", { class: "muted" }, "Sampled every 5 s while this page is open."));
  const timer = setInterval(sample, 5000);

  async function loadProcs() {
    clear(procsBox, h("p", { class: "muted" }, "Loading…"));
    try {
      const page = await get(`/v1/sandboxes/${sid}/processes?limit=200`);
      if (!page.items.length) return clear(procsBox, h("p", { class: "muted" }, "No background processes."));
      const out = h("pre", { class: "log", "aria-label": "Process output" });
      clear(procsBox, h("table", {},
        h("thead", {}, h("tr", {}, ["PID", "Command", "State", "Started", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, page.items.map((p) => h("tr", {},
          h("td", {}, p.pid),
          h("td", { class: "mono" }, Array.isArray(p.cmd) ? p.cmd.join(" ") : p.cmd || ""),
          h("td", {}, p.running ? "running" : `exited ${p.exit_code}` + (p.timed_out ? " (timed out)" : "")),
          h("td", {}, fmtTime(p.started_at)),
          h("td", {}, h("button", {
            onclick: async () => {
              out.textContent = "";
              await ndjson(`/v1/sandboxes/${sid}/processes/${p.pid}/output?offset=0`, (l) => {
                const text = l.stdout ?? l.stderr ?? (l.exit_code !== undefined ? `\n[exit ${l.exit_code}]\n` : "");
                out.append(text);
              });
            },
          }, "Output")),
        )))), out);
    } catch (e) {
      clear(procsBox, h("p", { class: "result bad" }, `${e.code}: ${e.message}`));
    }
  }

  stops.push(subscribe(update));
  firstLoad().then(sample);
  return () => {
    clearInterval(timer);
    for (const s of stops) s();
  };
}

export { fmtBytes, fmtNum, raw };
