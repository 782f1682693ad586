"""Per-sandbox network namespaces (adapter over iproute2).

Each sandbox gets two namespaces joined by a veth pair:
  `<name>`   — the sandbox's own netns; runsc (`--network=sandbox`) takes over its `eth0`.
  `<name>-h` — the host side, holding the peer end. The worker opens its sockets to the guest agent
               inside it (see agent_channel), so every sandbox can use the *same* addresses
               (SANDBOX_IP / HOST_IP): checkpoint images then restore anywhere, and two installations
               on one host never collide on addresses, only on names (which carry the installation id).
This issue has no egress: the host side has no route anywhere, so a sandbox reaches only its worker.
Called by worker.service.
"""

from __future__ import annotations

import asyncio
import os

from atoll.worker import hostcmd

SANDBOX_IP = "10.99.0.2"
HOST_IP = "10.99.0.1"
PREFIX = 30
NETNS_DIR = "/run/netns"


def host_side(name: str) -> str:
    return f"{name}-h"


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


async def create(name: str) -> None:
    """Create the namespace pair and the veth between them (idempotent: recreates from scratch).

    Both veth ends are created directly inside their namespaces (`link add … netns A … peer …
    netns B`): moving an existing interface to another namespace costs ~28 ms per end on this
    kernel (an RCU grace period each), creating it in place ~2 ms. Names are per namespace, so the
    fixed `eth0`/`peer0` never collide with anything on the host or in another installation.
    """
    await delete(name)
    hs = host_side(name)
    batch = "\n".join(
        [
            f"netns add {name}",
            f"netns add {hs}",
            f"link add eth0 netns {name} type veth peer name peer0 netns {hs}",
        ]
    )
    await hostcmd.run("ip", "-batch", "-", input=batch.encode())
    sandbox_side = "\n".join(
        [f"addr add {SANDBOX_IP}/{PREFIX} dev eth0", "link set eth0 up", "link set lo up"]
    )
    host = "\n".join([f"addr add {HOST_IP}/{PREFIX} dev peer0", "link set peer0 up", "link set lo up"])
    await asyncio.gather(
        hostcmd.run("ip", "-n", name, "-batch", "-", input=sandbox_side.encode()),
        hostcmd.run("ip", "-n", hs, "-batch", "-", input=host.encode()),
    )


async def readdress(name: str) -> None:
    """Give eth0 its address back: runsc removes it when it takes the interface over (one `ip`)."""
    await hostcmd.run(
        "ip",
        "-n",
        name,
        "-batch",
        "-",
        input=f"addr replace {SANDBOX_IP}/{PREFIX} dev eth0\nlink set eth0 up\n".encode(),
    )


async def delete(name: str) -> None:
    for ns in (name, host_side(name)):
        if exists(ns):
            await hostcmd.run("ip", "netns", "del", ns, check=False)
