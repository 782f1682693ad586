"""HTTP/1.1 on one client connection: request parsing (head, Content-Length or chunked body,
`Expect: 100-continue`), responses (sized or chunked) and the connection's lifecycle.

No http.server: it costs ~30 ms of imports and sends `Connection: close` with every error. `Conn.run`
is the job `__main__` gives the thread pool for each accepted socket; it hands every request to
`routing.Agent.dispatch` and turns ApiError / BadRequest into error responses. The agent never closes
a connection first on the normal path (keep-alive; the host closes with RST); when it must end one it
waits CLOSE_WAIT_S for the client to close, else resets it, so the sandbox never holds a TIME_WAIT
endpoint (it would block a checkpoint for 60 s). `json_body` reads a handler's JSON request body.
"""

from __future__ import annotations

import json
import socket
import struct
import time

from .common import dumps, format_exc, log
from .errors import ApiError, BadRequest, PeerGone, invalid

MAX_JSON_BODY = 16 << 20
MAX_DRAIN = 16 << 20  # unread request body we discard to keep a connection alive
MAX_LINE = 65536
MAX_HEADERS = 100
CLOSE_WAIT_S = 2.0

_REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    413: "Payload Too Large",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    505: "HTTP Version Not Supported",
    507: "Insufficient Storage",
}


