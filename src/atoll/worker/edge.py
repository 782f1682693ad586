"""The worker's side of the network edge: each sandbox's sockets for the egress gateway.

For every sandbox the worker makes two sockets inside its host-side namespace — the TCP listener
nftables redirect its connections to (HOST_IP:EGRESS_PORT) and the DNS socket (HOST_IP:53) — and
hands them to the gateway with the sandbox's policy (Runtime.network). Attached when the sandbox
starts and again when a restarted worker reattaches; detached before its namespaces go.
Called by worker.sandboxes (start, stop, delete) and worker.node (start, set_network).
"""

from __future__ import annotations

import asyncio
import logging
import socket

from atoll.core import netpolicy
from atoll.gateway import egress
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


class Edge:
    def __init__(self, hosts_files: list[str], egress_source: str | None):
        self.gateway = egress.Gateway(names_mod.Names(hosts_files), egress_source, own_ip=netns.HOST_IP)

    async def attach(self, rt: Runtime) -> None:
        ns = netns.path(netns.host_side(rt.name))
        tcp, udp = await asyncio.get_running_loop().run_in_executor(netns.ns_thread, _sockets, ns)
        await self.gateway.attach(rt.sandbox_id, tcp, udp, netpolicy.from_wire(rt.network))

    async def detach(self, sid: str) -> None:
        await self.gateway.detach(sid)

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
