"""The worker's side of the network edge: the egress gateway process, and each sandbox's sockets.

The egress gateway runs in a process of its own (gateway.service), started here when the worker
starts and stopped when it stops; if it dies it is started again and given everything anew. For
every sandbox the worker makes two sockets inside its host-side namespace — the TCP listener
nftables redirect its connections to (HOST_IP:EGRESS_PORT, listening from the start, so connections
wait in its backlog while a gateway starts) and the DNS socket (HOST_IP:53) — keeps them, and hands
copies to the gateway with the sandbox's policy (Runtime.network) and secrets (SCM_RIGHTS,
atoll.shared.ipc). A connection into a sandbox's port is a socket made here in the namespace and given to
the gateway with its other end (the port tunnel's connection, or a socketpair), which relays the
bytes in the kernel: no sandbox byte passes through the worker's event loop.

Secrets: the bindings of each sandbox (its placeholders, their values and hosts) are kept in
memory only — never in runtime.json — and given again by the control plane when it adopts this
worker; the CA the gateway signs intercepted HTTPS with likewise (`set_authority`).
What the idle policy reads (when a byte last moved, connections in use, the counters) comes from the
gateway's reports, at most one a second (`last_io`, `busy`, `stats`); what a checkpoint depends on
is asked at the time (`quiesce`, `busy_now`).
Called by worker.sandboxes (attach, detach), worker.tiers (quiesce, busy_now), worker.forks
(quiesce) and worker.node (start, set_network, set_secrets, set_authority, open_port, relay_port).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import sys
import time

from atoll.core import netpolicy
from atoll.core import worker_api as api
from atoll.shared import ipc, portstream
from atoll.worker.host import netns
from atoll.worker.runtimes.runtime import Runtime

log = logging.getLogger(__name__)
EGRESS_PORT = 15001
RESET_SETTLE_S = 1.2
DNS_PORT = 53
BACKLOG = 256
START_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 10.0
QUIESCE_TIMEOUT_S = 3.0
SETTLED_S = 2.0
"""A gateway started this recently may still be accepting what waited in the listeners' backlogs:
no checkpoint until then of a sandbox it got with the others at its start (not of one attached to
it since: a sandbox created right after the worker started is not kept in the memory tier)."""


def _sockets(ns_path: str) -> tuple[socket.socket, socket.socket]:
    tcp = netns.socket_in(ns_path, socket.SOCK_STREAM)
    udp = netns.socket_in(ns_path, socket.SOCK_DGRAM)
    try:
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((netns.HOST_IP, EGRESS_PORT))
        tcp.listen(BACKLOG)
        udp.bind((netns.HOST_IP, DNS_PORT))
    except BaseException:
        tcp.close()
        udp.close()
        raise
    return tcp, udp


def _bindings(secrets: tuple[api.SecretBinding, ...]) -> list[dict]:
    return [
        {"placeholder": s.placeholder, "value": s.value, "hosts": list(s.hosts), "allow_http": s.allow_http}
        for s in secrets
    ]


@dataclasses.dataclass
class Counters:
    allowed: int = 0
    refused: int = 0
    dns_answered: int = 0
    dns_refused: int = 0
    intercepted: int = 0
    bytes_out: int = 0
    """Bytes the sandbox sent over TCP through the gateway (egress, preview answers)."""
    bytes_in: int = 0
    """Bytes that reached the sandbox over TCP through the gateway."""


@dataclasses.dataclass
class _Held:
    """A sandbox the gateway serves: the sockets the worker keeps, and what it last said."""

    tcp: socket.socket
    udp: socket.socket
    policy: dict
    handed_at: float | None = None
    """When the running gateway took its sockets straight from `attach` (monotonic): its listeners
    never had a backlog that process did not accept, so a checkpoint need not wait SETTLED_S. None
    when they came with a restart's replay."""


