"""A terminal's WebSocket relayed to its worker's frame stream (guest.agent.ptyframes): binary
messages are terminal bytes both ways, client text messages `{"resize": [cols, rows]}`; the program's
end is a text `{"exit_code": N}` and a normal close (1000), an error frame a text `{"error": {...}}`;
a client message over MAX_MESSAGE_BYTES closes the socket with 1009 and the session lives on; a
worker that ends the attach without an exit (a disk checkpoint resets it) closes with 1012.
The one relay of terminals: used by controlplane.routes_pty (the API) and edge.service (the edge).
"""

from __future__ import annotations

import json
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from atoll.core import worker_api as api
from atoll.guest.agent import ptyframes
from atoll.shared import relay as relay_mod

log = logging.getLogger(__name__)

_READ = 64 * 1024
MAX_MESSAGE_BYTES = 1 << 20
"""The largest client message a terminal takes. Past it the socket closes with 1009 and the session
lives on (attach again): terminal input is keystrokes and pastes, and one huge message would sit
in the session's input queue, behind which the terminal stops answering. uvicorn's `ws_max_size`
(controlplane.main) refuses such a frame before it is buffered; this check holds under any server."""
TOO_BIG_CLOSE = 1009
DETACHED_CLOSE = 1012
"""Close code when the worker ended the attach without an exit (a disk checkpoint resets it):
the session lives on; attach again."""


def error_text(code: str, message: str) -> str:
    return json.dumps({"error": {"code": code, "message": message}})


async def relay(ws: WebSocket, stream: api.PortStream, sid: str, pty_id: str) -> None:
    async def outward() -> None:
        decoder = ptyframes.Decoder()
        while True:
            data = await stream.read(_READ)
            if not data:
                await ws.close(
                    code=DETACHED_CLOSE,
                    reason="the terminal was detached by its worker (standby?); the session lives on: attach again",
                )
                return
            for kind, payload in decoder.feed(data):
                if kind == ptyframes.DATA:
                    await ws.send_bytes(payload)
                elif kind == ptyframes.EXIT:
                    await ws.send_text(json.dumps({"exit_code": ptyframes.parse_exit(payload)}))
                    await ws.close(code=1000)
                    return
                elif kind == ptyframes.ERROR:
                    await ws.send_text(json.dumps({"error": ptyframes.parse_error(payload)}))

    async def inward() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            size = (
                len(msg["bytes"]) if msg.get("bytes") is not None else len((msg.get("text") or "").encode())
            )
            if size > MAX_MESSAGE_BYTES:
                log.info(
                    "terminal message refused: too big",
                    extra={"sandbox_id": sid, "pty_id": pty_id, "bytes": size, "limit": MAX_MESSAGE_BYTES},
                )
                await ws.close(
                    code=TOO_BIG_CLOSE,
                    reason=f"message over {MAX_MESSAGE_BYTES} bytes; send less at once; the session lives on",
                )
                return
            if msg.get("bytes") is not None:
                await stream.write(ptyframes.data(msg["bytes"]))
                continue
            problem, frame = _text_message(msg.get("text") or "")
            if frame is not None:
                await stream.write(frame)
            else:
                await ws.send_text(error_text("invalid_request", problem))

    for t in await relay_mod.first_ends(outward(), inward()):
        exc = t.exception()
        if exc is not None and not isinstance(exc, (WebSocketDisconnect, OSError, RuntimeError)):
            raise exc


def _text_message(text: str) -> tuple[str, bytes | None]:
    """A client text message as a frame for the worker, or why it is refused."""
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    size = obj.get("resize") if isinstance(obj, dict) else None
    if not isinstance(size, list) or len(size) != 2:
        return (
            'text messages are {"resize": [cols, rows]}; send terminal input as binary messages, '
            f"got {text[:100]!r}",
            None,
        )
    problem = ptyframes.size_problem(size[0], size[1])
    if problem:
        return f"resize refused: {problem}; the terminal keeps its size", None
    return "", ptyframes.resize(size[0], size[1])
