"""The framing of an attached terminal's byte stream (a PTY session of a sandbox), in atoll's terms.

An attach is one bidirectional byte stream of frames: a 1-byte type and a 4-byte big-endian
payload length, then the payload. DATA carries terminal bytes both ways (keystrokes in, output
out); RESIZE (client -> sandbox) is two unsigned 16-bit numbers, columns then rows; EXIT
(sandbox -> client) is the exit code as a signed 32-bit number, the last frame of a session;
ERROR (sandbox -> client) is a JSON object {"code", "message"} about the previous request (a bad
resize, say) and does not end the session.

The one definition, shared by every side: it lives in the guest agent's package because the agent
imports nothing of atoll (it is packed alone into the sandbox), and everyone else imports it from
here. The agent speaks it (`ptys`, GET /pty/<id>/attach), the worker relays it unchanged
(`worker.guest.attach_pty`, `worker.tunnel`), and the control plane translates it to WebSocket
messages (`controlplane.routes_pty`); `testing.fake_worker` speaks it too. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
import struct

DATA = 1
RESIZE = 2
EXIT = 3
ERROR = 4
TYPES = (DATA, RESIZE, EXIT, ERROR)
HEADER = struct.Struct(">BI")
MAX_PAYLOAD = 1 << 20
MIN_SIZE = 1
MAX_COLS = 1000
MAX_ROWS = 1000
SCROLLBACK_BYTES = 64 * 1024
"""Recent output each session keeps and replays to a client that attaches."""


_PTY_ID = re.compile(r"^pty_[0-9a-f]{12}$")


def is_pty_id(value: str) -> bool:
    """Whether `value` has the shape of a terminal id (`pty_` and 12 hex digits)."""
    return bool(_PTY_ID.match(value))


def encode(kind: int, payload: bytes = b"") -> bytes:
    if kind not in TYPES:
        raise ValueError(f"unknown frame type {kind}")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(kind, len(payload)) + payload


def data(payload: bytes) -> bytes:
    """DATA frames for `payload`, split so that no frame exceeds MAX_PAYLOAD."""
    if not payload:
        return b""
    return b"".join(encode(DATA, payload[i : i + MAX_PAYLOAD]) for i in range(0, len(payload), MAX_PAYLOAD))


def resize(cols: int, rows: int) -> bytes:
    return encode(RESIZE, struct.pack(">HH", cols, rows))


def exit_frame(code: int) -> bytes:
    return encode(EXIT, struct.pack(">i", code))


def error(code: str, message: str) -> bytes:
    return encode(ERROR, json.dumps({"code": code, "message": message}).encode())


def parse_resize(payload: bytes) -> tuple[int, int]:
    if len(payload) != 4:
        raise ValueError(f"a resize frame carries 4 bytes, got {len(payload)}")
    cols, rows = struct.unpack(">HH", payload)
    return cols, rows


def parse_exit(payload: bytes) -> int:
    if len(payload) != 4:
        raise ValueError(f"an exit frame carries 4 bytes, got {len(payload)}")
    return struct.unpack(">i", payload)[0]


def parse_error(payload: bytes) -> dict:
    try:
        obj = json.loads(payload)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return {"code": "runtime_error", "message": payload[:300].decode("utf-8", "replace")}
    return {"code": str(obj.get("code", "runtime_error")), "message": str(obj.get("message", ""))}


def size_problem(cols: object, rows: object) -> str | None:
    """Why (cols, rows) is not a terminal size atoll accepts, or None."""
    for name, value, top in (("cols", cols, MAX_COLS), ("rows", rows, MAX_ROWS)):
        if isinstance(value, bool) or not isinstance(value, int) or not MIN_SIZE <= value <= top:
            return f"{name} must be an integer from {MIN_SIZE} to {top}, got {value!r}"
    return None


class Decoder:
    """Incremental parser: `feed` bytes as they arrive, get the complete (type, payload) frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        self._buf += chunk
        out = []
        while len(self._buf) >= HEADER.size:
            kind, length = HEADER.unpack_from(self._buf)
            if kind not in TYPES:
                raise ValueError(f"unknown frame type {kind}")
            if length > MAX_PAYLOAD:
                raise ValueError(f"frame payload of {length} bytes exceeds {MAX_PAYLOAD}")
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            out.append((kind, bytes(self._buf[HEADER.size : end])))
            del self._buf[:end]
        return out
