"""The worker's side of joining a server: register, heartbeat, register again when forgotten.

`Registration.run` registers with `ATOLL_API_KEY` (the admin key, for now) and this worker's info
(name, installation, protocol, capacity, templates) and the URL the server should call; the answer
carries the worker id, a token (the only credential the worker's API accepts from then on) and a
registration epoch. It then heartbeats every `heartbeat_s`. A heartbeat answered 409
worker_not_registered (the server restarted and forgot its tokens) leads to a new registration; an
unreachable server is retried (with a growing pause, at most MAX_RETRY_S) while the sandboxes run
on. A refusal that no retry fixes — a wrong key (401), another protocol version, a name taken by
another installation — is `Fatal`: the worker stops with that message.
Called by worker.main.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from atoll.core import errors, wire
from atoll.core import worker_api as api
from atoll.worker.service.httpapi import Credentials
from atoll.worker.service.node import Node
from atoll.worker.service.settings import WorkerSettings

log = logging.getLogger(__name__)

MAX_RETRY_S = 5.0


class Fatal(Exception):
    """The server refused this worker for a reason a retry cannot fix."""


class Registration:
    def __init__(self, settings: WorkerSettings, node: Node, creds: Credentials, url: str):
        assert settings.server_url
        self.s = settings
        self.node = node
        self.creds = creds
        self.url = url
        self.worker_id: str | None = None
        self.epoch: str | None = None
        self.heartbeat_s = settings.heartbeat_s
        self.registered = asyncio.Event()
        self._http = httpx.AsyncClient(
            base_url=settings.server_url,
            headers={
                "Authorization": f"Bearer {settings.api_key or ''}",
                wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION),
            },
            timeout=httpx.Timeout(10.0, connect=5.0),
        )

    def _refusal(self, r: httpx.Response) -> errors.AtollError:
        try:
            body = r.json()
        except ValueError:
            body = None
        return wire.error_from_body(
            r.status_code, body, f"the server answered {r.status_code}: {r.text[:200]}"
        )

    async def register(self) -> None:
        info = await self.node.info()
        r = await self._http.post("/v1/workers/register", json={"url": self.url, "info": wire.dump(info)})
        if r.status_code == 401:
            raise Fatal(
                f"the server at {self.s.server_url} refused this worker's key: set ATOLL_API_KEY to a "
                "`worker` key (`atoll key create --scope worker` with the admin key), or to the server's admin "
                "key (deprecated; its ATOLL_API_KEY or $ATOLL_HOME/admin.key on the server); a revoked or "
                "expired key is refused too"
            )
        if r.status_code == 404:
            raise Fatal(
                f"{self.s.server_url} is not an atoll server that takes workers (POST /v1/workers/register is 404)"
            )
        if r.status_code >= 400:
            e = self._refusal(r)
            if r.status_code < 500:
                raise Fatal(f"the server refused this worker: {e.code}: {e.message}")
            raise e
        answer = r.json()
        if answer.get("protocol") != api.PROTOCOL_VERSION:
            raise Fatal(
                f"the server speaks worker protocol {answer.get('protocol')}, this worker speaks "
                f"{api.PROTOCOL_VERSION}; run the same atoll version on both"
            )
        self.creds.set(answer["token"])
        self.worker_id, self.epoch = answer["worker_id"], answer["epoch"]
        self.heartbeat_s = min(self.s.heartbeat_s, float(answer.get("heartbeat_s", self.s.heartbeat_s)))
        self.registered.set()
        log.info("registered with %s as %s (%s)", self.s.server_url, self.s.name, self.worker_id)

    async def heartbeat(self) -> bool:
        """False when the server no longer knows this registration."""
        r = await self._http.post(f"/v1/workers/{self.worker_id}/heartbeat", json={"epoch": self.epoch})
        if r.status_code == 409:
            log.info("the server forgot this worker's registration (it restarted?): registering again")
            return False
        if r.status_code == 401:
            raise Fatal("the server refused this worker's key (ATOLL_API_KEY changed on the server?)")
        r.raise_for_status()
        return True

    async def run(self) -> None:
        pause = 0.5
        while True:
            try:
                await self.register()
            except Fatal:
                raise
            except (httpx.HTTPError, errors.AtollError, ValueError, KeyError) as e:
                log.warning("cannot register with %s (%s); retrying in %.1fs", self.s.server_url, e, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_RETRY_S)
                continue
            pause = 0.5
            failing = False
            while True:
                await asyncio.sleep(self.heartbeat_s)
                try:
                    if not await self.heartbeat():
                        break
                    if failing:
                        log.info("heartbeats reach %s again", self.s.server_url)
                    failing = False
                except Fatal:
                    raise
                except (httpx.HTTPError, ValueError) as e:
                    if not failing:  # the server is down or restarting: the sandboxes run on
                        log.warning("heartbeat to %s failed (%s); still trying", self.s.server_url, e)
                    failing = True

    async def stopping(self) -> None:
        """Tell the server this worker stops (best effort): it is shown lost at once."""
        if self.worker_id is None:
            return
        try:
            await self._http.post(
                f"/v1/workers/{self.worker_id}/stopping", json={"epoch": self.epoch}, timeout=2
            )
        except httpx.HTTPError:
            pass

    async def aclose(self) -> None:
        await self._http.aclose()
