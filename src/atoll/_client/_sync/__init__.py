"""GENERATED FILE - do not edit. The atoll SDK's synchronous client, one module per resource.

Generated from `_async/__init__.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from .client import Client
from .files import Files, Watch
from .processes import Process, Processes
from .sandboxes import Sandbox, Sandboxes
from .secrets import Secrets
from .stores import Drive, DriveFiles, Drives, Volume, Volumes
from .templates import Templates
from .tenants import Keys, Tenants
from .terminal import Terminal
from .workers import Workers

__all__ = [
    "Client",
    "Files",
    "Process",
    "Processes",
    "Sandbox",
    "Sandboxes",
    "Secrets",
    "Volume",
    "Volumes",
    "Drive",
    "DriveFiles",
    "Drives",
    "Templates",
    "Tenants",
    "Keys",
    "Terminal",
    "Watch",
    "Workers",
]
