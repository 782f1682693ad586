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

import os
import secrets

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
    """Create the namespace pair and the veth between them (idempotent: recreates from scratch)."""
    await delete(name)
    hs = host_side(name)
    # Interface names are per-namespace, so short fixed names are fine once moved.
    # Both ends are born in the host netns for an instant: random names keep concurrent creates
    # (here or in another installation) from colliding.
    suffix = secrets.token_hex(5)
    tmp_a, tmp_b = f"va{suffix}", f"vb{suffix}"
    batch = "\n".join(
        [
            f"netns add {name}",
            f"netns add {hs}",
            f"link add {tmp_a} type veth peer name {tmp_b}",
            f"link set {tmp_a} netns {name}",
            f"link set {tmp_b} netns {hs}",
        ]
    )
    await hostcmd.run("ip", "-batch", "-", input=batch.encode())
    await hostcmd.run(
        "ip",
        "-n",
        name,
        "-batch",
        "-",
        input="\n".join(
            [
                f"link set {tmp_a} name eth0",
                f"addr add {SANDBOX_IP}/{PREFIX} dev eth0",
                "link set eth0 up",
                "link set lo up",
            ]
        ).encode(),
    )
    await hostcmd.run(
        "ip",
        "-n",
        hs,
        "-batch",
        "-",
        input="\n".join(
            [
                f"link set {tmp_b} name peer0",
                f"addr add {HOST_IP}/{PREFIX} dev peer0",
                "link set peer0 up",
                "link set lo up",
            ]
        ).encode(),
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
