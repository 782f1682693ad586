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
    AsyncSecrets,
    AsyncTemplates,
    AsyncWorkers,
)
from atoll._client._models import ExecResult, FileEntry, Preview, ProcessInfo, Secret, Template
from atoll._client._sync import Client, Files, Process, Sandbox, Sandboxes, Secrets, Templates, Workers

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
