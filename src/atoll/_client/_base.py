"""Sans-I/O helpers shared by the async client (`_async/`) and the generated sync one (`_sync/`).

Configuration from the environment, TLS trust (`tls_verify`, `ca_context`: the `ca_file` a client
checks servers against), URL and body building, error mapping (`certificate_error` for a server
certificate that did not verify), the ndjson exec stream decoder, and the pairs of sync/async
helpers (`call_callback` / `acall_callback`, `request_body` / `arequest_body`) that
`scripts/unasync_sdk.py` swaps when it generates the sync client. Nothing here opens a connection
(`ca_context` reads the CA file).
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import os
import re
import ssl
import urllib.request
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any
from urllib.parse import quote

import httpx
import tenacity

from atoll import errors
from atoll._client._models import ExecResult
from atoll._version import __version__

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
ENV_EDGE_URL = "ATOLL_EDGE_URL"
_EDGE_ROUTE = re.compile(
    r"^/v1/sandboxes/[^/]+/(?:exec|processes(?:/[^/]+(?:/(?:output|stdin|signal|wait))?)?"
    r"|files(?:/(?P<sub>stat|list|watch|tar|mkdir|move|chmod))?|(?P<pty>pty(?:/[^/]+(?P<ws>/ws)?)?))$"
)
"""The data routes `atoll edge` serves (a sandbox's exec, process, file and terminal calls): with
an edge URL the client sends these there, and everything else to the API."""
_EDGE_FILE_METHODS = {
    None: ("GET", "PUT", "DELETE"),
    "stat": ("GET",),
    "list": ("GET",),
    "watch": ("GET",),
    "tar": ("GET", "PUT"),
    "mkdir": ("POST",),
    "move": ("POST",),
    "chmod": ("POST",),
}
ENV_API_KEY = "ATOLL_API_KEY"
ENV_CA_FILE = "ATOLL_CA_FILE"


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
    ca_file: str | None = None
    """The CA file (PEM) server certificates are checked against, in place of the system's CAs."""
    ca_origin: str = "ca_file="
    """Where `ca_file` came from, for messages: `ca_file=` (the caller), `$ATOLL_CA_FILE`, or what
    a `SourcedPath` says (the CLI: `--ca-file`)."""

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(extra or {})
        return headers


class SourcedPath(str):
    """A CA file path that says where it came from, for messages (e.g. the CLI's `--ca-file`):
    `resolve_config` takes its `origin` in place of `ca_file=`."""

    origin: str

    def __new__(cls, path: str | os.PathLike[str], origin: str) -> SourcedPath:
        self = super().__new__(cls, os.fspath(path))
        self.origin = origin
        return self


def resolve_config(
    base_url: str | None,
    api_key: str | None,
    timeout: float,
    create_timeout: float,
    ca_file: str | os.PathLike[str] | None = None,
) -> Config:
    """Constructor arguments win over `ATOLL_URL` / `ATOLL_API_KEY` / `ATOLL_CA_FILE`, which win
    over the defaults (an empty variable counts as unset)."""
    url = base_url or os.environ.get(ENV_URL) or DEFAULT_BASE_URL
    key = api_key if api_key is not None else os.environ.get(ENV_API_KEY)
    ca: str | None
    if ca_file is not None:
        ca, origin = os.fspath(ca_file), getattr(ca_file, "origin", "ca_file=")
    else:
        ca, origin = os.environ.get(ENV_CA_FILE) or None, "$" + ENV_CA_FILE
    return Config(
        base_url=url.rstrip("/"),
        api_key=key or None,
        timeout=timeout,
        create_timeout=create_timeout,
        ca_file=ca,
        ca_origin=origin,
    )


def resolve_edge_url(edge_url: str | None) -> str | None:
    """The edge's URL: the argument, else `$ATOLL_EDGE_URL`, else None (every call to the API)."""
    url = edge_url or os.environ.get(ENV_EDGE_URL) or None
    return url.rstrip("/") if url else None


def edge_route(method: str, path: str) -> bool:
    """Whether `method path` is a data call the edge serves (`atoll edge`)."""
    m = _EDGE_ROUTE.match(path)
    if m is None:
        return False
    if "/files" in path:
        return method in _EDGE_FILE_METHODS[m.group("sub")]
    if m.group("pty"):  # open and list (…/pty), kill (DELETE …/pty/{id}), attach (GET …/pty/{id}/ws)
        if m.group("ws"):
            return method == "GET"
        return method in (("POST", "GET") if m.group("pty") == "pty" else ("DELETE",))
    if path.endswith("/processes"):
        return method == "GET"
    return method in ("GET", "POST", "DELETE")


def tls_verify(
    base_url: str, ca_file: str | None = None, ca_origin: str = "ca_file="
) -> bool | ssl.SSLContext:
    """httpx's `verify=` for a client of `base_url`.

    With a `ca_file`, a context that trusts the CA certificates in it and nothing else
    (`ca_context`; BadCAFile if it cannot be used), whatever the scheme. Otherwise: httpx loads the
    whole CA bundle into an SSL context when a client is made (~30 ms, the largest part of a CLI
    command's start after imports), even for a plain-HTTP server that never needs it. For an
    `http://` URL without a proxy that could speak TLS, the client gets an empty verifying context
    instead: nothing it sends uses TLS, and if something did, verification would fail (no CA
    trusted) rather than pass. `https://` URLs get httpx's default (True).
    """
    if ca_file:
        return ca_context(ca_file, ca_origin)
    if not base_url.startswith("http://"):
        return True
    if any(str(proxy).startswith("https:") for proxy in urllib.request.getproxies().values()):
        return True  # a TLS proxy for plain-HTTP requests needs the CA bundle
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies (CERT_REQUIRED) and trusts nothing


_CA_FIX = (
    "give the installation CA: the PEM that the server's GET /v1/ca.crt answers "
    "(on the server: $ATOLL_HOME/ca/root.crt)"
)


def ca_context(path: str, origin: str = "ca_file=") -> ssl.SSLContext:
    """A verifying client context (hostname checked) that trusts the PEM certificates in `path`
    only; BadCAFile, naming the path and where it came from, when it cannot be read or holds none."""
    where = f"the CA file {path!r} (from {origin})"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise errors.BadCAFile(f"{where} cannot be read: {exc.strerror or exc}; {_CA_FIX}") from None
    text = data.decode("ascii", "replace")
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise errors.BadCAFile(
            f"{where} holds no PEM certificate (no '-----BEGIN CERTIFICATE-----' line); {_CA_FIX}"
        )
    try:
        return ssl.create_default_context(cadata=text)
    except (ssl.SSLError, ValueError) as exc:
        raise errors.BadCAFile(f"{where} is not a usable PEM certificate ({exc}); {_CA_FIX}") from None


def ws_ssl(url: str, verify: bool | ssl.SSLContext) -> ssl.SSLContext | None:
    """websockets' `ssl=` for `url`: the client's own context for a wss:// URL (its ca_file), else
    None (websockets' default context for wss://; nothing for ws://, where `ssl=` is refused)."""
    return verify if url.startswith("wss://") and isinstance(verify, ssl.SSLContext) else None


def ws_ssl_sync(url: str, verify: bool | ssl.SSLContext) -> ssl.SSLContext | None:
    """`ws_ssl` for websockets' *sync* client (the sync SDK's terminals; unasync_sdk maps the
    name): a context of its own that trusts what `verify` trusts, capped at TLS 1.2. That client
    reads on a thread of its own while the caller's thread writes the upgrade request; under TLS
    1.3 the server's session tickets arrive then, and the request was lost about once in 330
    connections (reproduced against a plain websockets server: 7 in 2,300 with TLS 1.3, none in
    2,000 with TLS 1.2 or with the asyncio client)."""
    if not url.startswith("wss://"):
        return None
    if isinstance(verify, ssl.SSLContext):  # the client's CA file: the same certificates
        certs = verify.get_ca_certs(binary_form=True)
        ctx = (
            ssl.create_default_context(cadata=b"".join(certs))
            if certs
            else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        )
    else:
        ctx = ssl.create_default_context()
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


# ---------------------------------------------------------------- retries

#: Retries (after the first attempt) of an idempotent call by default; `retries=` on the client.
DEFAULT_RETRIES = 3
#: Methods whose requests are retried: repeating them cannot do anything twice.
RETRY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"})
#: Answers worth repeating the request for (Retry-After is honoured).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: Transport failures retried: the request did not get an answer (a read timeout is not retried:
#: the server may still be working on it, and waiting again would multiply the caller's timeout).
RETRY_ERRORS = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
RETRY_BASE_S = 0.25
RETRY_MAX_WAIT_S = 30.0


class RetryableStatus(Exception):
    """An answer with a RETRY_STATUSES code, raised inside a retry attempt (never escapes the client)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def retry_after(response: httpx.Response) -> float | None:
    """The server's Retry-After (seconds or an HTTP date) in seconds, None if absent or unreadable."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    import datetime as dt
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - dt.datetime.now(dt.UTC)).total_seconds())


