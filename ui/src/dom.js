// A tiny element builder: h("a", {href, onclick}, "text", child...). Text always goes in as a text
// node (never innerHTML), so names from sandboxes (file names, metadata) cannot inject markup.
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "style") el.style.cssText = v;
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function fmtTime(iso) {
  if (!iso) return "";
  const d = typeof iso === "number" ? new Date(iso * 1000) : new Date(iso);
  return isNaN(d) ? String(iso) : d.toISOString().replace("T", " ").slice(0, 19) + "Z";
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}

export function fmtNum(n, digits = 2) {
  return n === null || n === undefined ? "" : Number(n).toFixed(digits).replace(/\.?0+$/, "");
}

// A status line that says what an action did: "Paused (memory) in 0.4 s" or the API's message.
export function resultLine() {
  const el = h("p", { class: "result", role: "status", "aria-live": "polite" });
  el.show = (text, ok = true) => {
    el.textContent = text;
    el.className = "result " + (ok ? "ok" : "bad");
  };
  return el;
}
