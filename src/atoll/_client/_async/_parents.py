"""What a resource object uses of the client and of the sandbox it belongs to, as Protocols.

The resources (sandboxes, files, processes, terminals, templates, secrets, workers) are made by
the client and by a sandbox, and keep a reference to them; typing that reference with these
Protocols instead of the classes themselves keeps the modules free of import cycles (the client
imports its resources, a resource never imports the client).
Part of the hand-written async SDK; `scripts/unasync_sdk.py` generates its sync twin in `_sync/`.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import httpx

from .. import _base


class ClientLike(Protocol):
    _config: _base.Config
    _verify: bool | ssl.SSLContext

    @property
    def base_url(self) -> str: ...

    @property
    def timeout(self) -> float: ...

    @property
    def create_timeout(self) -> float: ...

    @property
    def edge_url(self) -> str | None: ...

    def _ws_base(self, path: str) -> tuple[str, bool | ssl.SSLContext]: ...

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - passed on to httpx
    ) -> httpx.Response: ...

    async def _items(self, path: str, params: Mapping[str, str] | None = None) -> list[dict[str, Any]]: ...

    def _stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,  # noqa: ASYNC109 - passed on to httpx
    ) -> AbstractAsyncContextManager[httpx.Response]: ...


class SandboxLike(Protocol):
    _client: ClientLike

    @property
    def id(self) -> str: ...

    def _path(self, *rest: str) -> str: ...

    async def exec(self, cmd: Any, *args: Any, **kwargs: Any) -> Any: ...

    async def kill_process(self, pid: int) -> None: ...
