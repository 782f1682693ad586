"""GENERATED FILE - do not edit. What a resource object uses of the client and of the sandbox it belongs to, as Protocols.

Generated from `_async/_parents.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from contextlib import AbstractContextManager
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
    ) -> httpx.Response: ...

    def _items(self, path: str, params: Mapping[str, str] | None = None) -> list[dict[str, Any]]: ...

    def _stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> AbstractContextManager[httpx.Response]: ...


class SandboxLike(Protocol):
    _client: ClientLike

    @property
    def id(self) -> str: ...

    def _path(self, *rest: str) -> str: ...

    def exec(self, cmd: Any, *args: Any, **kwargs: Any) -> Any: ...

    def kill_process(self, pid: int) -> None: ...
