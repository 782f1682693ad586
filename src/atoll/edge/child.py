"""The edge as a child of `atoll up` / `atoll server`: `python -m atoll.edge --channel FD
--e2b-listen FD --server URL [--ca-file F]`.

The parent (controlplane.edge_host) bound ATOLL_E2B_HOST:ATOLL_E2B_PORT and hands the listening
socket down with a channel (shared.ipc). This process serves E2B's API there (e2b.app, with the
native edge routes behind `/v1/…`), forwarding control calls to the parent's API over loopback
and asking it over the channel only what has no route: a sandbox's state and `compat` (E2B's
auto-resume) for envd's `/health` and calls to a paused sandbox (op `state`, which never resumes). Configuration comes from the environment (ATOLL_E2B_TOKEN_KEY,
ATOLL_E2B_INTERNET, ATOLL_E2B_PAUSE_TIER, ATOLL_LOG_FORMAT, ATOLL_LOG_LEVEL). It stops when the
parent's end of the channel closes or on SIGTERM; SIGINT is the parent's. When the API serves
https, so does this port, with the API's certificate (`--tls-cert-file`, `--tls-key-file`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys

import uvicorn

from atoll.edge import service
from atoll.shared import ipc, logconfig


async def run(
    channel_sock: socket.socket,
    listen_sock: socket.socket,
    server: str,
    ca_file: str | None,
    tls: tuple[str, str] | None = None,
) -> None:
    async def handle(msg: dict, fds: list[socket.socket]):
        for s in fds:
            s.close()
        if msg.get("op") == "ping":
            return {}
        raise ipc.CallError("invalid_request", f"unknown operation {msg.get('op')!r}")

    channel = ipc.Channel(channel_sock, handler=handle, name="edge channel")
    channel.start()

    async def state_of(sid: str) -> dict | None:
        try:
            reply, _ = await channel.call("state", timeout=10, sandbox_id=sid)
        except (ipc.CallError, ipc.ChannelClosed, TimeoutError):
            return None
        return {"state": reply.get("state"), "compat": reply.get("compat")}

    edge = service.Edge(server, ca_file)
    app = service.e2b_asgi(edge, service.e2b_settings(server, ca_file), state_of=state_of)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    srv = uvicorn.Server(config)
    srv.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # SIGTERM: below; SIGINT: the parent's
    serving = asyncio.ensure_future(srv.serve(sockets=[listen_sock]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    waits = {asyncio.ensure_future(channel.closed.wait()), asyncio.ensure_future(stop.wait()), serving}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        srv.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 5)
        for t in waits:
            t.cancel()
        await app.control.aclose()
        await edge.aclose()
        await channel.aclose()
        with contextlib.suppress(OSError):
            listen_sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m atoll.edge", description=__doc__.split("\n")[0])
    parser.add_argument("--channel", type=int, required=True, help="the channel's descriptor (inherited)")
    parser.add_argument("--e2b-listen", type=int, required=True, help="the E2B port's socket (inherited)")
    parser.add_argument("--server", required=True, help="the API's URL (loopback)")
    parser.add_argument("--ca-file", default=None, help="the installation CA, when the API serves https")
    parser.add_argument("--tls-cert-file", default=None, help="serve https with this certificate (the API's)")
    parser.add_argument("--tls-key-file", default=None, help="and its key")
    args = parser.parse_args(argv)
    tls = (args.tls_cert_file, args.tls_key_file) if args.tls_cert_file and args.tls_key_file else None
    logconfig.configure(os.environ.get("ATOLL_LOG_FORMAT", "text"), os.environ.get("ATOLL_LOG_LEVEL", "INFO"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    try:
        channel_sock = socket.socket(fileno=args.channel)
        listen_sock = socket.socket(fileno=args.e2b_listen)
    except OSError as e:
        print(f"atoll edge: an inherited descriptor is not a socket: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    listen_sock.setblocking(False)
    asyncio.run(run(channel_sock, listen_sock, args.server, args.ca_file, tls))