class Body:
    """A request body, Content-Length or chunked, read in bounded pieces."""

    def __init__(self, conn: Conn, *, length: int = 0, chunked: bool = False, expect_continue: bool = False):
        self._conn = conn
        self._rfile = conn.rfile
        self._left = length  # Content-Length bytes, or bytes left in the current chunk
        self.chunked = chunked
        self.done = not chunked and length == 0
        self.continue_pending = expect_continue and not self.done

    def remaining_known(self) -> int | None:
        return None if self.chunked else self._left

    def _start(self) -> None:
        if self.continue_pending:
            self.continue_pending = False
            self._conn.send_raw(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _readline(self) -> bytes:
        try:
            line = self._rfile.readline(MAX_LINE + 1)
        except OSError as e:
            raise PeerGone(str(e)) from None
        if not line:
            raise PeerGone("client closed the connection in the middle of the request body")
        if len(line) > MAX_LINE:
            raise BadRequest(400, "chunked request body has an over-long line")
        return line

    def readinto(self, buf: memoryview) -> int:
        """Read up to len(buf) bytes; 0 means the body is complete."""
        if self.done:
            return 0
        self._start()
        if self.chunked and self._left == 0:
            line = self._readline()
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadRequest(400, f"malformed chunk size line {line[:40]!r}") from None
            if size < 0:
                raise BadRequest(400, f"malformed chunk size line {line[:40]!r}")
            if size == 0:
                while self._readline() not in (b"\r\n", b"\n"):
                    pass  # trailers
                self.done = True
                return 0
            self._left = size
        try:
            got = self._rfile.readinto(buf[: min(len(buf), self._left)])
        except OSError as e:
            raise PeerGone(str(e)) from None
        if not got:
            raise PeerGone("client closed the connection in the middle of the request body")
        self._left -= got
        if self._left == 0:
            if self.chunked:
                if self._readline() not in (b"\r\n", b"\n"):
                    raise BadRequest(400, "chunk data is not followed by CRLF")
            else:
                self.done = True
        return got

    def read_all(self, limit: int) -> bytes:
        if not self.chunked and self._left > limit:
            raise ApiError(
                413, "payload_too_large", f"request body of {self._left} bytes exceeds {limit} bytes"
            )
        out = bytearray()
        buf = memoryview(bytearray(min(limit + 1, max(self._left, 65536))))
        while True:
            n = self.readinto(buf)
            if not n:
                return bytes(out)
            out += buf[:n]
            if len(out) > limit:
                raise ApiError(413, "payload_too_large", f"request body exceeds {limit} bytes")

    def drain(self, limit: int) -> bool:
        """Discard the rest of the body; False if it is larger than `limit` (then close instead)."""
        if self.done:
            return True
        if self.continue_pending:
            return False  # the client is still waiting for 100 Continue and may never send it
        if not self.chunked and self._left > limit:
            return False
        buf = memoryview(bytearray(65536))
        total = 0
        while True:
            n = self.readinto(buf)
            if not n:
                return True
            total += n
            if total > limit:
                return False


class Request:
    __slots__ = ("method", "path", "query", "headers", "keep_alive", "body")


_HEX = frozenset(b"0123456789abcdefABCDEF")


def _unquote(text: str) -> str:
    """`+` is a space, %XX a byte; the bytes are UTF-8, undecodable ones surrogate-escaped."""
    text = text.replace("+", " ")
    if "%" not in text:
        return text
    first, *rest = text.encode("utf-8", "surrogateescape").split(b"%")
    out = bytearray(first)
    for part in rest:
        if len(part) >= 2 and part[0] in _HEX and part[1] in _HEX:
            out.append(int(part[:2], 16))
            out += part[2:]
        else:
            out += b"%" + part
    return out.decode("utf-8", "surrogateescape")


def split_target(target: str) -> tuple[str, dict[str, str]]:
    """An origin-form request target's path and query parameters, decoded as urllib.parse's
    urlsplit and parse_qsl(keep_blank_values=True, errors="surrogateescape") do: a name without
    `=` has an empty value, the last of a repeated name wins. Written out because urllib.parse
    (and the ipaddress it imports) would cost every idle sandbox's agent ~0.5 MB."""
    path, _, query = target.partition("#")[0].partition("?")
    if path.startswith("//"):  # a network location to urlsplit (the worker never sends one)
        slash = path.find("/", 2)
        path = path[slash:] if slash >= 0 else ""
    params = {}
    for pair in query.split("&"):
        if pair:
            name, _, value = pair.partition("=")
            params[_unquote(name)] = _unquote(value)
    return path, params


class Conn:
    """One client connection, served by its own thread with blocking I/O; `agent` is the
    routing.Agent that every request is dispatched to."""

    def __init__(self, agent, sock: socket.socket):
        self.agent = agent
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self.keep_alive = True
        self.head_only = False
        self.started = False  # status line of the current response sent
        self.peer_closed = False
        self.abort = False  # reset the connection (the response cannot be completed)

    # ---- lifecycle

    def run(self) -> None:
        try:
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            while self._serve_one():
                pass
        except PeerGone:
            self.peer_closed = True
        except Exception:
            log("connection handler crashed:\n" + format_exc())
            self.abort = True
        finally:
            self._finish()

    def _finish(self) -> None:
        try:
            self.rfile.close()
        except OSError:
            pass
        sock = self.sock
        if not self.peer_closed and not self.abort:
            # We are ending the connection: let the client close first so the sandbox never
            # holds a TIME_WAIT endpoint (it would block a checkpoint for 60 s).
            deadline = time.monotonic() + CLOSE_WAIT_S
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    sock.settimeout(remaining)
                    if not sock.recv(65536):
                        self.peer_closed = True
                        break
            except TimeoutError:
                pass
            except OSError:
                self.peer_closed = True  # reset by the client
        if not self.peer_closed:
            try:  # abortive close: RST, no TIME_WAIT
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        try:
            sock.close()
        except OSError:
            pass

    def _serve_one(self) -> bool:
        """Serve one request; False when the connection is done."""
        try:
            req = self._read_request()
        except BadRequest as e:
            self.keep_alive = False
            self.head_only = False
            self.started = False
            self.send_json(e.status, {"error": {"code": "invalid_request", "message": e.message}})
            return False
        if req is None:
            self.peer_closed = True
            return False
        self.keep_alive = req.keep_alive
        self.head_only = req.method == "HEAD"
        self.started = False
        try:
            self.agent.dispatch(self, req)
        except PeerGone:
            raise
        except BadRequest as e:
            self.keep_alive = False
            if self.started:
                self.abort = True
            else:
                self.send_json(e.status, {"error": {"code": "invalid_request", "message": e.message}})
            return False
        except ApiError as e:
            if self.started:
                log(f"{req.method} {req.path} failed after the response started: {e.message}")
                self.abort = True
                return False
            self._send_api_error(req, e)
        except Exception as e:
            log(f"{req.method} {req.path} failed:\n" + format_exc())
            if self.started:
                self.abort = True
                return False
            self._send_api_error(
                req, ApiError(500, "runtime_error", f"internal error in the agent: {type(e).__name__}: {e}")
            )
        if not self.keep_alive:
            return False
        try:
            drained = req.body.drain(MAX_DRAIN)
        except BadRequest:
            drained = False
        if not drained:
            self.keep_alive = False
        return drained

    def _send_api_error(self, req: Request, e: ApiError) -> None:
        body = req.body
        if not body.done:
            left = body.remaining_known()
            if body.continue_pending or left is None or left > MAX_DRAIN:
                self.keep_alive = False  # we will not read the rest; say so
        self.send_json(e.status, {"error": {"code": e.code, "message": e.message}})

    def _readline(self) -> bytes:
        try:
            return self.rfile.readline(MAX_LINE + 1)
        except OSError as e:
            raise PeerGone(str(e)) from None

    def _read_request(self) -> Request | None:
        line = self._readline()
        for _ in range(4):  # tolerate stray CRLFs between requests
            if line not in (b"\r\n", b"\n"):
                break
            line = self._readline()
        if not line:
            return None
        if len(line) > MAX_LINE:
            raise BadRequest(414, "request line is longer than 64 KiB")
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            raise BadRequest(400, f"malformed request line {line[:100]!r}")
        method, target, version = parts
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise BadRequest(505, f"unsupported protocol {version!r}; use HTTP/1.1")
        headers: dict[str, str] = {}
        for i in range(MAX_HEADERS + 1):
            raw = self._readline()
            if raw in (b"\r\n", b"\n"):
                break
            if not raw:
                raise PeerGone("client closed the connection in the middle of the request headers")
            if i == MAX_HEADERS or len(raw) > MAX_LINE:
                raise BadRequest(431, f"more than {MAX_HEADERS} request headers or an over-long header")
            name, sep, value = raw.decode("latin-1").partition(":")
            if not sep:
                raise BadRequest(400, f"malformed header line {raw[:100]!r}")
            name = name.strip().lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
        expect = headers.get("expect", "").lower() == "100-continue"
        if "transfer-encoding" in headers:
            codings = [c.strip().lower() for c in headers["transfer-encoding"].split(",")]
            if codings[-1] != "chunked":
                raise BadRequest(501, f"unsupported Transfer-Encoding {headers['transfer-encoding']!r}")
            body = Body(self, chunked=True, expect_continue=expect)
        elif "content-length" in headers:
            value = headers["content-length"]
            if not value.isdigit():
                raise BadRequest(400, f"invalid Content-Length {value!r}")
            body = Body(self, length=int(value), expect_continue=expect)
        else:
            body = Body(self)
        if not target.startswith("/"):  # origin-form only: the worker sends nothing else
            raise BadRequest(400, f"malformed request target {target[:100]!r}: it must start with /")
        path, query = split_target(target)
        req = Request()
        req.method = method.upper()
        req.path = path or "/"
        req.query = query
        req.headers = headers
        req.keep_alive = keep_alive
        req.body = body
        return req

    # ---- responses

    def send_raw(self, data) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise PeerGone(str(e)) from None

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if not self.keep_alive:
            lines.append("Connection: close")
        self.started = True
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        headers = []
        if status != 204:
            headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        head = self._head(status, headers)
        if self.head_only or status == 204:
            self.send_raw(head)
        elif len(body) <= 65536:
            self.send_raw(head + body)  # one segment
        else:
            self.send_raw(head)
            self.send_raw(body)

    def send_json(self, status: int, obj) -> None:
        self.send(status, dumps(obj))

    def send_no_content(self) -> None:
        self.send(204)

    def start_chunked(self, content_type: str, first: bytes = b"") -> None:
        """The head of a chunked answer, with its `first` chunk in the same write (one segment:
        every send costs ~70 us in gVisor, and the reader a wake-up)."""
        head = self._head(200, [("Content-Type", content_type), ("Transfer-Encoding", "chunked")])
        self.send_raw(head + (b"%x\r\n%b\r\n" % (len(first), first) if first else b""))

    def write_chunk(self, data: bytes) -> None:
        if data:
            self.send_raw(b"%x\r\n%b\r\n" % (len(data), data))

    def end_chunked(self, last: bytes = b"") -> None:
        """The end of a chunked answer, after its `last` chunk in the same write."""
        self.send_raw((b"%x\r\n%b\r\n" % (len(last), last) if last else b"") + b"0\r\n\r\n")


def json_body(req: Request) -> dict:
    """The request's body as a JSON object ({} when empty); 400 invalid_request otherwise."""
    data = req.body.read_all(MAX_JSON_BODY)
    if not data.strip():
        return {}
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise invalid("request body is nested too deeply to parse; send a flat JSON object") from None
    if not isinstance(obj, dict):
        raise invalid(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj
