"""The health, identity and checkpoint-gate handlers: who this sandbox is (sandbox id, generation,
hostname; set again by the worker after a restore or fork) and whether it can be checkpointed now.

`StatusHandlers` is mixed into `routing.Agent`, which routes /health, /identity, /gate and /gate/final here.
"""

from __future__ import annotations

import json
import os
import socket
import time

from .common import log
from .connection import Conn, Request, json_body
from .errors import invalid
from .gate import gate_report

FINAL_GATE_WAIT_S = 2.0


class StatusHandlers:
    """GET /health, GET /stats, POST /identity, GET /gate and POST /gate/final.

    A mixin of `routing.Agent`, whose __init__ sets what these methods use and `identity` changes:
    `pid`, `port`, `started`, `sandbox_id`, `generation` and `base_env`.
    """

    def health(self, conn: Conn) -> None:
        conn.send_json(
            200,
            {
                "ok": True,
                "pid": self.pid,
                "generation": self.generation,
                "sandbox_id": self.sandbox_id,
                "hostname": socket.gethostname(),
                "time": time.time(),
                "uptime_s": round(time.monotonic() - self.started, 3),
            },
        )

    def stats(self, conn: Conn) -> None:
        """GET /stats: {"processes": N}, the user processes in /proc (atoll-init, PID 1 of their
        namespace, not counted; /proc is that namespace's view). Called by the worker's metrics."""
        n = sum(1 for name in os.listdir("/proc") if name.isdigit() and name != "1")
        conn.send_json(200, {"processes": n})

    def identity(self, conn: Conn, req: Request) -> None:
        body = json_body(req)
        sandbox_id = body.get("sandbox_id")
        generation = body.get("generation")
        hostname = body.get("hostname")
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise invalid(f"sandbox_id must be a non-empty string, got {sandbox_id!r}")
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise invalid(f"generation must be a non-negative integer, got {generation!r}")
        if hostname is not None and (not isinstance(hostname, str) or not hostname or "\x00" in hostname):
            raise invalid(f"hostname must be a non-empty string or null, got {hostname!r}")
        workdir = body.get("workdir")
        if workdir is not None and (
            not isinstance(workdir, str) or not workdir.startswith("/") or "\x00" in workdir
        ):
            raise invalid(f"workdir must be an absolute path or null, got {workdir!r}")
        cpus = body.get("cpus")
        if cpus is not None and (
            isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0
        ):
            raise invalid(f"cpus must be a positive number or null, got {cpus!r}")
        env = body.get("env")
        if env is not None:
            if not isinstance(env, dict) or not all(
                isinstance(k, str)
                and k
                and "=" not in k
                and "\x00" not in k
                and isinstance(v, str)
                and "\x00" not in v
                for k, v in env.items()
            ):
                raise invalid("env must be an object of string values with names without '=' or NUL")
            # A sandbox restored from its template's image gets its own environment here: every
            # later exec starts from it.
            self.base_env.update(env)
        self.sandbox_id = sandbox_id
        self.generation = generation
        if workdir is not None:
            self.default_cwd = workdir
        if self.procs.init is not None:  # what /proc/1/environ shows to the sandbox's processes
            self.procs.init.set_identity(sandbox_id, cpus)
        if hostname is not None and hostname != socket.gethostname():
            try:
                socket.sethostname(hostname)
            except OSError as e:
                log(f"sethostname({hostname!r}) failed (ignored): {e}")
        self._write_identity_file(body.get("seed"))
        conn.send_json(
            200, {"sandbox_id": sandbox_id, "generation": generation, "hostname": socket.gethostname()}
        )

    def _write_identity_file(self, seed: object) -> None:
        """/run/atoll/identity.json: who the sandbox is now. Programs watch it to notice a restore
        or fork (the generation changes); the SDK's `atoll.guest.on_restore` does. A seed from the
        worker is mixed into the kernel's pool too (gVisor draws getrandom from the host anyway)."""
        if isinstance(seed, str) and seed:
            try:
                with open("/dev/urandom", "wb") as f:
                    f.write(seed.encode())
            except OSError:
                pass
        try:
            os.makedirs("/run/atoll", mode=0o755, exist_ok=True)
            tmp = "/run/atoll/.identity.json.tmp"
            with open(tmp, "w") as f:
                json.dump(
                    {
                        "sandbox_id": self.sandbox_id,
                        "generation": self.generation,
                        "hostname": socket.gethostname(),
                        "restored_at": time.time(),
                    },
                    f,
                )
            os.chmod(tmp, 0o644)
            os.replace(tmp, "/run/atoll/identity.json")
        except OSError as e:
            log(f"cannot write /run/atoll/identity.json: {e}")

    def gate(self, conn: Conn) -> None:
        report = gate_report(self.procs.proc_root, own_pid=self.pid, own_port=self.port)
        conn.send_json(200, report)

    def final_gate(self, conn: Conn) -> None:
        """POST /gate/final: the worker's last call before a checkpoint, on the one connection it
        has left (it reset the others). Waits up to FINAL_GATE_WAIT_S for the RSTs of those to be
        processed (an endpoint still connected when runsc saves kills the sandbox), answers the
        gate, waits for the worker to shut its side down, then resets this connection itself:
        closing with SO_LINGER 0 moves the endpoint out of the connected state within the close
        call, so once the worker sees the reset nothing of its own is left open in here (a reset
        sent by the worker lands asynchronously)."""
        try:
            peer = int(conn.sock.getpeername()[1])
        except (OSError, IndexError, TypeError, ValueError) as e:
            raise invalid(f"cannot tell this connection's peer: {e}") from None
        deadline = time.monotonic() + FINAL_GATE_WAIT_S
        while True:
            report = gate_report(self.procs.proc_root, own_pid=self.pid, own_port=self.port, final_peer=peer)
            if not report["own_connections_open"] or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        if report["own_connections_open"]:
            report["blockers"].append(
                f"{report['own_connections_open']} connection(s) of the worker to the guest agent "
                f"were still open {FINAL_GATE_WAIT_S:g} s after it reset them"
            )
        conn.keep_alive = False
        conn.send_json(200, report)
        # Reset only once the worker has read the answer (a reset drops unsent bytes): it says so
        # by shutting its side down. Conn._finish then closes with SO_LINGER 0, an RST.
        try:
            conn.sock.settimeout(FINAL_GATE_WAIT_S)
            conn.sock.recv(1)
        except OSError:
            pass
        conn.abort = True
