"""A sandbox's egress policy: the `allow_out` / `deny_out` entries, parsed, checked and decided.

Entries (each optionally followed by `:PORT`; no port means every port):
  `pypi.org`        a domain, matched by name (HTTP Host, TLS SNI, a DNS question), case-insensitive;
  `*.github.com`    every name below github.com (not github.com itself);
  `203.0.113.7`     an IPv4 address (= /32), matched against a connection's destination address;
  `10.20.0.0/16`    an IPv4 network;
  `*`               the whole public internet: any public address, and any name whose address is
                    public (private, loopback, link-local, shared, multicast and reserved ranges
                    are not in it; a domain or network entry still reaches those).
`deny_out` takes the same entries and wins over `allow_out`. The default is deny.

A connection is allowed when nothing in `deny_out` matches it and either a network entry (or `*`
for a public address) matches its destination address, or it carries a name (Host, SNI) that a
domain entry (or `*`) matches *and* its destination is one of the addresses that name resolves to
for the gateway. A raw-IP connection (no name) therefore needs a network entry, even to an address
an allowed domain resolves to. IPv6 entries are refused: sandboxes have no IPv6 path (docs).

Pure: no I/O. Called by controlplane (validation of requests: a bad entry is a 400 naming it) and
by the worker's egress gateway and DNS (decisions).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from atoll.core import errors

MAX_ENTRIES = 512
"""Entries per list (allow_out or deny_out)."""

_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
# Not "the public internet" for `*`: RFC 6890 special-purpose ranges and what Python calls private.
_NOT_PUBLIC = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
)


def is_public(ip: str) -> bool:
    """Whether an IPv4 address is on the public internet (what `*` reaches)."""
    addr = ipaddress.IPv4Address(ip)
    return not any(addr in n for n in _NOT_PUBLIC)


def normalize_name(name: str) -> str | None:
    """A host name as matched (lower case, no trailing dot), or None when it is not a valid DNS
    name (an IP literal is not a name)."""
    n = name.strip().lower().rstrip(".")
    if not n or len(n) > 253:
        return None
    labels = n.split(".")
    if not all(_LABEL.fullmatch(x) for x in labels):
        return None
    if all(x.isdigit() for x in labels):
        return None
    return n


@dataclass(frozen=True)
class Entry:
    """One parsed entry; `text` is its normalized form (what the API answers and 403s name)."""

    text: str
    kind: str  # "domain" | "suffix" | "net" | "any"
    value: str  # the name, the suffix (".github.com"), the network, or "*"
    port: int | None

    def matches_port(self, port: int) -> bool:
        return self.port is None or self.port == port

    def matches_address(self, ip: str, port: int) -> bool:
        """A network entry (or `*` for a public address) that covers this destination."""
        if not self.matches_port(port):
            return False
        if self.kind == "net":
            return ipaddress.IPv4Address(ip) in ipaddress.IPv4Network(self.value)
        if self.kind == "any":
            return is_public(ip)
        return False

    def matches_name(self, name: str, port: int | None = None) -> bool:
        """A domain entry (or `*`) that covers this name (on `port`; None: on some port)."""
        if port is not None and not self.matches_port(port):
            return False
        if self.kind == "domain":
            return name == self.value
        if self.kind == "suffix":
            return name.endswith(self.value)
        return self.kind == "any"


def _bad(entry: object, where: str, why: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"network.{where}: entry {entry!r} is not valid: {why}; an entry is a domain (pypi.org), "
        "a wildcard domain (*.github.com), an IPv4 address or network (203.0.113.7, 10.0.0.0/8), "
        "or * (the public internet), each optionally with :PORT (pypi.org:443)"
    )


def parse_entry(raw: object, where: str = "allow_out") -> Entry:
    if not isinstance(raw, str):
        raise _bad(raw, where, "it must be a string")
    text = raw.strip()
    if not text or len(text) > 300:
        raise _bad(raw, where, "it is empty or longer than 300 characters")
    if text.startswith("[") or text.count(":") > 1:
        raise _bad(raw, where, "IPv6 is not supported (sandboxes have no IPv6 path)")
    host, port = text, None
    if ":" in text:
        host, _, p = text.partition(":")
        if not re.fullmatch(r"[0-9]{1,5}", p) or not 1 <= int(p) <= 65535:
            raise _bad(raw, where, f"the port {p!r} is not a number from 1 to 65535")
        port = int(p)
    suffix = f":{port}" if port is not None else ""
    if host == "*":
        return Entry("*" + suffix, "any", "*", port)
    if not host.isascii():
        raise _bad(raw, where, "it is not ASCII (write internationalized domains in their xn-- form)")
    if host[:1].isdigit() and re.fullmatch(r"[0-9./]+", host):
        try:
            net = ipaddress.IPv4Network(host, strict=True)
        except ValueError as e:
            raise _bad(raw, where, f"not an IPv4 address or network ({e})") from None
        shown = str(net.network_address) if net.prefixlen == 32 and "/" not in host else str(net)
        return Entry(shown + suffix, "net", str(net), port)
    if host.startswith("*."):
        name = normalize_name(host[2:])
        if name is None:
            raise _bad(raw, where, "what follows '*.' is not a valid domain name")
        return Entry(f"*.{name}{suffix}", "suffix", "." + name, port)
    if "*" in host:
        raise _bad(raw, where, "a wildcard is only allowed as a whole first label ('*.example.com')")
    name = normalize_name(host)
    if name is None:
        raise _bad(raw, where, "not a valid domain name")
    return Entry(name + suffix, "domain", name, port)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: str
    """Why: the entry that allowed or denied it, or 'default deny'."""


@dataclass(frozen=True)
class Policy:
    allow_out: tuple[Entry, ...] = ()
    deny_out: tuple[Entry, ...] = ()

    def to_wire(self) -> dict[str, list[str]]:
        return {"allow_out": [e.text for e in self.allow_out], "deny_out": [e.text for e in self.deny_out]}

    # ---- decisions ----------------------------------------------------------------------------
    def _denied(self, ip: str | None, name: str | None, port: int) -> Entry | None:
        for e in self.deny_out:
            if ip is not None and e.matches_address(ip, port):
                return e
            if name is not None and e.kind in ("domain", "suffix") and e.matches_name(name, port):
                return e
            if e.kind == "any" and e.matches_port(port) and (ip is None or is_public(ip)):
                return e
        return None

    def denies_names(self) -> bool:
        """Whether deny_out has domain entries (a connection its address allows may still be
        refused by the name it carries)."""
        return any(e.kind in ("domain", "suffix") for e in self.deny_out)

    def decide_named_address(self, name: str, ip: str, port: int) -> Decision:
        """A connection that `decide_address` allowed and that turns out to name `name`: only
        deny_out can still refuse it."""
        d = self._denied(ip, name, port)
        if d is not None:
            return Decision(False, f"deny_out {d.text}")
        return Decision(True, "allowed by its address")

    def decide_address(self, ip: str, port: int) -> Decision:
        """A connection to `ip:port` with no name known (yet)."""
        d = self._denied(ip, None, port)
        if d is not None:
            return Decision(False, f"deny_out {d.text}")
        for e in self.allow_out:
            if e.matches_address(ip, port):
                return Decision(True, f"allow_out {e.text}")
        return Decision(False, "default deny")

    def decide_name(self, name: str, ip: str, port: int, resolved: frozenset[str]) -> Decision:
        """A connection to `ip:port` that names `name` (Host, SNI); `resolved`: the addresses the
        gateway resolves `name` to. The name must be allowed *and* the address one of those."""
        d = self._denied(ip, name, port)
        if d is not None:
            return Decision(False, f"deny_out {d.text}")
        by_address = self.decide_address(ip, port)
        if by_address.allowed:
            return by_address
        why = "default deny"
        for e in self.allow_out:
            if not e.matches_name(name, port):
                continue
            if ip not in resolved:
                why = f"allow_out {e.text} names {name}, which does not resolve to {ip} here"
            elif e.kind == "any" and not is_public(ip):
                why = f"allow_out {e.text} reaches public addresses only, not {ip}"
            else:
                return Decision(True, f"allow_out {e.text}")
        return Decision(False, why)

    def may_resolve(self, name: str) -> bool:
        """Whether the gateway's DNS answers this name (some entry could allow a connection to it)."""
        if any(
            e.kind in ("domain", "suffix") and e.port is None and e.matches_name(name) for e in self.deny_out
        ):
            return False
        return any(e.matches_name(name) for e in self.allow_out)


