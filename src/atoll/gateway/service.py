"""The egress gateway as a process of its own: `python -m atoll.gateway --channel FD`.

Each worker (`atoll worker`, and the worker inside `atoll up`) starts one beside it
(worker.edge) and talks to it over one channel (atoll.shared.ipc): no sandbox's traffic — relayed,
parsed, decrypted — runs on the event loop that serves the worker's or the control plane's API.
The worker makes every socket that must be born inside a sandbox's namespace and hands it over
with the message that uses it:
  attach {sid, policy, bindings} + [listener, dns]   serve a sandbox (again after a restart)
  detach {sid}                                        stop, reset its connections
  policy {sid, policy} · bindings {sid, bindings}     apply to what comes next
  authority {cert, key, chain}                        the CA intercepted HTTPS is signed with
  quiesce {sid} → {busy, reset}                       before a disk checkpoint
  busy {sid} → {busy}                                 connections in use now
  inbound {sid, host, port, greeting} + [sock, client]  a connection into a sandbox's port
Once a second it reports, in one event, what changed per sandbox: when a byte last moved, the
connections in use and the counters (so a flood of connections never floods the channel).
It stops when the worker's end of the channel closes (the worker stopped or died) or on SIGTERM;
SIGINT is the worker's to handle. Sandboxes never stop with it.
Settings come in ATOLL_GATEWAY_CONFIG (JSON: hosts_files, egress_source, own_ip, upstream_ca_file,
parse_capacity, log_format, log_level). Called by worker.edge (spawn); uses gateway.egress.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time

from atoll.core import netpolicy
from atoll.gateway import egress, fairshare, placeholders
from atoll.gateway import names as names_mod
from atoll.shared import ipc, logconfig

log = logging.getLogger(__name__)
REPORT_S = 1.0


def bindings_of(wire: list[dict]) -> tuple[placeholders.Binding, ...]:
    return tuple(
        placeholders.Binding(b["placeholder"], b["value"], tuple(b["hosts"]), bool(b.get("allow_http")))
        for b in wire
    )


class Service:
    def __init__(self, config: dict):
        self.gateway = egress.Gateway(
            names_mod.Names(list(config.get("hosts_files") or [])),
            config.get("egress_source") or None,
            own_ip=config.get("own_ip", ""),
            upstream_ca_file=config.get("upstream_ca_file") or None,
        )
        self.gateway.shares = fairshare.Shares(float(config.get("parse_capacity") or fairshare.CAPACITY))
        self.channel: ipc.Channel | None = None
        self._sent: dict[str, tuple] = {}
        self._order = asyncio.Lock()

    async def handle(self, msg: dict, fds: list[socket.socket]):
        """Calls are served one after another in the order they came (a policy sent after an
        attach finds the sandbox attached), except connections into a sandbox, which wait for
        their connect concurrently."""
        if msg.get("op") == "ping":
            return {}
        if msg.get("op") == "inbound":
            return await self._handle(msg, fds)
        async with self._order:
            return await self._handle(msg, fds)

    async def _handle(self, msg: dict, fds: list[socket.socket]):
        op = msg.get("op")
        sid = str(msg.get("sid", ""))
        g = self.gateway
        try:
            if op == "attach":
                if len(fds) != 2:
                    raise ipc.CallError("invalid_request", "attach needs the listener and the DNS socket")
                tcp, udp = fds
                fds = []
                await g.attach(
                    sid, tcp, udp, netpolicy.from_wire(msg["policy"]), bindings_of(msg["bindings"])
                )
                self._sent.pop(sid, None)
                return {}
            if op == "detach":
                await g.detach(sid)
                self._sent.pop(sid, None)
                return {}
            if op == "policy":
                g.set_policy(sid, netpolicy.from_wire(msg["policy"]))
                return {}
            if op == "bindings":
                g.set_bindings(sid, bindings_of(msg["bindings"]))
                return {}
            if op == "authority":
                g.set_authority(msg["cert"].encode(), msg["key"].encode(), msg.get("chain", "").encode())
                return {}
            if op == "quiesce":
                busy, reset = g.quiesce(sid)
                return {"busy": busy, "reset": reset}
            if op == "busy":
                return {"busy": g.busy(sid)}
            if op == "inbound":
                if len(fds) != 2:
                    raise ipc.CallError("invalid_request", "inbound needs the socket and the client")
                sock, client = fds
                fds = []
                await g.relay_inbound(
                    sid,
                    sock,
                    client,
                    (str(msg["host"]), int(msg["port"])),
                    greeting=str(msg.get("greeting", "")).encode(),
                )
                return {}
            raise ipc.CallError("invalid_request", f"unknown operation {op!r}")
        finally:
            for s in fds:
                s.close()

    def report(self) -> None:
        """What changed since the last report, for every attached sandbox, in one event."""
        now = time.monotonic()
        out: dict[str, dict] = {}
        g = self.gateway
        for sid in g.sandboxes():
            c = g.stats(sid)
            state = (
                round(g.last_io(sid), 3),
                g.busy(sid),
                c.allowed,
                c.refused,
                c.dns_answered,
                c.dns_refused,
                c.intercepted,
                c.bytes_out,
                c.bytes_in,
            )
            if self._sent.get(sid) != state:
                self._sent[sid] = state
                out[sid] = dict(
                    zip(
                        (
                            "last_io",
                            "busy",
                            "allowed",
                            "refused",
                            "dns_answered",
                            "dns_refused",
                            "intercepted",
                            "bytes_out",
                            "bytes_in",
                        ),
                        state,
                        strict=True,
                    )
                )
        for sid in list(self._sent):
            if not g.attached(sid):
                del self._sent[sid]
        if out and self.channel is not None:
            with contextlib.suppress(ipc.ChannelClosed):
                self.channel.event(op="report", at=now, sandboxes=out)

    async def run(self, sock: socket.socket) -> None:
        self.channel = ipc.Channel(sock, handler=self.handle, name="gateway channel")
        self.channel.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        closed = asyncio.ensure_future(self.channel.closed.wait())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not closed.done() and not stopping.done():
                await asyncio.wait({closed, stopping}, timeout=REPORT_S)
                self.report()
        finally:
            closed.cancel()
            stopping.cancel()
            await self.gateway.aclose()
            await self.channel.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m atoll.gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--channel", type=int, required=True, help="the channel's descriptor (inherited)")
    args = parser.parse_args(argv)
    config = json.loads(os.environ.get("ATOLL_GATEWAY_CONFIG") or "{}")
    logconfig.configure(config.get("log_format", "text"), config.get("log_level", "INFO"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which stops us
    try:
        sock = socket.socket(fileno=args.channel)
    except OSError as e:
        print(f"atoll gateway: descriptor {args.channel} is not the channel: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        import resource  # noqa: PLC0415 - as many descriptors as the hard limit allows

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass
    asyncio.run(Service(config).run(sock))
