"""The atoll SDK's HTTP clients. Imported lazily by `atoll/__init__.py`; users import from `atoll`.

`_async/` is the hand-written async client, one module per resource, `_sync/` its generated sync
twin, file for file (`scripts/unasync_sdk.py`), `_base.py` the sans-I/O helpers both share,
`_models.py` the result objects and `_tar.py` tar streams of local trees.
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