def _retry_wait(state: tenacity.RetryCallState) -> float:
    backoff = tenacity.wait_exponential_jitter(
        multiplier=RETRY_BASE_S, max=RETRY_MAX_WAIT_S, jitter=RETRY_BASE_S
    )(state)
    exc = state.outcome.exception() if state.outcome is not None else None
    if isinstance(exc, RetryableStatus):
        told = retry_after(exc.response)
        if told is not None:
            return min(told, RETRY_MAX_WAIT_S)
    return backoff


def _worth_retrying(exc: BaseException) -> bool:
    """A retryable answer or transport failure; never a certificate that did not verify (the next
    attempt would meet the same certificate)."""
    return isinstance(exc, (RetryableStatus, *RETRY_ERRORS)) and certificate_failure(exc) is None


def _retry_policy(retries: int, method: str, content: Any, keyed: bool = False) -> dict[str, Any]:
    """`keyed`: the request carries an Idempotency-Key, so repeating even a POST makes nothing twice."""
    replayable = content is None or isinstance(content, bytes | bytearray | str)
    idempotent = method.upper() in RETRY_METHODS or keyed
    attempts = 1 + max(0, retries) if idempotent and replayable else 1
    return {
        "stop": tenacity.stop_after_attempt(attempts),
        "wait": _retry_wait,
        "retry": tenacity.retry_if_exception(_worth_retrying),
        "reraise": True,
    }


