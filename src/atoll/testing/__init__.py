"""Tools for testing against atoll: real local installations and a fake worker.

    LocalAtoll      `atoll up` in a subprocess (control plane + local worker)
    LocalCluster    `atoll server` + N `atoll worker` processes (LocalServer, LocalWorker)
    LocalEdge       `atoll edge --server URL` (the data path straight to the workers)
    purge(home)     remove an installation's sandboxes from the host without a server
    FakeWorker      the control plane ↔ worker seam in memory (no runsc), for control-plane tests
    FakeAtoll       the real control plane in process over FakeWorkers (no root, no runsc)
    postgres        PostgresCluster: a private PostgreSQL (initdb into a temporary directory) for
                    records in PostgreSQL (`FakeAtoll(..., database_url=...)`, ATOLL_DATABASE_URL)

The first three need root and the host packages `make run` installs; FakeWorker needs nothing;
`atoll.testing.postgres` needs PostgreSQL's server programs (Debian's `postgresql`) and, as
root, its `postgres` user.
"""

from atoll.testing.control_plane import FakeAtoll
from atoll.testing.fake_worker import FakeRuntime, FakeWorker
from atoll.testing.local import (
    LocalAtoll,
    LocalCluster,
    LocalEdge,
    LocalServer,
    LocalWorker,
    free_port,
    purge,
)

__all__ = [
    "FakeAtoll",
    "FakeRuntime",
    "FakeWorker",
    "LocalAtoll",
    "LocalCluster",
    "LocalEdge",
    "LocalServer",
    "LocalWorker",
    "free_port",
    "purge",
]
