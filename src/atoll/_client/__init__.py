"""The atoll SDK's HTTP clients. Imported lazily by `atoll/__init__.py`; users import from `atoll`.

`_async/` is the hand-written async client, one module per resource, `_sync/` its generated sync
twin, file for file (`scripts/unasync_sdk.py`), `_base.py` the sans-I/O helpers both share,
`_models.py` the result objects and `_tar.py` tar streams of local trees.

The names are imported lazily (PEP 562): `from atoll._client import Client` loads the sync client
alone, not the async one beside it (the CLI's start-up cost).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atoll._client._async import (
        AsyncClient,
        AsyncFiles,
        AsyncProcess,
        AsyncSandbox,
        AsyncSandboxes,
        AsyncSecrets,
        AsyncTemplates,
        AsyncWorkers,
    )
    from atoll._client._models import ExecResult, FileEntry, Preview, ProcessInfo, Secret, Template
    from atoll._client._sync import Client, Files, Process, Sandbox, Sandboxes, Secrets, Templates, Workers

_ASYNC = (
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSecrets",
    "AsyncTemplates",
    "AsyncWorkers",
)
_MODELS = ("ExecResult", "FileEntry", "Preview", "ProcessInfo", "Secret", "Template")
_SYNC = ("Client", "Files", "Process", "Sandbox", "Sandboxes", "Secrets", "Templates", "Workers")
_LAZY = {
    **dict.fromkeys(_ASYNC, "atoll._client._async"),
    **dict.fromkeys(_MODELS, "atoll._client._models"),
    **dict.fromkeys(_SYNC, "atoll._client._sync"),
}

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSecrets",
    "AsyncTemplates",
    "AsyncWorkers",
    "Client",
    "ExecResult",
    "FileEntry",
    "Files",
    "Process",
    "Preview",
    "ProcessInfo",
    "Sandbox",
    "Sandboxes",
    "Secret",
    "Secrets",
    "Template",
    "Templates",
    "Workers",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'atoll._client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
