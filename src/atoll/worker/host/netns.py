"""Per-sandbox network namespaces (adapter over iproute2).

Each sandbox gets two namespaces joined by a veth pair:
  `<name>`   — the sandbox's own netns; runsc (`--network=sandbox`) takes over its `eth0`.
  `<name>-h` — the host side, holding the peer end. The worker opens its sockets to the guest agent
               inside it (see agent_channel), so every sandbox can use the *same* addresses
               (SANDBOX_IP / HOST_IP): checkpoint images then restore anywhere, and two installations
               on one host never collide on addresses, only on names (which carry the installation id).
The host side has no route anywhere and forwards nothing: its nftables (FENCE) send the sandbox's
TCP connections and DNS questions to the egress gateway's sockets there (worker.edge) and drop the
rest, so a sandbox reaches only its worker's gateway and its agent channel.
Called by worker.sandboxes, worker.tiers, worker.edge and worker.agent_channel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import socket
import struct

from atoll.worker.host import hostcmd

SANDBOX_IP = "10.99.0.2"
HOST_IP = "10.99.0.1"
PREFIX = 30
NETNS_DIR = "/run/netns"
# Fixed MACs: a restored sandbox keeps its neighbour table, so the peer's address must not change.
SANDBOX_MAC = "02:a7:0a:63:00:02"
HOST_MAC = "02:a7:0a:63:00:01"
# Everything leaves through the host side (where the egress gateway listens and nftables decides);
# runsc copies the default route and the permanent neighbour entry when it takes eth0 over.
_ROUTE = (
    f"route replace default via {HOST_IP} dev eth0",
    f"neigh replace {HOST_IP} lladdr {HOST_MAC} dev eth0 nud permanent",
)


_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
ns_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-netns")
"""The thread sockets are made on: it enters a namespace with setns(2) and leaves it again."""
_LINGER0 = struct.pack("ii", 1, 0)

# The host side's firewall (nftables, loaded into `<name>-h` before the sandbox starts). runsc's
# netstack sends through AF_PACKET, which bypasses netfilter in the sandbox's own namespace, so the
# rules sit where its frames are received. TCP to anywhere goes to the egress gateway's listener
# (it reads the original destination from conntrack; DNS over TCP too, decided like any TCP), DNS
# over UDP to any server to the gateway's resolver; everything else (other UDP, ICMP, IPv6, frames
# that are not IPv4 or ARP) is dropped and counted, and so are new flows past 500 a second (a
# connect flood would slow every sandbox's egress and fill conntrack).
# The worker's own connections to the guest agent leave from here and are let through.
FENCE = """
table netdev atoll_l2 {
  chain ingress {
    type filter hook ingress device "peer0" priority -500; policy drop;
    ether type { ip, arp } accept
  }
}
table ip atoll_edge {
  counter refused {}
  chain prerouting {
    type nat hook prerouting priority dstnat; policy accept;
    iifname "peer0" udp dport 53 redirect to :53
    iifname "peer0" meta l4proto tcp redirect to :15001
  }
  chain input {
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
    ct state established,related accept
    iifname "peer0" ct state new limit rate over 500/second burst 1000 packets counter name "refused" drop
    iifname "peer0" ip saddr 10.99.0.2 ip daddr 10.99.0.1 udp dport 53 accept
    iifname "peer0" ip saddr 10.99.0.2 ip daddr 10.99.0.1 tcp dport 15001 ct status dnat accept
    counter name "refused" drop
  }
  chain forward {
    type filter hook forward priority filter; policy drop;
  }
  chain output {
    type filter hook output priority filter; policy drop;
    oifname "lo" accept
    ct state established,related accept
    oifname "peer0" ip daddr 10.99.0.2 accept
  }
}
table ip6 atoll_edge6 {
  chain input {
    type filter hook input priority filter; policy drop;
  }
  chain forward {
    type filter hook forward priority filter; policy drop;
  }
  chain output {
    type filter hook output priority filter; policy drop;
  }
}
"""


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def socket_in(ns_path: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """An IPv4 socket born in the namespace `ns_path` (run on `ns_thread`: it switches the calling
    thread's namespace and back). TCP sockets get SO_LINGER 0 (closing is an RST, so no TIME_WAIT
    lands inside a sandbox) and TCP_NODELAY."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(ns_path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, kind)
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)
    if kind == socket.SOCK_STREAM:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


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
        [
            "link set eth0 addrgenmode none",  # no IPv6 link-local address for runsc to copy
            f"link set eth0 address {SANDBOX_MAC}",
            f"addr add {SANDBOX_IP}/{PREFIX} dev eth0",
            "link set eth0 up",
            "link set lo up",
            *_ROUTE,
        ]
    )
    host = "\n".join(
        [
            "link set peer0 addrgenmode none",
            f"link set peer0 address {HOST_MAC}",
            f"addr add {HOST_IP}/{PREFIX} dev peer0",
            "link set peer0 up",
            "link set lo up",
        ]
    )
    await asyncio.gather(
        hostcmd.run("ip", "-n", name, "-batch", "-", input=sandbox_side.encode()),
        hostcmd.run("ip", "-n", hs, "-batch", "-", input=host.encode()),
        hostcmd.run("nsenter", f"--net={path(hs)}", "nft", "-f", "-", input=FENCE.encode()),
    )


async def readdress(name: str) -> None:
    """Give eth0 its address back: runsc removes it when it takes the interface over (one `ip`)."""
    await hostcmd.run(
        "ip",
        "-n",
        name,
        "-batch",
        "-",
        input="\n".join(
            [f"addr replace {SANDBOX_IP}/{PREFIX} dev eth0", "link set eth0 up", *_ROUTE, ""]
        ).encode(),
    )


async def drop_stray_address(name: str) -> bool:
    """Take the address off eth0 if the host kernel holds one while runsc runs the sandbox (runsc
    took it off when it started; one added since makes the host kernel, not gVisor, answer every
    connection to the sandbox: RSTs). Returns whether there was one."""
    _rc, out, _err = await hostcmd.run(
        "ip", "-n", name, "-4", "-o", "addr", "show", "dev", "eth0", check=False
    )
    if f" {SANDBOX_IP}/" not in out:
        return False
    await hostcmd.run("ip", "-n", name, "addr", "del", f"{SANDBOX_IP}/{PREFIX}", "dev", "eth0", check=False)
    return True


async def delete(name: str) -> None:
    for ns in (name, host_side(name)):
        if exists(ns):
            await hostcmd.run("ip", "netns", "del", ns, check=False)
