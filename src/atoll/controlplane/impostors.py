"""A worker that asks for a live worker's name: refused while that worker answers.

A worker is known by its name and its installation id (derived from its ATOLL_HOME): the same name
with the same installation is the same worker registering again — after a restart, or a server
that forgot it — and takes its record, its sandboxes and a certificate naming it. The installation
id is no secret from whoever can read the worker's home or its records, so a `worker` key holder
could claim a running worker's name with it: its registration would route that worker's sandboxes
to the impostor (their records failed as vanished from its inventory), and a certificate naming
it would let a host that can take over the worker's address pass the server's check of the
worker's certificate.

`refuse_live_twin` closes that while the worker lives: before a certificate is signed for a name,
or a registration takes it, the worker registered under that name is called (its token, its
certificate checked); if it answers as itself, the request is refused with 409 `worker_conflict`.
A worker that really restarted does not answer its old registration (the old process is gone, a
new one does not know the old token), and takes its name back at once. A live worker that
registers again (the server forgot its registration, or it moves to another server sharing the
records) still answers: it proves it is that worker with the registration's `proof`
(core.wire.registration_proof: an HMAC of the token it holds over its URL), which is checked
against the token the server calls it with, for a registration from the URL it is registered at,
and it is not called. Claiming that URL proves nothing (a registrant need not serve the URL it
names): without the proof, the worker is called like any other. Called by
controlplane.routes_workers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from atoll.controlplane import workers
from atoll.controlplane.remote_worker import RemoteWorker
from atoll.core import errors, wire
from atoll.core import worker_api as api

log = logging.getLogger(__name__)

PROBE_S = 3.0
"""How long the registered worker has to answer; one that does not is taken for gone."""
LIVE_STATES = ("joining", "ready", "draining")


async def check_registration(
    registry: workers.WorkerRegistry, info: object, url: str, proof: str | None = None
) -> None:
    """`refuse_live_twin` for a registration's `info`, once it is a well-formed worker info (a
    malformed one is left to the registration, which says what is wrong with it: 400)."""
    try:
        parsed = wire.load(api.WorkerInfo, info, "worker registration")
        workers.check_info(parsed)
    except errors.AtollError:
        return
    if parsed.protocol == api.PROTOCOL_VERSION:
        await refuse_live_twin(registry, parsed.name, url, proof)


async def refuse_live_twin(
    registry: workers.WorkerRegistry, name: str, url: str | None, proof: str | None = None
) -> None:
    """409 worker_conflict when the worker registered as `name` still answers as itself; `url`:
    the URL the request comes with (None, a certificate), `proof` the registration's proof that
    it holds the worker's token (a registration from the registered URL with the right proof is
    that worker and is not checked)."""
    wid = registry._by_name.get(name)
    h = registry.handles.get(wid) if wid is not None else None
    if h is None or h.local or h.worker is None or h.info is None or h.state not in LIVE_STATES:
        return
    if url is not None and h.record.url == url and _proven(h.worker, url, proof):
        return
    t0 = time.monotonic()
    try:
        info = await asyncio.wait_for(h.worker.info(), PROBE_S)
    except (errors.AtollError, TimeoutError):
        return  # not answering: the registration it had is stale
    if info.name != name or info.installation != h.info.installation:
        return
    log.warning(
        "worker.impostor: a request for worker %r's name refused: it answers at %s",
        name,
        h.record.url,
        extra={"worker": name, "url": url, "probe_ms": round((time.monotonic() - t0) * 1000, 1)},
    )
    raise errors.Conflict(
        f"worker {name!r} is registered at {h.record.url} and answering there; a second worker "
        "cannot take its name while it runs — give this one another --name (and its own "
        "ATOLL_HOME), or stop the other first",
        code="worker_conflict",
    )


def _proven(worker: object, url: str, proof: str | None) -> bool:
    """The registrant holds the token this server calls the registered worker with."""
    if not proof or not isinstance(worker, RemoteWorker):
        return False
    return hmac.compare_digest(proof.encode(), wire.registration_proof(worker.token, url).encode())
