"""Secrets in the egress gateway: which placeholders become values on a connection — the one rule.

A sandbox holds only a placeholder for each secret (`atoll_ph_` and 32 hex digits). The gateway
puts the value in its place, in a request's target and header values, only when all of these hold
(`decide`, asked for every request, and for HTTPS before the connection is intercepted at all):
  * the name the connection is for (its TLS SNI; for plain HTTP its Host, the same on every
    request of the connection) is one of the secret's hosts (`*.suffix` matches names below);
  * the connection's destination — the address the sandbox connected to — is an address that
    name resolves to for the sandbox (the same hosts files and resolver its DNS answers from),
    checked now, never because a Host header or an SNI says so;
  * over plain HTTP, the secret allows it (`allow_http`): a value sent in clear text can be read by
    anyone on the path.
Otherwise the placeholder passes unchanged, and a request that carried one is counted as refused.
Called by gateway.egress (decide for a connection) and gateway.httprelay (decide, substitute).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Binding:
    """One secret as the gateway applies it: `placeholder` (what the sandbox sees) becomes `value`
    on connections to `hosts` (lower-case names; `*.example.com` = any name below example.com);
    over plain HTTP only with `allow_http`."""

    placeholder: str
    value: str = dataclasses.field(repr=False)  # never in a log line
    hosts: tuple[str, ...]
    allow_http: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one request gets: the bindings applied, and those its name matched but the rule
    refused (their placeholders pass unchanged)."""

    apply: tuple[Binding, ...] = ()
    refused: tuple[Binding, ...] = ()
    why: str = ""


NONE = Decision()


def host_matches(pattern: str, name: str) -> bool:
    """Whether `name` is `pattern` (case-insensitive), or below it for a `*.` pattern."""
    pattern, name = pattern.lower().rstrip("."), name.lower().rstrip(".")
    if pattern.startswith("*."):
        suffix = pattern[1:]
        return len(name) > len(suffix) and name.endswith(suffix)
    return pattern == name


def bindings_for(name: str, bindings: Iterable[Binding]) -> tuple[Binding, ...]:
    """The bindings whose hosts match `name` (before the address and clear-text checks)."""
    return tuple(b for b in bindings if any(host_matches(h, name) for h in b.hosts))


async def decide(
    bindings: Iterable[Binding],
    name: str,
    ip: str,
    *,
    plain: bool,
    resolve: typing.Callable[[str], typing.Awaitable[frozenset[str]]],
) -> Decision:
    """THE rule (module docstring): the bindings that apply on a connection to `ip` for `name`."""
    named = bindings_for(name, bindings) if name else ()
    if not named:
        return NONE
    addresses = await resolve(name)
    if ip not in addresses:
        return Decision((), named, f"{ip} is not an address {name!r} resolves to")
    if not plain:
        return Decision(named, ())
    apply = tuple(b for b in named if b.allow_http)
    refused = tuple(b for b in named if not b.allow_http)
    return Decision(apply, refused, "plain HTTP, and the secret does not allow_http" if refused else "")


def substitute(data: bytes, bindings: Iterable[Binding]) -> bytes:
    """`data` with every binding's placeholder replaced by its value (one pass: a value that
    contains a placeholder is not replaced again)."""
    table = {b.placeholder.encode(): b.value.encode() for b in bindings if b.placeholder}
    if not table or not any(p in data for p in table):
        return data
    pattern = re.compile(b"|".join(re.escape(p) for p in sorted(table, key=len, reverse=True)))
    return pattern.sub(lambda m: table[m.group(0)], data)


def carries(data: bytes, bindings: Iterable[Binding]) -> bool:
    """Whether `data` holds the placeholder of one of `bindings`."""
    return any(b.placeholder and b.placeholder.encode() in data for b in bindings)
