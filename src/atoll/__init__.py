"""atoll: self-hostable sandboxes for AI agents. This package's root is the Python SDK.

    import atoll

    with atoll.Client() as client:            # $ATOLL_URL, $ATOLL_API_KEY
        sandbox = client.sandboxes.create(template="base")
        print(sandbox.exec("echo hello").stdout)
        sandbox.pause(tier="disk")
        sandbox.delete()

`AsyncClient` / `AsyncSandbox` are the asyncio twins. Errors are in `atoll.errors` and are
re-exported here. The client classes are imported lazily (PEP 562) so that server-side and
in-sandbox code importing `atoll.<subpackage>` does not pull in httpx; `atoll.errors` is
stdlib-only and imported eagerly. `__version__` is a constant (`atoll/_version.py`, also the
distribution's version through pyproject.toml) rather than `importlib.metadata`, whose import alone
costs the CLI ~60 ms on every start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from atoll import errors
from atoll.errors import (
    APIConnectionError,
    APITimeoutError,
    AtollError,
    BuildFailed,
    Conflict,
    DiskFull,
    FileNotFound,
    InvalidRequest,
    InvalidState,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ProcessNotFound,
    QuotaExceeded,
    SandboxBusy,
    SandboxNotFound,
    SecretNotFound,
    ServerError,
    TemplateNotFound,
    Unauthorized,
)

if TYPE_CHECKING:
    from atoll._client import (
        AsyncClient,
        AsyncFiles,
        AsyncProcess,
        AsyncSandbox,
        Client,
        ExecResult,
        FileEntry,
        Files,
        Preview,
        Process,
        ProcessInfo,
        Sandbox,
        Secret,
        Template,
    )

from atoll._version import __version__

_LAZY = {
    "AsyncClient": "atoll._client",
    "AsyncFiles": "atoll._client",
    "AsyncProcess": "atoll._client",
    "AsyncSandbox": "atoll._client",
    "Client": "atoll._client",
    "ExecResult": "atoll._client",
    "FileEntry": "atoll._client",
    "Files": "atoll._client",
    "Process": "atoll._client",
    "ProcessInfo": "atoll._client",
    "Sandbox": "atoll._client",
    "Template": "atoll._client",
    "Preview": "atoll._client",
    "Secret": "atoll._client",
}

__all__ = [
    "APIConnectionError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AtollError",
    "BuildFailed",
    "Client",
    "Conflict",
    "DiskFull",
    "ExecResult",
    "FileEntry",
    "FileNotFound",
    "Files",
    "InvalidRequest",
    "InvalidState",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "Preview",
    "Process",
    "ProcessInfo",
    "ProcessNotFound",
    "QuotaExceeded",
    "Sandbox",
    "SandboxBusy",
    "SandboxNotFound",
    "Secret",
    "SecretNotFound",
    "ServerError",
    "Template",
    "TemplateNotFound",
    "Unauthorized",
    "__version__",
    "errors",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'atoll' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
