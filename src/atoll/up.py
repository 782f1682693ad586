"""`atoll up`: the control plane and one local worker in one process, with embedded defaults.

The worker (worker.service.node.Node) runs in-process and is the control plane's worker `local`, reached
through the same seam as a remote one (core.worker_api), without HTTP. Start-up: the worker
prepares the host and reattaches to the sandboxes a previous run left (they kept running: runsc
lives in its own sessions), the control plane adopts it (records reconciled with its inventory,
orphans removed) before the API serves, and the `base` template is prepared in the background
(`/healthz` answers 200 once it is). Stopping never stops a sandbox. Called by the CLI
(`atoll up`) and atoll.testing.
"""

from __future__ import annotations

import logging
import sys

from atoll.controlplane import main as server_main
from atoll.controlplane import settings as server_settings
from atoll.shared import entry
from atoll.worker.service import node as node_mod
from atoll.worker.service import settings as worker_settings

log = logging.getLogger("atoll.up")


def load(port: int | None = None, home: str | None = None, host: str | None = None, slots: int | None = None):
    s = server_settings.load(port=port, home=home, host=host)
    w = worker_settings.load(home=s.home, name="local", slots=slots)
    return s, w


async def serve(s: server_settings.ServerSettings, w: worker_settings.WorkerSettings) -> int:
    worker = node_mod.Node(w)
    try:
        worker.claim_home()
    except node_mod.HomeInUse as e:
        print(f"atoll: {e.message}", file=sys.stderr)
        return 2
    manager, tiers, app = server_main.build(s)

    async def attach() -> None:
        await worker.start()
        await manager.workers.attach_local(worker)

    await server_main.serve_api(
        s,
        manager,
        tiers,
        app,
        up="atoll",
        down="atoll stopped; sandboxes keep running and are reattached by the next `atoll up`",
        local=(attach, worker.aclose),
    )
    return 0


def main(
    port: int | None = None, home: str | None = None, host: str | None = None, slots: int | None = None
) -> None:
    s, w = entry.settings_or_exit("atoll", lambda: load(port=port, home=home, host=host, slots=slots))
    entry.start(
        "atoll", s, log, needs_root=f"the local worker needs root ({entry.ROOT_FOR})", worker=w.redacted()
    )
    entry.run(serve(s, w))
