"""Structural checks of the control plane <-> worker seam, for mypy (run by `make lint`).

Every implementation of core.worker_api.WorkerAPI is assigned to a variable of that Protocol type:
mypy then proves each one has every verb with a compatible signature. Nothing here runs.
"""

from __future__ import annotations

import typing

from atoll.controlplane.remote_worker import RemoteWorker
from atoll.core.worker_api import WorkerAPI
from atoll.edge.seam import GrantedWorker
from atoll.testing.fake_worker import FakeWorker
from atoll.worker.service.node import Node


def _implementations(
    node: Node, remote: RemoteWorker, fake: FakeWorker, granted: GrantedWorker
) -> list[WorkerAPI]:
    checked: list[WorkerAPI] = [node, remote, fake, granted]
    return checked


if typing.TYPE_CHECKING:
    _ = _implementations
