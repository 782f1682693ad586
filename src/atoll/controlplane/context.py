"""What the routers of the public API share at run time: the manager and the server's limits.

Put on `app.state.ctx` by controlplane.app.create_app; read by every router through `ctx(request)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from atoll._version import __version__
from atoll.controlplane.lifecycle import SandboxManager
from atoll.controlplane.previews import Previews
from atoll.controlplane.secrets import SecretStore

VERSION = __version__  # the package's version (workers report theirs)


@dataclass
class Context:
    manager: SandboxManager
    max_file_bytes: int
    max_exec_output_bytes: int
    secrets: SecretStore
    previews: Previews
    started: bool = False
    """Set once the server has finished starting (in `atoll up`: its worker adopted)."""


def ctx(request: Request) -> Context:
    return request.app.state.ctx
