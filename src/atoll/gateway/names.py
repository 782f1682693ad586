"""What a name resolves to for the gateway: the worker's hosts files first (/etc/hosts, then
ATOLL_EXTRA_HOSTS, a hosts-format file), then the worker's own resolver (getaddrinfo, IPv4).

Names a hosts file knows are answered from it alone and never forwarded; tests name their test
hosts this way, so no query of theirs reaches the machine's resolver. Answers are cached for 30 s.
Called by gateway.egress (the destination check) and gateway.dns (the answers).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time

from atoll.core import netpolicy

log = logging.getLogger(__name__)
CACHE_S = 30.0
CACHE_MAX = 10000


def read_hosts(paths: list[str]) -> dict[str, frozenset[str]]:
    """name → its IPv4 addresses, from hosts-format files (later files add to earlier ones)."""
    out: dict[str, set[str]] = {}
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split("#", 1)[0].split()
            if len(fields) < 2:
                continue
            try:
                addr = ipaddress.ip_address(fields[0])
            except ValueError:
                continue
            for raw in fields[1:]:
                name = netpolicy.normalize_name(raw)
                if name is None:
                    continue
                out.setdefault(name, set())
                if addr.version == 4:
                    out[name].add(str(addr))
    return {k: frozenset(v) for k, v in out.items()}


class Names:
    def __init__(self, hosts_files: list[str]):
        self.hosts_files = hosts_files
        self._hosts: dict[str, frozenset[str]] = {}
        self._hosts_stamp: tuple = ()
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}

    def _stamp(self) -> tuple:
        out = []
        for p in self.hosts_files:
            try:
                st = os.stat(p)
                out.append((p, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((p, None, None))
        return tuple(out)

    def hosts(self) -> dict[str, frozenset[str]]:
        stamp = self._stamp()
        if stamp != self._hosts_stamp:
            self._hosts, self._hosts_stamp = read_hosts(self.hosts_files), stamp
            self._cache.clear()
        return self._hosts

    def in_hosts(self, name: str) -> bool:
        return name in self.hosts()

    def known(self, name: str) -> frozenset[str] | None:
        """The addresses of `name` if known without asking anyone (hosts files, the cache)."""
        known = self.hosts().get(name)
        if known is not None:
            return known
        hit = self._cache.get(name)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        return None

    async def resolve(self, name: str) -> frozenset[str]:
        """The IPv4 addresses of `name` (empty when it has none)."""
        known = self.known(name)
        if known is not None:
            return known
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, None, family=socket.AF_INET, type=socket.SOCK_STREAM
            )
            addrs = frozenset(str(i[4][0]) for i in infos)
        except (OSError, UnicodeError) as e:
            log.info("gateway: %s does not resolve: %s", name, e)
            addrs = frozenset()
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()
        self._cache[name] = (time.monotonic() + CACHE_S, addrs)
        return addrs