class Edge:
    def __init__(
        self,
        hosts_files: list[str],
        egress_source: str | None,
        upstream_ca_file: str | None = None,
        *,
        log_format: str = "text",
        log_level: str = "INFO",
    ):
        self.config = {
            "hosts_files": list(hosts_files),
            "egress_source": egress_source,
            "own_ip": netns.HOST_IP,
            "upstream_ca_file": upstream_ca_file,
            "log_format": log_format,
            "log_level": log_level,
        }
        self._held: dict[str, _Held] = {}
        self._secrets: dict[str, tuple[api.SecretBinding, ...]] = {}
        self._authority: api.Authority | None = None
        self._reports: dict[str, dict] = {}
        self._base: dict[str, Counters] = {}
        """Counters of gateway processes that ended, per sandbox (a restart starts at zero)."""
        self.child = ipc.Child(
            "egress gateway",
            lambda fd, _extra: [sys.executable, "-m", "atoll.gateway", "--channel", str(fd)],
            env={**os.environ, "ATOLL_GATEWAY_CONFIG": json.dumps(self.config)},
            on_start=self._replay,
            on_event=self._on_event,
        )

    # ---- the process ----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.child.pid

    async def start(self) -> None:
        """Start the gateway process (kept running until `aclose`)."""
        try:
            await self.child.start(START_TIMEOUT_S)
        except (TimeoutError, OSError) as e:
            log.error("the egress gateway did not start (%r); sandboxes have no egress until it does", e)

    async def _replay(self, chan: ipc.Channel) -> None:
        """Everything a new gateway process must know: the CA and every sandbox served. Its
        counters start at zero: what the previous process counted is kept as a base."""
        for sid in list(self._reports):
            self._fold(sid)
        if self._authority is not None:
            await self._call_on(chan, "authority", **self._authority_fields())
        for sid, held in list(self._held.items()):
            await self._call_on(
                chan,
                "attach",
                fds=(held.tcp, held.udp),
                sid=sid,
                policy=held.policy,
                bindings=_bindings(self._secrets.get(sid, ())),
            )

    async def aclose(self) -> None:
        """Stop the gateway process (sandboxes keep running; their connections through it end)."""
        await self.child.aclose()
        for held in self._held.values():
            held.tcp.close()
            held.udp.close()
        self._held.clear()

    def _on_event(self, msg: dict) -> None:
        if msg.get("op") == "report":
            for sid, state in (msg.get("sandboxes") or {}).items():
                if sid in self._held:
                    self._reports[sid] = state

    async def _call_on(self, chan: ipc.Channel, op: str, fds=(), timeout: float = 0.0, **fields) -> dict:
        reply, got = await chan.call(op, fds, timeout=timeout or CALL_TIMEOUT_S, **fields)
        for s in got:
            s.close()
        return reply

    async def _call(self, op: str, fds=(), **fields) -> dict:
        """A call to the running gateway; raises ipc.ChannelClosed when there is none."""
        chan = self.child.running()
        if chan is None:
            raise ipc.ChannelClosed("the egress gateway is not running (it is being started again)")
        return await self._call_on(chan, op, fds, **fields)

    def _tell(self, op: str, **fields) -> None:
        """A message for the running gateway, in order, not waited for (replayed on a restart)."""
        chan = self.child.running()
        if chan is not None:
            with contextlib.suppress(ipc.ChannelClosed):
                chan.send({"t": "call", "id": 0, "op": op, **fields})

    def _authority_fields(self) -> dict:
        a = self._authority
        assert a is not None
        return {"cert": a.cert_pem, "key": a.key_pem, "chain": a.root_pem}

    # ---- sandboxes ------------------------------------------------------------------------------
    async def attach(self, rt: Runtime) -> None:
        ns = netns.path(netns.host_side(rt.name))
        tcp, udp = await asyncio.get_running_loop().run_in_executor(netns.ns_thread, _sockets, ns)
        sid = rt.sandbox_id
        old = self._held.pop(sid, None)
        if old is not None:
            await self._detach_gateway(sid)
            old.tcp.close()
            old.udp.close()
        held = _Held(tcp, udp, rt.network)
        self._held[sid] = held
        self._fold(sid)
        try:
            await self._call(
                "attach",
                fds=(tcp, udp),
                sid=sid,
                policy=rt.network,
                bindings=_bindings(self._secrets.get(sid, ())),
            )
            held.handed_at = time.monotonic()
        except (ipc.ChannelClosed, TimeoutError) as e:
            # the gateway is being started again: it gets this sandbox with the others
            log.warning(
                "egress gateway unavailable at attach (%s); attached when it is back",
                e,
                extra={"sandbox_id": sid},
            )
        except ipc.CallError as e:
            raise OSError(errno.EIO, f"the egress gateway refused sandbox {sid}: {e.message}") from None

    async def _detach_gateway(self, sid: str) -> None:
        with contextlib.suppress(ipc.ChannelClosed, ipc.CallError, TimeoutError):
            await self._call("detach", sid=sid)

    async def detach(self, sid: str) -> None:
        """Stop serving a sandbox and reset its connections. Must come before its namespaces are
        deleted: a socket keeps its namespace alive."""
        held = self._held.pop(sid, None)
        self._fold(sid)
        await self._detach_gateway(sid)
        if held is not None:
            held.tcp.close()
            held.udp.close()

    def forget(self, sid: str) -> None:
        self._secrets.pop(sid, None)
        self._base.pop(sid, None)
        self._reports.pop(sid, None)

    def set_secrets(self, sid: str, secrets: tuple[api.SecretBinding, ...]) -> None:
        if secrets:
            self._secrets[sid] = tuple(secrets)
        else:
            self._secrets.pop(sid, None)
        if sid in self._held:
            self._tell("bindings", sid=sid, bindings=_bindings(tuple(secrets)))

    def set_authority(self, authority: api.Authority) -> None:
        self._authority = authority
        self._tell("authority", **self._authority_fields())

    def set_policy(self, rt: Runtime, policy: netpolicy.Policy) -> None:
        held = self._held.get(rt.sandbox_id)
        wire = policy.to_wire()
        if held is not None:
            held.policy = wire
        self._tell("policy", sid=rt.sandbox_id, policy=wire)

    async def open_port(self, rt: Runtime, port: int) -> portstream.SocketPort:
        """A connection into the sandbox's port: the worker's end of a socketpair the gateway
        relays. Raises ConnectionRefusedError (nothing listens), OSError."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await self.relay_port(rt, port, theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return portstream.SocketPort(ours)

    async def relay_port(self, rt: Runtime, port: int, client: socket.socket, greeting: bytes = b"") -> None:
        """Have the gateway connect into the sandbox's port and relay `client` (a connected stream
        socket; the caller keeps its own descriptor and closes it) to it, `greeting` first.
        Raises ConnectionRefusedError (nothing listens), OSError (timed out, no gateway)."""
        ns = netns.path(netns.host_side(rt.name))
        sock = await asyncio.get_running_loop().run_in_executor(
            netns.ns_thread, netns.socket_in, ns, socket.SOCK_STREAM
        )
        try:
            await self._call(
                "inbound",
                fds=(sock, client),
                sid=rt.sandbox_id,
                host=netns.SANDBOX_IP,
                port=port,
                greeting=greeting.decode("latin-1"),
            )
        except ipc.CallError as e:
            if e.errno == errno.ECONNREFUSED or e.code == "refused":
                raise ConnectionRefusedError(e.errno or errno.ECONNREFUSED, e.message) from None
            raise OSError(e.errno or errno.EIO, e.message) from None
        except ipc.ChannelClosed as e:
            raise OSError(errno.EAGAIN, str(e)) from None
        finally:
            sock.close()

    # ---- what the idle policy and checkpoints read ------------------------------------------------
    def busy(self, sid: str) -> int:
        """Connections in use at the last report (within a second)."""
        return int(self._reports.get(sid, {}).get("busy", 0))

    async def busy_now(self, sid: str) -> int:
        try:
            return int((await self._call("busy", sid=sid)).get("busy", 0))
        except (ipc.ChannelClosed, ipc.CallError, TimeoutError):
            return self.busy(sid)

    def last_io(self, sid: str) -> float:
        """When a byte of the sandbox's last moved through the gateway (monotonic; 0 = never)."""
        return float(self._reports.get(sid, {}).get("last_io", 0.0))

    def stats(self, sid: str) -> Counters:
        """The sandbox's counters since this worker started (across gateway restarts and
        attachments, each of which counts from zero)."""
        r = self._reports.get(sid, {})
        base = self._base.get(sid, Counters())
        return Counters(
            *(
                int(r.get(k, 0)) + getattr(base, k)
                for k in (
                    "allowed",
                    "refused",
                    "dns_answered",
                    "dns_refused",
                    "intercepted",
                    "bytes_out",
                    "bytes_in",
                )
            )
        )

    def _fold(self, sid: str) -> None:
        """The current attachment's counters become part of the base (it ends, or restarts)."""
        if sid in self._reports:
            self._base[sid] = self.stats(sid)
            del self._reports[sid]

    async def quiesce(self, sid: str) -> int | None:
        """Reset the sandbox's idle egress connections before a checkpoint; returns those in use,
        or None when it cannot be known — the gateway does not answer, or was started again
        moments ago — and so a checkpoint is not safe: connections the sandbox opened meanwhile
        wait in the listener's backlog, and once the sandbox closed them they are endpoints its
        own /proc/net/tcp does not list (the guest's gate cannot see them) and runsc cannot save.
        After a reset this waits RESET_SETTLE_S: gVisor's endpoint reaches CLOSE "within ~1 s"
        (DESIGN, measured), and saving it before then kills the sandbox (seen: 20 ms was too
        short, and the guest's gate already passed it)."""
        chan = self.child.running()
        held = self._held.get(sid)
        handed = held is not None and held.handed_at is not None and held.handed_at >= self.child.started_at
        if chan is None or (time.monotonic() - self.child.started_at < SETTLED_S and not handed):
            log.info("quiesce: the egress gateway is (re)starting", extra={"sandbox_id": sid})
            return None
        try:
            reply = await self._call_on(chan, "quiesce", timeout=QUIESCE_TIMEOUT_S, sid=sid)
        except (ipc.ChannelClosed, ipc.CallError, TimeoutError) as e:
            log.warning("quiesce: the egress gateway did not answer (%r)", e, extra={"sandbox_id": sid})
            return None
        busy, reset = int(reply.get("busy", 0)), int(reply.get("reset", 0))
        if reset:
            log.info(
                "reset %d idle egress connection(s) before a checkpoint", reset, extra={"sandbox_id": sid}
            )
            await asyncio.sleep(RESET_SETTLE_S)
        return busy
