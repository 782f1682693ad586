"""The ingress router as a process of its own: `python -m atoll.ingress --channel FD --listen FD`.

The control plane (`atoll server`, `atoll up`) starts it beside itself (controlplane.ingress_host)
with the listening socket it bound (so a busy port is the server's start-up error) and one channel
(atoll.shared.ipc). Preview traffic — TLS, HTTP parsing, bodies, WebSockets — runs here, never on the
event loop that serves the API. What only the control plane knows it asks over the channel
(`ChannelBackend`, the router's backend): may this request reach that port, with the sandbox
woken if it sleeps (`admit`: one question per request), is it still awake (`ready`, on a switched
connection), and a connection into the port (`connect`: the socket itself is handed over —
the worker's tunnel connection or the worker's socketpair end — so the bytes then flow between this
process and the worker's gateway only).
The server sends `tls {pem}` or `tls {cert_file, key_file}` before it counts the router ready.
It stops when the server's end of the channel closes or on SIGTERM; SIGINT is the server's.
Settings come in ATOLL_INGRESS_CONFIG (JSON: domain, trusted_proxies, log_format, log_level, and
e2b — {host, port, tls}, where E2B's API listens when it is served: the router relays the hosts of
E2B_DOMAIN mode there, ingress.router.E2BEdge).
Called by controlplane.ingress_host (spawn); uses ingress.router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import json
import logging
import os
import signal
import socket
import ssl
import sys

from atoll.core import errors, preview
from atoll.ingress import router as router_mod
from atoll.shared import ipc, logconfig, portstream, tlsstream

log = logging.getLogger(__name__)


def _target(t: preview.Target) -> dict:
    return {"sandbox_id": t.sandbox_id, "port": t.port}


def _raise(e: ipc.CallError) -> None:
    if e.code in ("refused", "os_error"):
        if e.errno == errno.ECONNREFUSED or e.code == "refused":
            raise ConnectionRefusedError(e.errno or errno.ECONNREFUSED, e.message)
        raise OSError(e.errno or errno.EIO, e.message)
    raise errors.from_code(e.code, e.message)


class ChannelBackend:
    """ingress.router.Backend over the channel to the control plane."""

    def __init__(self, channel: ipc.Channel):
        self.channel = channel

    async def _call(self, op: str, **fields) -> tuple[dict, list[socket.socket]]:
        try:
            return await self.channel.call(op, timeout=None, **fields)
        except ipc.CallError as e:
            _raise(e)
            raise  # not reached
        except ipc.ChannelClosed:
            raise errors.Unavailable("the control plane is not answering the ingress router; retry") from None

    async def admit(self, target, token, expires, sig, cookie) -> router_mod.Grant:
        reply, _ = await self._call(
            "admit", target=_target(target), token=token, expires=expires, sig=sig, cookie=cookie
        )
        return router_mod.Grant(reply["via"], reply.get("cookie"), int(reply.get("max_age", 0)))

    async def ready(self, target: preview.Target) -> None:
        await self._call("ready", target=_target(target))

    async def connect(self, target: preview.Target) -> portstream.SocketPort:
        _, fds = await self._call("connect", target=_target(target))
        if len(fds) != 1:
            for s in fds:
                s.close()
            raise errors.RuntimeFailure("the control plane answered a connection without its socket")
        return portstream.SocketPort(fds[0])


def tls_context(msg: dict) -> ssl.SSLContext:
    if msg.get("pem"):
        return tlsstream.server_context(msg["pem"].encode())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(msg["cert_file"], msg["key_file"])
    return ctx


async def run(channel_sock: socket.socket, listen_sock: socket.socket, config: dict) -> None:
    trusted = tuple(ipaddress.ip_network(n, strict=False) for n in config.get("trusted_proxies") or ())
    e2b = None
    if config.get("e2b"):
        e = config["e2b"]
        e2b = router_mod.E2BEdge(str(e["host"]), int(e["port"]), bool(e.get("tls")))
    router: router_mod.Router | None = None
    started = asyncio.Event()

    async def handle(msg: dict, fds: list[socket.socket]):
        nonlocal router
        for s in fds:
            s.close()
        if msg.get("op") == "tls":
            try:
                ctx = tls_context(msg)
            except (ssl.SSLError, OSError, KeyError) as e:
                raise ipc.CallError(
                    "invalid_request", f"the router's certificate cannot be used: {e}"
                ) from None
            if router is None:
                router = router_mod.Router(backend, ctx, config["domain"], trusted, e2b=e2b)
                await router.start(sock=listen_sock)
                started.set()
            else:
                router.ctx = ctx
            return {}
        if msg.get("op") == "ping":
            return {}
        if msg.get("op") == "stats":
            st = router.stats if router is not None else router_mod.Stats()
            return {"requests": st.requests, "refused": st.refused, "evicted": st.evicted}
        raise ipc.CallError("invalid_request", f"unknown operation {msg.get('op')!r}")

    channel = ipc.Channel(channel_sock, handler=handle, name="ingress channel")
    backend = ChannelBackend(channel)
    channel.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    waits = {asyncio.ensure_future(channel.closed.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in waits:
            t.cancel()
        if router is not None:
            await router.aclose()
        await channel.aclose()
        with contextlib.suppress(OSError):
            listen_sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m atoll.ingress", description=__doc__.split("\n")[0])
    parser.add_argument("--channel", type=int, required=True, help="the channel's descriptor (inherited)")
    parser.add_argument("--listen", type=int, required=True, help="the listening socket (inherited)")
    args = parser.parse_args(argv)
    config = json.loads(os.environ.get("ATOLL_INGRESS_CONFIG") or "{}")
    logconfig.configure(config.get("log_format", "text"), config.get("log_level", "INFO"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us
    try:
        channel_sock = socket.socket(fileno=args.channel)
        listen_sock = socket.socket(fileno=args.listen)
    except OSError as e:
        print(f"atoll ingress: an inherited descriptor is not a socket: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    listen_sock.setblocking(False)
    asyncio.run(run(channel_sock, listen_sock, config))
