"""The atoll SDK's HTTP clients. Imported lazily by `atoll/__init__.py`; users import from `atoll`.

`_async.py` is the hand-written async client, `_sync.py` its generated sync twin
(`scripts/unasync_sdk.py`), `_base.py` the sans-I/O helpers both share and `_models.py`
the result objects.
"""

from atoll._client._async import (
    AsyncClient,
    AsyncFiles,
    AsyncProcess,
    AsyncSandbox,
    AsyncSandboxes,
    AsyncTemplates,
    AsyncWorkers,
)
from atoll._client._models import ExecResult, FileEntry, ProcessInfo, Template
from atoll._client._sync import Client, Files, Process, Sandbox, Sandboxes, Templates, Workers

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncTemplates",
    "AsyncWorkers",
    "Client",
    "ExecResult",
    "FileEntry",
    "Files",
    "Process",
    "ProcessInfo",
    "Sandbox",
    "Sandboxes",
    "Template",
    "Templates",
    "Workers",
]
