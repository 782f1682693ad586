// The files browser of a sandbox: list a directory, open sub-directories, view a text file,
// download any file, upload files into the directory shown. Names are shown as text nodes, never
// as markup. Lists only on request while the sandbox is in standby (listing resumes it).
import { h, clear, fmtTime, fmtBytes } from "./dom.js";
import { get, raw } from "./api.js";

const VIEW_MAX = 1 << 20;

function q(path) {
  return "path=" + encodeURIComponent(path);
}

function join(dir, name) {
  return dir.endsWith("/") ? dir + name : dir + "/" + name;
}

function parent(dir) {
  const p = dir.replace(/\/+$/, "").split("/").slice(0, -1).join("/");
  return p || "/";
}

export function filesPanel(box, sid, sandbox, report) {
  let dir = null;
  const pathInput = h("input", { id: "files-path", size: 40, spellcheck: "false" });
  const listing = h("div", { class: "files" });
  const viewer = h("pre", { class: "log", hidden: true, "aria-label": "File content" });
  const upload = h("input", {
    id: "files-upload", type: "file", multiple: true,
    onchange: async () => {
      for (const file of upload.files) {
        dir = dir || pathInput.value || "/tmp";
        const target = join(dir, file.name);
        try {
          await raw(`/v1/sandboxes/${sid}/files?${q(target)}`, { method: "PUT", body: file });
          report(`Uploaded ${file.name} (${fmtBytes(file.size)}) to ${target}`);
        } catch (e) {
          report(`Upload of ${file.name} failed: ${e.code}: ${e.message}`, false);
        }
      }
      upload.value = "";
      list(dir);
    },
  });

  async function list(path) {
    dir = path;
    pathInput.value = path;
    clear(listing, h("p", { class: "muted" }, "Loading…"));
    try {
      const page = await get(`/v1/sandboxes/${sid}/files/list?${q(path)}`);
      const rows = page.items.map((e) => h("tr", {},
        h("td", { class: "mono name" }, e.type === "dir"
          ? h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); list(e.path); } }, e.name + "/")
          : e.name),
        h("td", {}, e.type),
        h("td", { class: "num" }, e.type === "file" ? fmtBytes(e.size) : ""),
        h("td", { class: "muted" }, fmtTime(e.mtime)),
        h("td", {}, e.type === "file" ? [
          h("button", { class: "small", onclick: () => view(e) }, "View"), " ",
          h("button", { class: "small", onclick: () => download(e) }, "Download"),
        ] : ""),
      ));
      clear(listing, h("table", { "aria-label": "Files in " + path },
        h("thead", {}, h("tr", {}, ["Name", "Type", "Size", "Modified", ""].map((t) => h("th", {}, t)))),
        h("tbody", {},
          path !== "/" ? h("tr", {}, h("td", { class: "mono" }, h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); list(parent(path)); } }, "../")), h("td", { colspan: 4 })) : null,
          rows),
      ), rows.length ? null : h("p", { class: "muted" }, "Empty directory."));
    } catch (e) {
      clear(listing, h("p", { class: "result bad" }, `${e.code}: ${e.message}`));
    }
  }

  async function view(e) {
    viewer.hidden = false;
    if (e.size > VIEW_MAX) {
      viewer.textContent = `${e.name} is ${fmtBytes(e.size)}: too large to view here; download it.`;
      return;
    }
    try {
      const r = await raw(`/v1/sandboxes/${sid}/files?${q(e.path)}`);
      const bytes = new Uint8Array(await r.arrayBuffer());
      const text = new TextDecoder("utf-8", { fatal: false }).decode(bytes);
      viewer.textContent = bytes.includes(0) ? `${e.name} is binary (${fmtBytes(bytes.length)}): download it.` : text;
    } catch (err) {
      viewer.textContent = `${err.code}: ${err.message}`;
    }
  }

  async function download(e) {
    try {
      const r = await raw(`/v1/sandboxes/${sid}/files?${q(e.path)}`);
      const url = URL.createObjectURL(await r.blob());
      const a = h("a", { href: url, download: e.name });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      report(`Download failed: ${err.code}: ${err.message}`, false);
    }
  }

  const sb = sandbox();
  const start = (sb && sb.workdir) || "/tmp";
  pathInput.value = start;
  const go = h("button", { type: "submit" }, sb && sb.state === "standby" ? "List (resumes it)" : "List");
  clear(box,
    h("form", { class: "inline", onsubmit: (ev) => { ev.preventDefault(); list(pathInput.value || "/"); } },
      h("label", { for: "files-path" }, "Directory"), pathInput, go,
      h("label", { for: "files-upload" }, "Upload file"), upload),
    listing, viewer);
  if (sb && sb.state === "running") list(start);
}
