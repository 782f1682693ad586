"""GENERATED FILE - do not edit. `Client`: the connection to an atoll server (key, retries, errors) and its resources.

Generated from `_async/client.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import httpx

from atoll import errors

from .. import _base
from .._models import AuditEntry
from .sandboxes import Sandboxes
from .secrets import Secrets
from .snapshots import Snapshots
from .stores import Drives, Volumes
from .templates import Templates
from .tenants import Keys, Tenants
from .workers import Workers


class Client:
    """Connection to an atoll server.

    `base_url` defaults to `$ATOLL_URL` or http://127.0.0.1:7080, `api_key` to
    `$ATOLL_API_KEY`. `request_timeout` (seconds) is the HTTP timeout of ordinary calls;
    `create_timeout` that of sandbox creation, connect, pause and resume, which may build a
    template or move memory to disk. (`timeout=` is the old name of `request_timeout` and still
    accepted here, with a DeprecationWarning; a sandbox's lifetime is `sandboxes.create(timeout_s=...)`,
    where `timeout=` is refused.) Idempotent calls (GET, PUT, DELETE, PATCH)
    are retried up to `retries` times on connection failures and 429/502/503/504 answers, with
    exponential backoff or the server's Retry-After; POSTs (exec, create) never are, except a
    create with an `idempotency_key` (the server answers a repeat with the first sandbox).
    `ca_file` (default `$ATOLL_CA_FILE`) is a PEM file of the CA certificates an https:// server's
    certificate is checked against, in place of the system's: the installation CA, which the
    server's `GET /v1/ca.crt` answers. It serves every connection of the client (calls, streams,
    terminals); a file that cannot be used raises `BadCAFile` here, and a certificate that does not
    verify raises `CertificateError` (never retried).
    `edge_url` (default `$ATOLL_EDGE_URL`) is the URL of an `atoll edge`: a sandbox's exec,
    process, file and terminal calls (exec, streamed exec, background processes, their output,
    stdin, signals, waits; file read, write, delete, stat, list; terminals opened, attached,
    killed) then go there, straight to the sandbox's worker, with the same key, and every other call
    to `base_url`; an open stream through the edge is not cut when a server restarts.
    `transport` replaces the HTTP transport (tests pass an `httpx.MockTransport`; it serves the
    edge's calls too).
    Use it as a context manager, or close it when done.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        request_timeout: float = _base.DEFAULT_TIMEOUT,
        create_timeout: float = _base.DEFAULT_CREATE_TIMEOUT,
        retries: int = _base.DEFAULT_RETRIES,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        edge_url: str | None = None,
    ) -> None:
        request_timeout = _base.deprecated_timeout(type(self).__name__ + "()", timeout, request_timeout)
        self._config = _base.resolve_config(base_url, api_key, request_timeout, create_timeout, ca_file)
        self._retries = int(retries)
        self._verify = _base.tls_verify(self._config.base_url, self._config.ca_file, self._config.ca_origin)
        self._http = httpx.Client(
            base_url=self._config.base_url,
            headers=self._config.headers(headers),
            timeout=request_timeout,
            transport=transport,
            verify=self._verify,
        )
        self._edge_url = _base.resolve_edge_url(edge_url)
        self._edge: httpx.Client | None = None
        self._edge_verify: bool | ssl.SSLContext = self._verify
        if self._edge_url is not None:
            self._edge_verify = _base.tls_verify(self._edge_url, self._config.ca_file, self._config.ca_origin)
            self._edge = httpx.Client(
                base_url=self._edge_url,
                headers=self._config.headers(headers),
                timeout=request_timeout,
                transport=transport,
                verify=self._edge_verify,
            )
        self.sandboxes = Sandboxes(self)
        self.templates = Templates(self)
        self.workers = Workers(self)
        self.secrets = Secrets(self)
        self.snapshots = Snapshots(self)
        self.volumes = Volumes(self)
        self.drives = Drives(self)
        self.tenants = Tenants(self)
        self.keys = Keys(self)

    @property
    def base_url(self) -> str:
        return self._config.base_url

    @property
    def edge_url(self) -> str | None:
        """The edge that serves sandboxes' exec and process calls (None: the API serves them)."""
        return self._edge_url

    @property
    def request_timeout(self) -> float:
        return self._config.timeout

    @property
    def timeout(self) -> float:
        """The same as `request_timeout` (read-only; kept for code that reads it)."""
        return self._config.timeout

    @property
    def ca_file(self) -> str | None:
        """The CA file server certificates are checked against (None: the system's CAs)."""
        return self._config.ca_file

    @property
    def retries(self) -> int:
        return self._retries

    @property
    def create_timeout(self) -> float:
        return self._config.create_timeout

    def health(self) -> dict[str, Any]:
        """The server's `/healthz` document, e.g. `{"status": "ok", ...}`."""
        response = self._request("GET", "/healthz")
        return _base.json_body(response)

    def ca_certificate(self) -> str:
        """The installation's root CA (PEM): trust it for preview URLs, e.g.
        `ssl.create_default_context(cadata=client.ca_certificate())`."""
        response = self._request("GET", "/v1/ca.crt")
        return response.text

    def _items(self, path: str, params: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Every item of a list: its pages one after another (the server's `next_cursor` passed
        back as `?cursor=` until it is null), so a caller sees the whole list as one."""
        query = dict(params or {})
        out: list[dict[str, Any]] = []
        while True:
            response = self._request("GET", path, params=query)
            items, cursor = _base.page(response)
            out += items
            if cursor is None:
                return out
            if cursor == query.get("cursor"):
                raise errors.ServerError(
                    f"GET {path} answered the same page cursor twice", code="bad_response"
                )
            query["cursor"] = cursor

    def audit(
        self,
        *,
        from_: datetime | str | None = None,
        to: datetime | str | None = None,
        tenant_id: str | None = None,
        action: str | None = None,
        limit: int | None = None,
    ) -> list[AuditEntry]:
        """The audit trail (an admin key): every mutation — who (key id, tenant), what, on what
        and its result —, oldest first, following the server's pages to the end or to `limit`
        rows. `from_` is inclusive, `to` exclusive (datetimes, naive = UTC, or ISO 8601 strings);
        `action` is exact ("sandbox.create") or a prefix with a trailing `*` ("sandbox.*")."""
        params = _base.audit_params(from_, to, tenant_id, action, limit)
        out: list[AuditEntry] = []
        while True:
            response = self._request("GET", "/v1/audit", params=params)
            out += [AuditEntry(item) for item in _base.items(response)]
            cursor = _base.next_cursor(response)
            if cursor is None or (limit is not None and len(out) >= limit):
                return out[:limit] if limit is not None else out
            params = {**params, "cursor": cursor}

    def usage(
        self,
        from_: str | datetime | None = None,
        to: str | datetime | None = None,
        group_by: str = "sandbox",
        *,
        tenant_id: str | None = None,
    ) -> dict[str, Any]:
        """What was used in [from_, to) (ISO 8601 strings or datetimes; default: the last 24 h),
        grouped by `sandbox`, `day` or `tenant`: `{"items": [...], "total": {...}}`, each with
        cpu_seconds, memory_gb_seconds, standby_memory_gb_seconds, snapshot_gb_seconds,
        volume_gb_seconds, drive_gb_seconds, egress_bytes, ingress_bytes, build_seconds and cost.
        A tenant key sees its own tenant; an admin key every tenant, or `tenant_id`'s."""
        response = self._request(
            "GET", "/v1/usage", params=_base.usage_params(from_, to, group_by, tenant_id)
        )
        return _base.json_body(response)

    def close(self) -> None:
        self._http.close()
        if self._edge is not None:
            self._edge.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    def _connection_error(
        self, exc: httpx.TransportError, url: str | None = None
    ) -> errors.APIConnectionError:
        edge = url is not None and url == self._edge_url
        return _base.connection_error(
            exc, url or self.base_url, self._config.ca_file, self._config.ca_origin, edge=edge
        )

    def _ws_base(self, path: str) -> tuple[str, bool | ssl.SSLContext]:
        """(base URL, TLS verification) of a terminal WebSocket at `path`: the edge's, or the API's."""
        if self._edge_url is not None and _base.edge_route("GET", path):
            return self._edge_url, self._edge_verify
        return self.base_url, self._verify

    def _via(self, method: str, path: str) -> httpx.Client:
        """The HTTP client for `method path`: the edge's for the data calls it serves, else the API's."""
        if self._edge is not None and _base.edge_route(method, path):
            return self._edge
        return self._http

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one request; raise the mapped `AtollError` for any non-2xx answer. Idempotent
        methods, and requests with an Idempotency-Key, are retried (see the class docstring;
        tenacity does the waiting)."""
        http = self._via(method, path)
        try:
            keyed = headers is not None and "Idempotency-Key" in headers
            for attempt in _base.retrying(self._retries, method, content, keyed):
                with attempt:
                    response = http.request(
                        method,
                        path,
                        json=json,
                        params=params,
                        content=content,
                        headers=headers,
                        timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                    )
                    if response.status_code in _base.RETRY_STATUSES:
                        raise _base.RetryableStatus(response)
        except _base.RetryableStatus as exc:
            response = exc.response
        except httpx.TransportError as exc:
            raise self._connection_error(exc, str(http.base_url).rstrip("/")) from exc
        _base.raise_for_status(response)
        return response

    @contextmanager
    def _stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> Iterator[httpx.Response]:
        """Send one request and yield the response unread, after checking its status. Opening an
        idempotent one is retried like `_request`; a stream that breaks later is not."""
        http = self._via(method, path)
        request = http.build_request(
            method,
            path,
            json=json,
            params=params,
            headers=headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
        try:
            for attempt in _base.retrying(self._retries, method):
                with attempt:
                    response = http.send(request, stream=True)
                    if response.status_code in _base.RETRY_STATUSES:
                        response.read()
                        response.close()
                        raise _base.RetryableStatus(response)
        except _base.RetryableStatus as exc:
            raise _base.error_from_response(exc.response) from None
        except httpx.TransportError as exc:
            raise self._connection_error(exc, str(http.base_url).rstrip("/")) from exc
        try:
            if not response.is_success:
                response.read()
                raise _base.error_from_response(response)
            yield response
        except httpx.TransportError as exc:
            raise self._connection_error(exc, str(http.base_url).rstrip("/")) from exc
        finally:
            response.close()
