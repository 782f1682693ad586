"""The worker's side of the network edge: each sandbox's sockets for the egress gateway.

For every sandbox the worker makes two sockets inside its host-side namespace — the TCP listener
nftables redirect its connections to (HOST_IP:EGRESS_PORT) and the DNS socket (HOST_IP:53) — and
hands them to the gateway with the sandbox's policy (Runtime.network). Attached when the sandbox
starts and again when a restarted worker reattaches; detached before its namespaces go.
Secrets: the bindings of each sandbox (its placeholders, their values and hosts) are kept here in
memory only — never in runtime.json — and given again by the control plane when it adopts this
worker; the CA the gateway signs intercepted HTTPS with likewise (`set_authority`). `open_port`
makes the ingress router's connections into a sandbox, tracked by the gateway like its egress.
Called by worker.sandboxes (start, stop, delete) and worker.node (start, create, set_network,
set_secrets, set_authority, open_port).
"""

from __future__ import annotations

import asyncio
import logging
import socket

from atoll.core import netpolicy
from atoll.core import worker_api as api
from atoll.gateway import egress, intercept
from atoll.gateway import names as names_mod
from atoll.worker import netns
from atoll.worker.runtime import Runtime

log = logging.getLogger(__name__)
EGRESS_PORT = 15001
RESET_SETTLE_S = 1.2
DNS_PORT = 53


def _sockets(ns_path: str) -> tuple[socket.socket, socket.socket]:
    tcp = netns.socket_in(ns_path, socket.SOCK_STREAM)
    udp = netns.socket_in(ns_path, socket.SOCK_DGRAM)
    try:
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((netns.HOST_IP, EGRESS_PORT))
        udp.bind((netns.HOST_IP, DNS_PORT))
    except BaseException:
        tcp.close()
        udp.close()
        raise
    return tcp, udp


def _bindings(secrets: tuple[api.SecretBinding, ...]) -> tuple[intercept.Binding, ...]:
    return tuple(intercept.Binding(s.placeholder, s.value, tuple(s.hosts)) for s in secrets)


class Edge:
    def __init__(
        self, hosts_files: list[str], egress_source: str | None, upstream_ca_file: str | None = None
    ):
        self.gateway = egress.Gateway(
            names_mod.Names(hosts_files),
            egress_source,
            own_ip=netns.HOST_IP,
            upstream_ca_file=upstream_ca_file,
        )
        self._secrets: dict[str, tuple[intercept.Binding, ...]] = {}

    async def attach(self, rt: Runtime) -> None:
        ns = netns.path(netns.host_side(rt.name))
        tcp, udp = await asyncio.get_running_loop().run_in_executor(netns.ns_thread, _sockets, ns)
        await self.gateway.attach(
            rt.sandbox_id, tcp, udp, netpolicy.from_wire(rt.network), self._secrets.get(rt.sandbox_id, ())
        )

    async def detach(self, sid: str) -> None:
        await self.gateway.detach(sid)

    def forget(self, sid: str) -> None:
        self._secrets.pop(sid, None)

    def set_secrets(self, sid: str, secrets: tuple[api.SecretBinding, ...]) -> None:
        bindings = _bindings(secrets)
        if bindings:
            self._secrets[sid] = bindings
        else:
            self._secrets.pop(sid, None)
        self.gateway.set_bindings(sid, bindings)

    def set_authority(self, authority: api.Authority) -> None:
        self.gateway.set_authority(
            authority.cert_pem.encode(), authority.key_pem.encode(), authority.root_pem.encode()
        )

    async def open_port(self, rt: Runtime, port: int) -> egress.Inbound:
        ns = netns.path(netns.host_side(rt.name))
        sock = await asyncio.get_running_loop().run_in_executor(
            netns.ns_thread, netns.socket_in, ns, socket.SOCK_STREAM
        )
        return await self.gateway.open_inbound(rt.sandbox_id, sock, (netns.SANDBOX_IP, port))

    def set_policy(self, rt: Runtime, policy: netpolicy.Policy) -> None:
        self.gateway.set_policy(rt.sandbox_id, policy)

    def busy(self, sid: str) -> int:
        return self.gateway.busy(sid)

    def last_io(self, sid: str) -> float:
        return self.gateway.last_io(sid)

    async def quiesce(self, sid: str) -> int:
        """Reset the sandbox's idle egress connections before a checkpoint; returns those in use.
        After a reset this waits RESET_SETTLE_S: gVisor's endpoint reaches CLOSE "within ~1 s"
        (DESIGN, measured), and saving it before then kills the sandbox (seen: 20 ms was too
        short, and the guest's gate already passed it)."""
        busy, reset = self.gateway.quiesce(sid)
        if reset:
            log.info(
                "reset %d idle egress connection(s) before a checkpoint", reset, extra={"sandbox_id": sid}
            )
            await asyncio.sleep(RESET_SETTLE_S)
        return busy

    async def aclose(self) -> None:
        await self.gateway.aclose()
