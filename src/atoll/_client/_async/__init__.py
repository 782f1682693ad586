"""The atoll SDK's asynchronous client, one module per resource.

`AsyncClient` (client), sandboxes and `AsyncSandbox` (sandboxes), files and watches (files),
processes, terminals, templates, secrets, workers, tenants and keys.

Hand-written; the source of truth for the SDK. `scripts/unasync_sdk.py` generates the sync twin
`_sync/` from this folder, file by file, so write only code that still makes sense with
`async`/`await` removed: swap helpers through the name pairs that script lists (e.g.
`_base.acall_callback` becomes `_base.call_callback`). Users reach it as `atoll.AsyncClient`; the
CLI uses the sync twin.
"""

from .client import AsyncClient
from .files import AsyncFiles, AsyncWatch
from .processes import AsyncProcess, AsyncProcesses
from .sandboxes import AsyncSandbox, AsyncSandboxes
from .secrets import AsyncSecrets
from .stores import AsyncDrive, AsyncDriveFiles, AsyncDrives, AsyncVolume, AsyncVolumes
from .templates import AsyncTemplates
from .tenants import AsyncKeys, AsyncTenants
from .terminal import AsyncTerminal
from .workers import AsyncWorkers

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSecrets",
    "AsyncVolume",
    "AsyncVolumes",
    "AsyncDrive",
    "AsyncDriveFiles",
    "AsyncDrives",
    "AsyncTemplates",
    "AsyncTenants",
    "AsyncKeys",
    "AsyncTerminal",
    "AsyncWatch",
    "AsyncWorkers",
]
