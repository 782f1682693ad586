"""Preview URLs: how a request names its sandbox and port, and how it proves it may reach them.

A request names its target by host name, `{port}-{sandbox_id}.{domain}` (the installation's
ATOLL_PREVIEW_DOMAIN, default `atoll.localhost`), or, for clients without wildcard DNS, by the
headers `Atoll-Sandbox-Id` and `Atoll-Sandbox-Port` on any host name (they win over the host).
A private port (the default) needs proof, one of:
  - the header `Atoll-Access-Token: <token>` — the sandbox's token, `token(key, sid)`;
  - a signed URL, `?atoll_expires=<unix time>&atoll_signature=<sig>` for one port until then;
  - the cookie the router sets after a signed URL was used (so a browser's further requests to the
    same host carry it), which holds the same signature and expiry.
When E2B's API is served, the hosts of E2B_DOMAIN mode are not previews (`e2b_target`):
`api.{domain}` and `{49983|49999}-{sandbox_id}.{domain}` go to the E2B edge, which checks E2B's
own proofs (X-API-KEY, X-Access-Token).
Keys and signatures are HMAC-SHA256 over the installation's preview key. Pure (no I/O): called by
the ingress router and by controlplane.previews (which hands out URLs and tokens).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import urllib.parse
from dataclasses import dataclass

TOKEN_HEADER = "atoll-access-token"
ID_HEADER = "atoll-sandbox-id"
PORT_HEADER = "atoll-sandbox-port"
EXPIRES_PARAM = "atoll_expires"
SIGNATURE_PARAM = "atoll_signature"
COOKIE = "atoll_preview"
_SID = re.compile(r"^sb-[a-z0-9]{1,40}$")
RESERVED_PORTS = frozenset({49999})
"""Ports no preview reaches: the guest agent's (worker.bundle.AGENT_PORT), which runs commands as
root for the worker. A test keeps the two in step."""


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


class BadTarget(ValueError):
    """The request names a sandbox or port that cannot be one."""


def check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise BadTarget(f"port {port!r} is not a TCP port (1-65535)")
    if port in RESERVED_PORTS:
        raise BadTarget(f"port {port} is the guest agent's, atoll's own; no preview reaches it")
    return port


def _port(text: str, where: str) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        raise BadTarget(f"{where} {text!r} is not a port number")
    return check_port(int(text))


def _label_under(host: str, domain: str) -> str | None:
    """The part of `host` (port and trailing dot left off) before `.{domain}`; None when the host
    is an IPv6 literal or not under the domain."""
    name = host.strip().lower()
    if name.startswith("["):
        return None
    name = name.rsplit(":", 1)[0] if ":" in name else name
    name = name.rstrip(".")
    suffix = "." + domain.lower().rstrip(".")
    if not name.endswith(suffix):
        return None
    return name[: -len(suffix)]


def host_target(host: str, domain: str) -> Target | None:
    """`{port}-{sid}.{domain}[:N]` → Target; None when the host is not under the domain."""
    label = _label_under(host, domain)
    if label is None:
        return None
    if "." in label or "-" not in label:
        suffix = "." + domain.lower().rstrip(".")
        raise BadTarget(f"host {host!r} is not {{port}}-{{sandbox_id}}{suffix}")
    port, sid = label.split("-", 1)
    if not _SID.fullmatch(sid):
        raise BadTarget(f"{sid!r} in host {host!r} is not a sandbox id")
    return Target(sid, _port(port, "the port in host " + repr(host)))


E2B_API_LABEL = "api"
E2B_ENVD_PORT = 49983
E2B_INTERPRETER_PORT = 49999
E2B_PORTS = frozenset({E2B_ENVD_PORT, E2B_INTERPRETER_PORT})
"""The ports of E2B's sandbox hosts (`{port}-{sid}.{domain}`, the SDKs' E2B_DOMAIN mode): envd and
the code interpreter. With E2B's API served, the router sends them to the E2B edge, not to the
sandbox (49999 is also the guest agent's port inside every sandbox: no preview reaches it)."""


@dataclass(frozen=True)
class E2BTarget:
    """A request for the E2B edge: its control API (`sandbox_id` None) or envd / the code
    interpreter of one sandbox."""

    sandbox_id: str | None = None
    port: int | None = None


def e2b_target(host: str, domain: str) -> E2BTarget | None:
    """`api.{domain}[:N]` → the control API; `{49983|49999}-{sid}.{domain}[:N]` → that sandbox's
    envd or code interpreter; None for any other host (a preview, or not ours)."""
    label = _label_under(host, domain)
    if label is None:
        return None
    if label == E2B_API_LABEL:
        return E2BTarget()
    port, _, sid = label.partition("-")
    if not port.isascii() or not port.isdigit() or len(port) > 5 or int(port) not in E2B_PORTS:
        return None
    if not _SID.fullmatch(sid):
        raise BadTarget(f"{sid!r} in host {host!r} is not a sandbox id")
    return E2BTarget(sid, int(port))


def header_target(sid: str | None, port: str | None) -> Target | None:
    if sid is None and port is None:
        return None
    if sid is None or port is None:
        raise BadTarget("give both Atoll-Sandbox-Id and Atoll-Sandbox-Port, or neither")
    sid = sid.strip()
    if not _SID.fullmatch(sid):
        raise BadTarget(f"Atoll-Sandbox-Id {sid!r} is not a sandbox id")
    return Target(sid, _port(port.strip(), "Atoll-Sandbox-Port"))


def _mac(key: bytes, text: str) -> str:
    digest = hmac.new(key, text.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def token(key: bytes, sid: str) -> str:
    """The sandbox's access token (every private port of it)."""
    return "atp_" + _mac(key, "token\x00" + sid)[:40]


def signature(key: bytes, sid: str, port: int, expires: int) -> str:
    return _mac(key, f"url\x00{sid}\x00{port}\x00{expires}")[:43]


def token_ok(key: bytes, sid: str, presented: str) -> bool:
    return hmac.compare_digest(token(key, sid).encode(), presented.strip().encode())


def signature_ok(key: bytes, target: Target, expires: str, sig: str, now: float) -> str | None:
    """None when valid, else why not."""
    if not expires.isascii() or not expires.isdigit() or len(expires) > 12:
        return f"{EXPIRES_PARAM} {expires!r} is not a unix time"
    if int(expires) < now:
        return f"the signed URL expired at {int(expires)} (it is now {int(now)}); ask for a new one"
    good = signature(key, target.sandbox_id, target.port, int(expires))
    if not hmac.compare_digest(good.encode(), sig.encode()):
        return "the URL's signature is not valid for this sandbox and port"
    return None


def signed_query(key: bytes, sid: str, port: int, expires: int) -> str:
    return urllib.parse.urlencode(
        {EXPIRES_PARAM: expires, SIGNATURE_PARAM: signature(key, sid, port, expires)}
    )


def split_signed(target: str) -> tuple[str, str | None, str | None]:
    """A request target without the signing parameters, and their values (None if absent)."""
    path, sep, query = target.partition("?")
    if not sep:
        return target, None, None
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    if not any(k in (EXPIRES_PARAM, SIGNATURE_PARAM) for k, _ in pairs):
        return target, None, None
    expires = next((v for k, v in pairs if k == EXPIRES_PARAM), None)
    sig = next((v for k, v in pairs if k == SIGNATURE_PARAM), None)
    rest = [p for p in query.split("&") if p.split("=", 1)[0] not in (EXPIRES_PARAM, SIGNATURE_PARAM)]
    return path + ("?" + "&".join(rest) if rest else ""), expires, sig


def url(domain: str, ingress_port: int, sid: str, port: int) -> str:
    suffix = "" if ingress_port == 443 else f":{ingress_port}"
    return f"https://{port}-{sid}.{domain}{suffix}/"
