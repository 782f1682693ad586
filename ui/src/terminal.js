// A terminal in the page: POST …/pty (which resumes a sandbox in standby), then the PTY WebSocket
// with `?auth=message`: a browser's WebSocket cannot send an Authorization header, so the key goes
// in the first message. Binary messages are terminal bytes both ways; text ones are control
// (`{"resize": [cols, rows]}` out; `{"exit_code"}` or `{"error"}` in).
import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import { send, session, wsUrl } from "./api.js";
import { put } from "./store.js";
import { get } from "./api.js";

export async function openTerminal(box, sid, report) {
  const term = new Terminal({ cursorBlink: true, fontSize: 14, scrollback: 5000, convertEol: false });
  const fit = new FitAddon();
  term.loadAddon(fit);
  box.replaceChildren();
  term.open(box);
  // Tab belongs to the shell (completion); Shift+Tab leaves the terminal, so a keyboard is never
  // trapped in it (WCAG 2.1.2): xterm passes it on and the browser moves the focus back.
  term.attachCustomKeyEventHandler((ev) => !(ev.key === "Tab" && ev.shiftKey));
  fit.fit();
  report("Opening a terminal…");
  const started = await send("POST", `/v1/sandboxes/${sid}/pty`, { cols: term.cols, rows: term.rows });
  get(`/v1/sandboxes/${sid}`).then(put).catch(() => {}); // it may have been resumed
  const ws = new WebSocket(wsUrl(`/v1/sandboxes/${sid}/pty/${started.pty_id}/ws?auth=message`));
  ws.binaryType = "arraybuffer";
  const enc = new TextEncoder();
  ws.onopen = () => {
    ws.send(JSON.stringify({ authorization: "Bearer " + session.key }));
    ws.send(JSON.stringify({ resize: [term.cols, term.rows] }));
    report(`Terminal ${started.pty_id} attached`);
    term.focus();
  };
  ws.onmessage = (ev) => {
    if (typeof ev.data !== "string") return term.write(new Uint8Array(ev.data));
    const msg = JSON.parse(ev.data);
    if (msg.exit_code !== undefined) term.write(`\r\n[exited with ${msg.exit_code}]\r\n`);
    else if (msg.error) report(`Terminal: ${msg.error.code}: ${msg.error.message}`, false);
  };
  let closing = false;
  const closed = new Promise((ok) => ws.addEventListener("close", ok));
  ws.onclose = (ev) => {
    if (!closing && ev.code !== 1000 && ev.code !== 1005) report(`Terminal closed (${ev.code}${ev.reason ? ": " + ev.reason : ""})`, false);
  };
  const data = term.onData((d) => ws.readyState === WebSocket.OPEN && ws.send(enc.encode(d)));
  const onResize = () => {
    fit.fit();
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ resize: [term.cols, term.rows] }));
  };
  window.addEventListener("resize", onResize);
  return {
    // resolves once the server has the close (or after 2 s): an attached terminal keeps the
    // sandbox busy, and a pause right after would be refused
    async close() {
      closing = true;
      window.removeEventListener("resize", onResize);
      data.dispose();
      ws.close();
      await Promise.race([closed, new Promise((ok) => setTimeout(ok, 2000))]);
      term.dispose();
      box.replaceChildren();
    },
  };
}