DENY_ALL = Policy()


def parse(body: object, where: str = "network") -> Policy:
    """`{"allow_out": [...], "deny_out": [...]}` (both optional) → Policy, or a 400 naming the
    first bad entry."""
    if body is None:
        return DENY_ALL
    if not isinstance(body, dict):
        raise errors.InvalidRequest(
            f'{where} must be an object like {{"allow_out": ["pypi.org"], "deny_out": []}}, '
            f"not {type(body).__name__}"
        )
    unknown = set(body) - {"allow_out", "deny_out"}
    if unknown:
        raise errors.InvalidRequest(
            f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; "
            "the fields are allow_out and deny_out"
        )
    lists: dict[str, tuple[Entry, ...]] = {}
    for key in ("allow_out", "deny_out"):
        raw = body.get(key) or []
        if not isinstance(raw, list):
            raise errors.InvalidRequest(f"{where}.{key} must be a list of strings, not {type(raw).__name__}")
        if len(raw) > MAX_ENTRIES:
            raise errors.InvalidRequest(
                f"{where}.{key} has {len(raw)} entries; at most {MAX_ENTRIES} are allowed"
            )
        seen: dict[str, Entry] = {}
        for item in raw:
            e = parse_entry(item, key)
            seen.setdefault(e.text, e)
        lists[key] = tuple(seen.values())
    return Policy(lists["allow_out"], lists["deny_out"])


def from_wire(data: dict | None) -> Policy:
    """A policy as stored or sent between processes (already checked once; checked again)."""
    return parse(data or {}, "network")
