"""Sans-I/O helpers shared by the async client (`_async.py`) and the generated sync one (`_sync.py`).

Configuration from the environment, URL and body building, error mapping, the ndjson exec
stream decoder, and the pairs of sync/async helpers (`call_callback` / `acall_callback`,
`request_body` / `arequest_body`) that `scripts/unasync_sdk.py` swaps when it generates the
sync client. Nothing here opens a connection.
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import quote

import httpx

from atoll import __version__, errors
from atoll._client._models import ExecResult

DEFAULT_BASE_URL = "http://127.0.0.1:7080"
DEFAULT_TIMEOUT = 60.0
DEFAULT_CREATE_TIMEOUT = 600.0
#: Extra seconds the HTTP timeout of an exec gets beyond the command's own `timeout_s`.
EXEC_TIMEOUT_MARGIN = 60.0
#: HTTP timeout of an exec without `timeout_s`. The server sets no limit of its own; when this
#: expires the client hangs up, and the server then kills the command (it watches for hang-ups).
EXEC_DEFAULT_HTTP_TIMEOUT = 600.0
CHUNK_SIZE = 1024 * 1024
NDJSON = "application/x-ndjson"
OCTET_STREAM = "application/octet-stream"
ENV_URL = "ATOLL_URL"
ENV_API_KEY = "ATOLL_API_KEY"


#: What `Files.write` accepts: bytes-like, str (UTF-8), an open file, or an iterable of chunks.
UploadData = bytes | bytearray | memoryview | str | IO[bytes] | IO[str] | Iterable[bytes] | Iterable[str]
#: What `AsyncFiles.write` accepts: as `UploadData`, plus async iterables of chunks.
AsyncUploadData = UploadData | AsyncIterable[bytes] | AsyncIterable[str]


USER_AGENT = f"atoll-python/{__version__}"


@dataclass(frozen=True)
class Config:
    base_url: str
    api_key: str | None
    timeout: float
    create_timeout: float

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(extra or {})
        return headers


def resolve_config(
    base_url: str | None, api_key: str | None, timeout: float, create_timeout: float
) -> Config:
    """Constructor arguments win over `ATOLL_URL` / `ATOLL_API_KEY`, which win over the defaults."""
    url = base_url or os.environ.get(ENV_URL) or DEFAULT_BASE_URL
    key = api_key if api_key is not None else os.environ.get(ENV_API_KEY)
    return Config(
        base_url=url.rstrip("/"), api_key=key or None, timeout=timeout, create_timeout=create_timeout
    )


# ---------------------------------------------------------------- URLs and bodies


def sandbox_path(sandbox_id: str, *rest: str) -> str:
    if not sandbox_id:
        raise ValueError("sandbox id must be a non-empty string")
    return "/".join([f"/v1/sandboxes/{quote(sandbox_id, safe='')}", *rest])


def template_path(name: str, *rest: str) -> str:
    if not name:
        raise ValueError("template name must be a non-empty string")
    return "/".join([f"/v1/templates/{quote(name, safe='')}", *(quote(r, safe="") for r in rest)])


def dockerfile_body(path_or_text: str) -> tuple[bytes, str]:
    """The body of a Dockerfile build: a tar of the build context (a directory holding a
    Dockerfile, or a Dockerfile's own directory) or the Dockerfile's text."""
    import io
    import os
    import tarfile

    if "\n" not in path_or_text and os.path.exists(path_or_text):
        if os.path.isdir(path_or_text):
            context, dockerfile = path_or_text, os.path.join(path_or_text, "Dockerfile")
        else:
            context, dockerfile = os.path.dirname(os.path.abspath(path_or_text)), path_or_text
        if not os.path.isfile(dockerfile):
            raise ValueError(f"{path_or_text!r} holds no Dockerfile")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for entry in sorted(os.listdir(context)):
                full = os.path.join(context, entry)
                if os.path.abspath(full) == os.path.abspath(dockerfile) or entry in (".git",):
                    continue
                tar.add(full, arcname=entry)
            tar.add(dockerfile, arcname="Dockerfile")
        return buf.getvalue(), "application/x-tar"
    return path_or_text.encode(), "text/x-dockerfile"


async def asleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def secret_path(name: str) -> str:
    if not name:
        raise ValueError("secret name must be a non-empty string")
    return f"/v1/secrets/{quote(name, safe='')}"


def without_none(**fields: Any) -> dict[str, Any]:
    """Only the fields the caller set, so the server applies its own defaults to the rest."""
    return {k: v for k, v in fields.items() if v is not None}


def list_params(state: str | None, metadata: Mapping[str, str] | None) -> dict[str, str]:
    params: dict[str, str] = {}
    if state is not None:
        params["state"] = state
    for key, value in (metadata or {}).items():
        params[f"metadata.{key}"] = str(value)
    return params


def exec_body(
    cmd: str | Sequence[str],
    *,
    background: bool,
    timeout_s: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    user: str | None,
    max_output_bytes: int | None = None,
    stdin: str | None = None,
    shell: str | None = None,
) -> dict[str, Any]:
    if isinstance(cmd, str):
        command: str | list[str] = cmd
    else:
        command = [str(part) for part in cmd]
        if not command:
            raise ValueError("cmd must be a non-empty string or argv list")
    body = without_none(
        cmd=command,
        cwd=cwd,
        env=dict(env) if env is not None else None,
        timeout_s=timeout_s,
        user=user,
        max_output_bytes=max_output_bytes,
        stdin=stdin,
        shell=shell,
    )
    if stdin is not None and not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str (fed to the command, then closed), got {type(stdin).__name__}")
    if background:
        body["background"] = True
    return body


def path_params(path: str | bytes) -> dict[str, str]:
    """Query parameters naming a file: `path`, or `path_b64` (base64 of the exact bytes) for bytes."""
    if isinstance(path, (bytes, bytearray)):
        return {"path_b64": base64.b64encode(bytes(path)).decode("ascii")}
    return {"path": path}


def exec_timeout(timeout_s: float | None, default: float) -> float:
    """HTTP timeout of a foreground exec: long enough for the command's own limit to fire first."""
    if timeout_s is None:
        return max(default, EXEC_DEFAULT_HTTP_TIMEOUT)
    return max(default, float(timeout_s) + EXEC_TIMEOUT_MARGIN)


def _chunk_bytes(chunk: Any) -> bytes:
    if isinstance(chunk, str):
        return chunk.encode("utf-8")
    if isinstance(chunk, bytes | bytearray | memoryview):
        return bytes(chunk)
    raise TypeError(f"file data chunks must be bytes or str, not {type(chunk).__name__}")


def _read_chunks(fileobj: Any) -> Iterator[bytes]:
    while True:
        chunk = fileobj.read(CHUNK_SIZE)
        if not chunk:
            return
        yield _chunk_bytes(chunk)


def request_body(data: Any) -> bytes | Iterator[bytes]:
    """File data for the sync client: whole bytes, or an iterator streamed without loading it all.

    Accepts bytes-like objects, str (sent as UTF-8), readable file objects (binary or text,
    read in 1 MiB chunks) and iterables of bytes/str chunks.
    """
    if isinstance(data, str | bytes | bytearray | memoryview):
        return _chunk_bytes(data)
    if hasattr(data, "read"):
        return _read_chunks(data)
    if isinstance(data, Iterable):
        return (_chunk_bytes(chunk) for chunk in data)
    raise TypeError(
        f"cannot upload {type(data).__name__}: pass bytes, str, a binary file or an iterable of bytes"
    )


def upload_headers(data: Any) -> dict[str, str]:
    """Headers of a file upload; a binary file of known size gets a Content-Length so the server
    can refuse an oversized upload (413) before any byte is sent, instead of mid-stream."""
    headers = {"Content-Type": OCTET_STREAM}
    size: int | None = None
    try:
        if isinstance(data, io.BytesIO):
            size = data.getbuffer().nbytes - data.tell()
        elif isinstance(data, io.BufferedIOBase | io.RawIOBase) and data.seekable():
            size = os.fstat(data.fileno()).st_size - data.tell()
    except (OSError, ValueError):
        size = None
    if size is not None and size >= 0:
        headers["Content-Length"] = str(size)
    return headers


async def _aiter_chunks(source: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[bytes]:
    if isinstance(source, AsyncIterable):
        async for chunk in source:
            yield _chunk_bytes(chunk)
    else:
        for chunk in source:
            yield _chunk_bytes(chunk)


def arequest_body(data: Any) -> bytes | AsyncIterator[bytes]:
    """File data for the async client: as `request_body`, plus async iterables of chunks."""
    if isinstance(data, AsyncIterable):
        return _aiter_chunks(data)
    body = request_body(data)
    return body if isinstance(body, bytes) else _aiter_chunks(body)


# ---------------------------------------------------------------- callbacks

TextCallback = Callable[[str], Any]


def call_callback(callback: TextCallback, text: str) -> None:
    callback(text)


async def acall_callback(callback: TextCallback, text: str) -> None:
    """Call a sync callable or a coroutine function with one chunk of output."""
    result = callback(text)
    if inspect.isawaitable(result):
        await result


# ---------------------------------------------------------------- responses and errors


def error_from_response(response: httpx.Response) -> errors.AtollError:
    """The exception for a non-2xx response whose body has been read."""
    try:
        payload = response.json()
    except ValueError:
        payload = None
    text = response.text if payload is None else ""
    return errors.error_from_payload(
        payload, status_code=response.status_code, text=text, request_id=response.headers.get("x-request-id")
    )


def raise_for_status(response: httpx.Response) -> None:
    if not response.is_success:
        raise error_from_response(response)


def json_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise errors.ServerError(
            f"expected JSON from {response.request.method} {response.request.url.path}, "
            f"got {response.headers.get('content-type', 'no content type')}: {response.text[:200]!r}",
            code="bad_response",
            status_code=response.status_code,
        ) from exc


def items(response: httpx.Response) -> list[dict[str, Any]]:
    """The `items` of a list response."""
    payload = json_body(response)
    if isinstance(payload, dict) and isinstance(payload.get("items"), list):
        return payload["items"]
    if isinstance(payload, list):
        return payload
    raise errors.ServerError(f"expected a list response, got {payload!r:.200}", code="bad_response")


def connection_error(exc: httpx.TransportError, base_url: str) -> errors.APIConnectionError:
    """Map an httpx transport failure to the SDK's error, naming the URL and how to start a server."""
    if isinstance(exc, httpx.TimeoutException):
        return errors.APITimeoutError(
            f"the atoll server at {base_url} did not answer in time ({type(exc).__name__}: {exc}); "
            "pass a larger timeout= if the operation is expected to be slow"
        )
    if isinstance(exc, httpx.ConnectError):
        return errors.APIConnectionError(
            f"cannot connect to the atoll server at {base_url} ({exc}). Is it running? "
            "Start it with `make run` or `atoll up`, or point ATOLL_URL at a running server."
        )
    return errors.APIConnectionError(
        f"connection to the atoll server at {base_url} failed: {type(exc).__name__}: {exc}"
    )


def is_ndjson(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").split(";")[0].strip() == NDJSON


def json_line(line: bytes) -> dict[str, Any]:
    """One NDJSON line of a stream as an object; ServerError(bad_response) otherwise."""
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise errors.ServerError(f"malformed stream line: {line[:200]!r}", code="bad_response") from exc
    if not isinstance(obj, dict):
        raise errors.ServerError(f"malformed stream line: {line[:200]!r}", code="bad_response")
    return obj


def stream_error(obj: Mapping[str, Any]) -> errors.AtollError:
    """The error an in-band `{"error": …}` line of a stream reports."""
    return errors.error_from_payload(obj, status_code=None, text=json.dumps(obj))


class ExecStream:
    """Decodes the ndjson lines of a streamed exec into output chunks and a final `ExecResult`.

    `feed(line)` returns the `(stream_name, text)` chunks the line carried ("stdout"/"stderr");
    an `{"error": ...}` line raises the matching `AtollError`. `result()` is available once
    the final `{"exit_code", ...}` line has been fed.
    """

    def __init__(self) -> None:
        self._out: list[str] = []
        self._err: list[str] = []
        self._final: dict[str, Any] | None = None
        self._pending = b""

    def feed_bytes(self, chunk: bytes, final: bool = False) -> Iterator[tuple[str, str]]:
        """Feed raw bytes of the stream; lines end at b"\\n" only. (httpx's iter_lines splits on
        every Unicode line break, U+0085 and U+2028 included, which JSON strings may carry raw.)
        A generator: the chunks of one line reach the caller before a later line can raise."""
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = b"" if final else lines.pop()
        for line in lines:
            yield from self.feed(line)

    def feed(self, line: str | bytes) -> list[tuple[str, str]]:
        line = line.strip()
        if not line:
            return []
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise errors.ServerError(
                f"malformed exec stream line: {line[:200]!r}", code="bad_response"
            ) from exc
        if not isinstance(obj, dict):
            raise errors.ServerError(f"malformed exec stream line: {line[:200]!r}", code="bad_response")
        return self.feed_object(obj)

    def feed_object(self, obj: Mapping[str, Any]) -> list[tuple[str, str]]:
        if "error" in obj:
            raise errors.error_from_payload(obj, status_code=None, text=json.dumps(obj))
        chunks: list[tuple[str, str]] = []
        for name, sink in (("stdout", self._out), ("stderr", self._err)):
            text = obj.get(name)
            if isinstance(text, str) and text:
                sink.append(text)
                chunks.append((name, text))
        if "exit_code" in obj or "timed_out" in obj:
            self._final = dict(obj)
        return chunks

    @property
    def done(self) -> bool:
        return self._final is not None

    def result(self) -> ExecResult:
        if self._final is None:
            raise errors.ServerError(
                "the exec stream ended before the process's exit status arrived", code="stream_incomplete"
            )
        return ExecResult(
            exit_code=self._final.get("exit_code"),
            stdout="".join(self._out),
            stderr="".join(self._err),
            timed_out=bool(self._final.get("timed_out", False)),
            duration_ms=self._final.get("duration_ms"),
        )
