"""The edge's process, seen from the control plane: E2B's API (issue 22) served beside the server.

`atoll server` and `atoll up` bind ATOLL_E2B_HOST:ATOLL_E2B_PORT themselves (a port in use is
their start-up error, naming the variable), then start `python -m atoll.edge` (edge.child) with
that socket and a channel (atoll.shared.ipc). The child serves E2B's control API by forwarding
each call to this server's own API over loopback with the caller's key, so the E2B protocol work
runs on the child's event loop, not the API's; over the channel it asks only a sandbox's state
(op `state`, for envd's `/health`, which never resumes). It gets ATOLL_E2B_TOKEN_KEY, the key of
the sandboxes' envd access tokens, derived from the installation's secrets key as the grant route
derives it (core.grants.e2b_access_key), so the child makes and checks tokens without a call and
the tokens open `E2B-Access` grants for envd's data calls. If the child dies it
is started again with the same socket. When the API serves https, E2B's port does too, with
the API's certificate (plain http otherwise: keep it on loopback). The child's answers carry
`domain` = ATOLL_E2B_DOMAIN as settled here (default the preview domain and the ingress router's
port), so the SDKs' sandbox hosts reach the ingress router, which relays them back to this port. Stopping the server stops it (by PID). ATOLL_E2B_PORT=0 or
`off`: none. Called by controlplane.main (build, serve_api) and so by atoll.up.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from atoll.controlplane import lifecycle
from atoll.core import config, errors, grants
from atoll.shared import ipc

log = logging.getLogger(__name__)


def token_key(secrets_key: bytes) -> str:
    """The envd access tokens' key k_e2b (hex), derived from the installation's secrets key exactly
    as the grant route derives it (core.grants.e2b_access_key), so a token the edge makes opens
    `Authorization: E2B-Access` grants and one the server makes passes the edge's own check."""
    return grants.e2b_access_key(secrets_key).hex()


def _local(host: str) -> str:
    """The bound address, or loopback for a wildcard."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def loopback_url(host: str, port: int, tls: bool) -> str:
    """The API's URL as the child reaches it: the bound address, or loopback for a wildcard."""
    host = _local(host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def reach(host: str, port: int, tls: bool) -> dict:
    """Where the ingress router reaches E2B's port (ingress.router.E2BEdge, as its config)."""
    return {"host": _local(host), "port": port, "tls": tls}


class EdgeHost:
    def __init__(
        self,
        manager: lifecycle.SandboxManager,
        *,
        host: str,
        port: int,
        api_url: str,
        ca_file: str | None,
        token_key_hex: str,
        internet: bool,
        pause_tier: str,
        sandbox_domain: str | None = None,
        tls: tuple[str, str] | None = None,
        log_format: str = "text",
        log_level: str = "INFO",
    ):
        self.manager = manager
        self.host, self.port = host, port
        self.scheme = "https" if tls else "http"
        self.sock: socket.socket | None = None
        env = {k: v for k, v in os.environ.items() if k != "ATOLL_API_KEY"}  # the edge needs no key
        env.update(
            ATOLL_E2B_TOKEN_KEY=token_key_hex,
            ATOLL_E2B_INTERNET="allow" if internet else "deny",
            ATOLL_E2B_PAUSE_TIER=pause_tier,
            ATOLL_E2B_DOMAIN=sandbox_domain or "off",
            ATOLL_LOG_FORMAT=log_format,
            ATOLL_LOG_LEVEL=log_level,
        )
        self.child = ipc.Child(
            "E2B edge",
            lambda fd, extra: [
                sys.executable,
                "-m",
                "atoll.edge",
                "--channel",
                str(fd),
                "--e2b-listen",
                str(extra[0]),
                "--server",
                api_url,
                *(["--ca-file", ca_file] if ca_file else []),
                *(["--tls-cert-file", tls[0], "--tls-key-file", tls[1]] if tls else []),
            ],
            env=env,
            extra_fds=lambda: [self.sock.fileno()] if self.sock is not None else [],
            handler=self.handle,
        )

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def bind(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(1024)
        except OSError as e:
            sock.close()
            raise config.SettingsError(
                f"E2B's API cannot listen on {self.host}:{self.port} ({e.strerror}); set ATOLL_E2B_PORT "
                "to a free port (or off), and ATOLL_E2B_HOST for the address"
            ) from None
        self.sock = sock

    async def start(self) -> None:
        if self.sock is None:
            self.bind()
        await self.child.start()

    async def handle(self, msg: dict, fds: list[socket.socket]):
        for s in fds:
            s.close()
        if msg.get("op") == "state":
            sid = str(msg.get("sandbox_id", ""))
            try:
                rec = self.manager.get(sid)
            except errors.NotFound:
                return {"state": None, "compat": None}
            except errors.AtollError as e:
                raise ipc.CallError(e.code, e.message) from None
            return {"state": str(rec.state), "compat": rec.compat}
        raise ipc.CallError("invalid_request", f"unknown operation {msg.get('op')!r}")

    async def aclose(self) -> None:
        await self.child.aclose()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