def retrying(retries: int, method: str, content: Any = None, keyed: bool = False) -> tenacity.Retrying:
    """Attempts of one call (sync): idempotent ones (and keyed ones: an Idempotency-Key) retried
    on RETRY_ERRORS and RETRY_STATUSES with exponential backoff and jitter (or the server's
    Retry-After), at most `retries` times."""
    return tenacity.Retrying(sleep=lambda s: sleep(s), **_retry_policy(retries, method, content, keyed))


def aretrying(retries: int, method: str, content: Any = None, keyed: bool = False) -> tenacity.AsyncRetrying:
    """As `retrying`, for the async client."""
    return tenacity.AsyncRetrying(sleep=lambda s: asleep(s), **_retry_policy(retries, method, content, keyed))


def refuse_timeout(where: str, timeout: object) -> None:
    """`timeout=` means a lifetime in E2B and an HTTP timeout in httpx: refuse it rather than guess."""
    if timeout is not None:
        raise TypeError(
            f"{where} takes no timeout= (got {timeout!r}): pass timeout_s= for the sandbox's lifetime "
            "(E2B's `timeout`) or request_timeout= for the HTTP timeout"
        )


def deprecated_timeout(where: str, timeout: float | None, request_timeout: float) -> float:
    """A client's `timeout=` (its HTTP timeout before `request_timeout` existed): still accepted, warned."""
    if timeout is None:
        return request_timeout
    if request_timeout != DEFAULT_TIMEOUT and request_timeout != timeout:
        raise TypeError(f"{where}: give request_timeout= only (timeout= is its old name), not both")
    import warnings

    warnings.warn(
        f"{where}: timeout= is now request_timeout= (the HTTP timeout of each call); a sandbox's "
        "lifetime is sandboxes.create(timeout_s=...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return float(timeout)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: "Not given", where None means something (e.g. `update(timeout_s=None)` removes the lifetime).
UNSET: Any = _Unset()


# ---------------------------------------------------------------- URLs and bodies


def segment(value: str, what: str) -> str:
    """One URL path segment made of a caller's value: percent-quoted (a '/' in it makes no path),
    and never '.' or '..', which an HTTP client resolves away (`sb.kill_pty("..")` would have
    been `DELETE /v1/sandboxes/{id}`, the sandbox's delete)."""
    if not value:
        raise ValueError(f"{what} must be a non-empty string")
    if value in (".", ".."):
        raise ValueError(f"{what} {value!r} is not valid: '.' and '..' name no atoll object")
    return quote(value, safe="")


def sandbox_path(sandbox_id: str, *rest: str) -> str:
    return "/".join([f"/v1/sandboxes/{segment(sandbox_id, 'sandbox id')}", *(segment(r, "id") for r in rest)])


def store_path(kind: str, name: str, *rest: str) -> str:
    """`/v1/volumes/{name}/...` or `/v1/drives/{name}/...`."""
    return "/".join([f"/v1/{kind}s/{segment(name, f'{kind} name')}", *(segment(r, "name") for r in rest)])


def template_path(name: str, *rest: str) -> str:
    return "/".join([f"/v1/templates/{segment(name, 'template name')}", *(segment(r, "id") for r in rest)])


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
            # the Dockerfile itself by content (a link to it would not be a Dockerfile on the
            # server); every other link is sent as a link, and the server keeps it as one
            tar.add(os.path.realpath(dockerfile), arcname="Dockerfile")
        return buf.getvalue(), "application/x-tar"
    return path_or_text.encode(), "text/x-dockerfile"


async def asleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def snapshot_path(snapshot_id: str) -> str:
    return f"/v1/snapshots/{segment(snapshot_id, 'snapshot id')}"


def secret_path(name: str) -> str:
    return f"/v1/secrets/{segment(name, 'secret name')}"


def without_none(**fields: Any) -> dict[str, Any]:
    """Only the fields the caller set, so the server applies its own defaults to the rest."""
    return {k: v for k, v in fields.items() if v is not None}


def list_params(
    state: str | Sequence[str] | None,
    metadata: Mapping[str, str] | None,
    *,
    order: str | None = None,
    created_after: str | datetime | None = None,
    created_before: str | datetime | None = None,
) -> dict[str, str]:
    """The query of GET /v1/sandboxes: `state` one state or several (any of them), times as
    RFC 3339 strings or datetimes (a naive one is taken as UTC by the server)."""
    params: dict[str, str] = {}
    if state is not None:
        params["state"] = state if isinstance(state, str) else ",".join(state)
    for key, value in (metadata or {}).items():
        params[f"metadata.{key}"] = str(value)
    if order is not None:
        params["order"] = order
    for name, t in (("created_after", created_after), ("created_before", created_before)):
        if t is not None:
            params[name] = t.isoformat() if isinstance(t, datetime) else t
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


def page(response: httpx.Response) -> tuple[list[dict[str, Any]], str | None]:
    """The `items` of one page of a list response and its `next_cursor` (None: the last page, or
    a server that does not page)."""
    payload = json_body(response)
    cursor = payload.get("next_cursor") if isinstance(payload, dict) else None
    if cursor is not None and not isinstance(cursor, str):
        raise errors.ServerError(f"expected a string next_cursor, got {cursor!r:.200}", code="bad_response")
    return items(response), cursor or None


def items(response: httpx.Response) -> list[dict[str, Any]]:
    """The `items` of a list response."""
    payload = json_body(response)
    if isinstance(payload, dict) and isinstance(payload.get("items"), list):
        return payload["items"]
    if isinstance(payload, list):
        return payload
    raise errors.ServerError(f"expected a list response, got {payload!r:.200}", code="bad_response")


def certificate_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind a transport error (httpx and websockets chain
    the ssl module's error as a cause), or None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ssl.SSLCertVerificationError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def certificate_error(
    failure: ssl.SSLCertVerificationError, url: str, ca_file: str | None, ca_origin: str = "ca_file="
) -> errors.CertificateError:
    """The error for a server certificate that did not verify: the URL, why, and how to trust the
    installation CA (or, when a CA file was used, that it is likely not this server's)."""
    reason = failure.verify_message or failure.reason or str(failure)
    if ca_file:
        fix = (
            f"it was checked against the CA in {ca_file!r} (from {ca_origin}): is that this server's "
            "installation CA (its GET /v1/ca.crt, on the server $ATOLL_HOME/ca/root.crt), and is "
            "the URL's host among the names of its certificate (ATOLL_TLS_NAMES)?"
        )
    else:
        fix = (
            "trust the installation CA: save the PEM that the server's GET /v1/ca.crt answers (on "
            "the server: $ATOLL_HOME/ca/root.crt) and pass it with --ca-file PATH (CLI), "
            "ca_file=PATH (SDK) or ATOLL_CA_FILE=PATH"
        )
    return errors.CertificateError(
        f"the TLS certificate of the atoll server at {url} did not verify ({reason}); {fix}"
    )


def connection_error(
    exc: httpx.TransportError,
    base_url: str,
    ca_file: str | None = None,
    ca_origin: str = "ca_file=",
    edge: bool = False,
) -> errors.APIConnectionError:
    """Map an httpx transport failure to the SDK's error, naming the URL and how to start a server
    (or, for a certificate that did not verify, how to trust the installation CA). `edge`: the
    URL is the edge's (`edge_url=` / ATOLL_EDGE_URL), and the message says so."""
    failure = certificate_failure(exc)
    if failure is not None:
        return certificate_error(failure, base_url, ca_file, ca_origin)
    if edge:
        what = f"the atoll edge at {base_url} (edge_url= or ${ENV_EDGE_URL})"
        if isinstance(exc, httpx.TimeoutException):
            return errors.APITimeoutError(
                f"{what} did not answer in time ({type(exc).__name__}: {exc}); pass a larger timeout= "
                "if the operation is expected to be slow"
            )
        if isinstance(exc, httpx.ConnectError):
            return errors.APIConnectionError(
                f"cannot connect to {what} ({exc}). Is `atoll edge --server URL` running there? Point "
                f"{ENV_EDGE_URL} (or edge_url=) at a running edge, or unset it to send every call to the API."
            )
        return errors.APIConnectionError(f"connection to {what} failed: {type(exc).__name__}: {exc}")
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

    `feed(line)` (a line cut by `atoll.shared.ndjson`) returns the `(stream_name, text)` chunks the line carried ("stdout"/"stderr");
    an `{"error": ...}` line raises the matching `AtollError`. `result()` is available once
    the final `{"exit_code", ...}` line has been fed.
    """

    def __init__(self) -> None:
        self._out: list[str] = []
        self._err: list[str] = []
        self._final: dict[str, Any] | None = None

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


# ---------------------------------------------------------------- terminals (sandbox.pty)

#: Terminal size bounds, as the server checks them (docs/api.md, "Terminals").
TERMINAL_MIN_SIZE = 1
TERMINAL_MAX_COLS = 1000
TERMINAL_MAX_ROWS = 1000


def terminal_size_problem(cols: object, rows: object) -> str | None:
    for name, value, top in (("cols", cols, TERMINAL_MAX_COLS), ("rows", rows, TERMINAL_MAX_ROWS)):
        if isinstance(value, bool) or not isinstance(value, int) or not TERMINAL_MIN_SIZE <= value <= top:
            return (
                f"terminal size: {name} must be an integer from {TERMINAL_MIN_SIZE} to {top}, got {value!r}"
            )
    return None


def pty_body(
    cols: int,
    rows: int,
    term: str | None,
    cmd: str | Sequence[str] | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
) -> dict[str, Any]:
    problem = terminal_size_problem(cols, rows)
    if problem:
        raise errors.InvalidRequest(problem, code="invalid_request")
    body: dict[str, Any] = {"cols": cols, "rows": rows}
    if term is not None:
        body["term"] = term
    if cmd is not None:
        body["cmd"] = cmd if isinstance(cmd, str) else list(cmd)
    if cwd is not None:
        body["cwd"] = cwd
    if env is not None:
        body["env"] = dict(env)
    return body


def ws_url(base_url: str, path: str) -> str:
    """The WebSocket URL of `path` on the server (http -> ws, https -> wss)."""
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://") :] + path
    if base_url.startswith("http://"):
        return "ws://" + base_url[len("http://") :] + path
    raise errors.APIConnectionError(f"cannot open a terminal: base_url {base_url!r} is not http(s)")


def ws_refused(status_code: int, body: bytes | bytearray, url: str) -> errors.AtollError:
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    text = body.decode("utf-8", "replace") if body else f"the server refused the WebSocket to {url}"
    return errors.error_from_payload(payload, status_code=status_code, text=text)


def terminal_message(msg: str | bytes) -> tuple[str, Any]:
    """A server message of a terminal WebSocket: ("data", bytes), ("exit", code) or ("error", exc)."""
    if isinstance(msg, bytes):
        return "data", msg
    try:
        obj = json.loads(msg)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("exit_code"), int):
        return "exit", obj["exit_code"]
    if isinstance(obj, dict) and "error" in obj:
        return "error", errors.error_from_payload(obj, status_code=None, text=msg)
    return "error", errors.AtollError(f"unexpected terminal message {msg[:200]!r}", code="bad_response")


TERMINAL_MESSAGE_MAX = 1 << 20
"""The largest WebSocket message a terminal takes (the server closes with 1009 past it)."""


def terminal_closed(code: int | None, reason: str, pty_id: str) -> errors.AtollError:
    """Why a terminal WebSocket ended without an exit code."""
    if code == 1012:
        return errors.Unavailable(
            f"terminal {pty_id} was detached by the server ({reason}); the session lives on: "
            "attach again with sandbox.pty_attach(pty_id)",
            code="worker_unavailable",
            retryable=True,
        )
    return errors.APIConnectionError(
        f"the terminal WebSocket of {pty_id} closed before the program ended (code {code}, {reason!r}); "
        "attach again with sandbox.pty_attach(pty_id)"
    )


async def arecv(ws: Any, timeout: float | None) -> str | bytes:  # noqa: ASYNC109 - a deadline per message
    """The next WebSocket message within `timeout` (TimeoutError otherwise); twin of `recv`."""
    import asyncio

    return await asyncio.wait_for(ws.recv(), timeout)


def recv(ws: Any, timeout: float | None) -> str | bytes:
    return ws.recv(timeout=timeout)


AUDIT_PAGE = 1000
"""Rows per page of GET /v1/audit (the server's largest)."""


def iso_time(value: datetime | str | None, name: str) -> str | None:
    """A time for a query parameter: a datetime (naive = UTC) as ISO 8601, a string as given."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, datetime):
        return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).isoformat()
    raise TypeError(f"{name} must be a datetime or an ISO 8601 string, not {type(value).__name__}")


def audit_params(
    from_: datetime | str | None,
    to: datetime | str | None,
    tenant_id: str | None,
    action: str | None,
    limit: int | None,
) -> dict[str, str]:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a whole number >= 1 (rows in all), not {limit!r}")
    params = without_none(
        **{"from": iso_time(from_, "from_"), "to": iso_time(to, "to")}, tenant_id=tenant_id, action=action
    )
    params["limit"] = str(min(limit, AUDIT_PAGE) if limit is not None else AUDIT_PAGE)
    return params


def next_cursor(response: httpx.Response) -> str | None:
    """The `next_cursor` of a list page (None: the last page)."""
    payload = json_body(response)
    cursor = payload.get("next_cursor") if isinstance(payload, dict) else None
    return cursor if isinstance(cursor, str) and cursor else None


USAGE_GROUPS = ("sandbox", "day", "tenant")


def usage_params(from_: Any, to: Any, group_by: str, tenant_id: str | None) -> dict[str, str]:
    """The query of GET /v1/usage: times as ISO 8601 (a naive datetime is taken as UTC)."""
    if group_by not in USAGE_GROUPS:
        raise ValueError(f"group_by={group_by!r} is not one of {', '.join(USAGE_GROUPS)}")
    params = {"group_by": group_by}
    for name, value in (("from", from_), ("to", to)):
        if value is None:
            continue
        if hasattr(value, "isoformat"):
            if getattr(value, "tzinfo", True) is None:
                value = value.isoformat() + "Z"
            else:
                value = value.isoformat()
        params[name] = str(value)
    if tenant_id is not None:
        params["tenant_id"] = tenant_id
    return params
