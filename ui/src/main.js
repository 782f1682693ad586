// The dashboard's shell: sign-in with an API key (kept in sessionStorage only), the navigation,
// an admin's tenant switch, and a hash router (#/sandboxes, #/sandboxes/sb-…, #/templates, …).
import { h, clear } from "./dom.js";
import { session, get, raw, all, ApiError } from "./api.js";
import * as store from "./store.js";
import { sandboxesPage } from "./sandboxes.js";
import { sandboxPage } from "./sandbox.js";
import { templatesPage, poolsPage, storesPage, secretsPage, workersPage, usagePage } from "./pages.js";

const app = document.getElementById("app");
let cleanup = null;

const PAGES = [
  ["sandboxes", "Sandboxes", sandboxesPage],
  ["templates", "Templates", templatesPage],
  ["pools", "Pools", poolsPage],
  ["storage", "Volumes & drives", storesPage],
  ["secrets", "Secrets", secretsPage],
  ["workers", "Workers", workersPage, true],
  ["usage", "Usage", usagePage],
];

function signInPage(message) {
  store.stop();
  const input = h("input", {
    id: "api-key", name: "api-key", type: "password", autocomplete: "off", spellcheck: "false",
    required: true, "aria-describedby": "key-help",
  });
  const status = h("p", { class: "result bad", role: "alert" }, message || "");
  const button = h("button", { type: "submit" }, "Sign in");
  const form = h("form", {
    class: "signin",
    onsubmit: async (ev) => {
      ev.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      button.disabled = true;
      status.textContent = "Signing in…";
      status.className = "result";
      try {
        const who = await (await raw("/v1/whoami", {}, key)).json();
        session.key = key;
        session.whoami = who;
        if (!location.hash || location.hash === "#/") location.hash = "#/sandboxes";
        shell();
      } catch (e) {
        status.className = "result bad";
        status.textContent = e instanceof ApiError && e.status === 401
          ? "This key was refused: it is wrong, revoked or expired. Check it and try again."
          : e instanceof ApiError && e.status === 403
            ? "This key cannot use the dashboard: " + e.message
            : "Could not reach atoll: " + e.message;
        button.disabled = false;
        input.select();
      }
    },
  },
    h("h1", {}, h("img", { src: "/ui/assets/favicon.svg", alt: "", width: 28, height: 28 }), " atoll"),
    h("label", { for: "api-key" }, "API key"),
    input,
    h("p", { id: "key-help", class: "help" },
      "An admin key (ATOLL_API_KEY, or $ATOLL_HOME/admin.key) or a tenant key. It stays in this browser tab only."),
    button,
    status,
  );
  clear(app, h("main", { class: "center" }, form));
  input.focus();
}

function signOut(message) {
  session.key = null;
  session.whoami = null;
  session.tenant = null;
  if (cleanup) cleanup();
  cleanup = null;
  signInPage(message);
}

session.onUnauthorized = () => {
  if (session.key) signOut("Your key was refused (revoked or expired?): sign in again.");
};

let main, nav, liveDot;
const SANDBOX_ID = /^sb-[0-9a-hjkmnp-tv-z]{16}$/; // core/ids.py SANDBOX_ID_RE

async function tenantSwitch() {
  if (session.whoami.scope !== "admin") return h("span", { class: "who" }, "tenant " + session.whoami.tenant_id);
  const select = h("select", {
    id: "tenant", onchange: () => {
      session.tenant = select.value;
      store.start();
      route();
    },
  }, h("option", { value: "" }, "all tenants"));
  get("/v1/tenants?limit=500").then((page) => {
    for (const t of page.items) select.append(h("option", { value: t.id, selected: t.id === session.tenant }, `${t.name} (${t.id})`));
    select.value = session.tenant;
  }).catch(() => {});
  return h("span", { class: "who" }, h("label", { for: "tenant" }, "Admin, viewing "), select);
}

async function shell() {
  nav = h("nav", { "aria-label": "Pages" });
  for (const [id, label, , admin] of PAGES) {
    if (admin && session.whoami.scope !== "admin") continue;
    nav.append(h("a", { href: "#/" + id, "data-page": id }, label));
  }
  liveDot = h("span", { class: "live", title: "live updates" });
  main = h("main", { id: "main", tabindex: "-1" });
  clear(app,
    h("header", {},
      h("a", { class: "brand", href: "#/sandboxes" }, h("img", { src: "/ui/assets/favicon.svg", alt: "", width: 22, height: 22 }), " atoll"),
      nav,
      h("span", { class: "spacer" }),
      liveDot,
      await tenantSwitch(),
      h("button", { class: "link", onclick: () => signOut("Signed out.") }, "Sign out"),
    ),
    main,
  );
  store.subscribe(() => {
    liveDot.textContent = store.store.status === "live" ? "● live" : "○ " + store.store.status;
    liveDot.className = "live " + store.store.status;
  });
  store.start();
  route();
}

function route() {
  if (!session.key || !session.whoami) return;
  if (cleanup) cleanup();
  cleanup = null;
  const parts = (location.hash || "#/sandboxes").slice(2).split("/");
  for (const a of nav.querySelectorAll("a")) {
    if (a.dataset.page === parts[0]) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  clear(main);
  if (parts[0] === "sandboxes" && parts[1]) {
    // The id goes into API paths as it is: anything but a sandbox id (`..%2Ftenants%2Ftn-…`, `?`)
    // would point the page's calls, and its Delete button, at another route.
    let sid = "";
    try { sid = decodeURIComponent(parts[1]); } catch { /* malformed escape: not an id */ }
    if (SANDBOX_ID.test(sid)) cleanup = sandboxPage(main, sid);
    else {
      document.title = "Not a sandbox · atoll";
      clear(main,
        h("p", {}, h("a", { href: "#/sandboxes" }, "← Sandboxes")),
        h("div", { role: "alert", class: "banner" },
          `“${sid || parts[1]}” is not a sandbox id: ids look like sb- followed by 16 lower-case letters and digits.`));
    }
  } else {
    const page = PAGES.find((p) => p[0] === parts[0]) || PAGES[0];
    document.title = page[1] + " · atoll";
    cleanup = page[2](main);
  }
}

window.addEventListener("hashchange", route);

async function boot() {
  const key = session.key;
  if (!key) return signInPage();
  try {
    session.whoami = await (await raw("/v1/whoami", {}, key)).json();
    shell();
  } catch (e) {
    session.key = null;
    signInPage(e instanceof ApiError && e.status === 401
      ? "Your key was refused (revoked or expired?): sign in again."
      : "Could not reach atoll: " + e.message);
  }
}

export { all };
boot();
