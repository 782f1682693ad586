"""The worker's side of joining a server: register, heartbeat, register again when forgotten.

`Registration.run` registers with `ATOLL_API_KEY` (the admin key, for now) and this worker's info
(name, installation, protocol, capacity, templates) and the URL the server should call; the answer
carries the worker id, a token (the only credential the worker's API accepts from then on) and a
registration epoch. It then heartbeats every `heartbeat_s`. A heartbeat answered 409
worker_not_registered (the server restarted and forgot its tokens) leads to a new registration,
which carries `proof` that this process holds the token it had (core.wire.registration_proof:
a live worker's name is given only to it, controlplane.impostors); an
unreachable server is retried (with a growing pause, at most MAX_RETRY_S) while the sandboxes run
on. With several servers (`--server A,B`: servers sharing one database) it registers with one at a
time and moves to the next when no heartbeat has reached its server for FAILOVER_BEATS heartbeats
(or a registration fails): the new server takes the worker over and serves its sandboxes. A
refusal that no retry fixes — a wrong key (401), another protocol version, a name taken by
another installation, a server certificate the CA file does not vouch for — is `Fatal`: the worker
stops with that message.

Over https:// (`Identity`): the worker checks the server's certificate against `--ca-file` (or the
system trust store), makes its own key under `$ATOLL_HOME/tls/` (it never leaves the worker) and,
before it registers, sends a CSR to `POST /v1/workers/certificate`; the installation CA's answer —
a certificate for the advertised URL's host naming this worker — is loaded into the TLS context the
worker's API serves with, so it is in place before the server's first call.
Called by worker.main.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time

import httpx

from atoll.core import errors, pki, wire
from atoll.core import worker_api as api
from atoll.worker.service.httpapi import Credentials
from atoll.worker.service.node import Node
from atoll.worker.service.settings import WorkerSettings

log = logging.getLogger(__name__)

MAX_RETRY_S = 5.0
FAILOVER_BEATS = 3
"""With several servers: heartbeats in a row that failed before the worker moves to the next."""


class Fatal(Exception):
    """The server refused this worker for a reason a retry cannot fix."""


class Identity:
    """This worker's key and the TLS context its API serves with (its certificate loaded by
    `install` once the installation CA signed it)."""

    def __init__(self, settings: WorkerSettings):
        self.dir = os.path.join(settings.home, "tls")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.key_path = os.path.join(self.dir, "worker.key")
        self.cert_path = os.path.join(self.dir, "worker.crt")
        key, self.csr = pki.new_worker_request(settings.name)
        _replace_private(self.key_path, key)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ready = False

    def install(self, cert_pem: bytes) -> None:
        _replace_private(self.cert_path, cert_pem)
        self.context.load_cert_chain(self.cert_path, self.key_path)
        self.ready = True


def _replace_private(path: str, data: bytes) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _server_trust(s: WorkerSettings) -> ssl.SSLContext | bool:
    """How the server's certificate is checked: the CA file, or this host's trust store."""
    if not (s.server_url or "").startswith("https://"):
        return True
    if s.ca_file:
        return ssl.create_default_context(cafile=s.ca_file)
    return ssl.create_default_context()


class Registration:
    def __init__(
        self,
        settings: WorkerSettings,
        node: Node,
        creds: Credentials,
        url: str,
        identity: Identity | None = None,
    ):
        assert settings.server_url
        self.s = settings
        self.servers = settings.server_urls or (settings.server_url,)
        """The servers it may join (`--server A,B`), the one it uses now first in turn."""
        self._at = 0
        self.node = node
        self.creds = creds
        self.url = url
        self.identity = identity
        self.worker_id: str | None = None
        self.epoch: str | None = None
        self.heartbeat_s = settings.heartbeat_s
        self.registered = asyncio.Event()
        self._http = self._client()

    @property
    def server(self) -> str:
        """The server it registers with now."""
        return self.servers[self._at]

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.server,
            headers={
                "Authorization": f"Bearer {self.s.api_key or ''}",
                wire.PROTOCOL_HEADER: str(api.PROTOCOL_VERSION),
            },
            timeout=httpx.Timeout(10.0, connect=5.0),
            verify=_server_trust(self.s),
        )

    async def _next_server(self, why: str) -> bool:
        """Move to the next of several servers (False when there is only one)."""
        if len(self.servers) < 2:
            return False
        old = self.server
        self._at = (self._at + 1) % len(self.servers)
        await self._http.aclose()
        self._http = self._client()
        self.worker_id = self.epoch = None
        log.warning("leaving server %s (%s): joining %s", old, why, self.server)
        return True

    def _refusal(self, r: httpx.Response) -> errors.AtollError:
        try:
            body = r.json()
        except ValueError:
            body = None
        return wire.error_from_body(
            r.status_code, body, f"the server answered {r.status_code}: {r.text[:200]}"
        )

    def _untrusted(self, e: httpx.HTTPError) -> Fatal | None:
        """A Fatal when `e` is the server's certificate failing verification (no retry fixes it)."""
        if "CERTIFICATE_VERIFY_FAILED" not in str(e):
            return None
        trust = (
            f"the CA in --ca-file {self.s.ca_file}"
            if self.s.ca_file
            else "this host's trust store (no --ca-file given)"
        )
        return Fatal(
            f"the server at {self.server} presented a certificate that {trust} does not vouch "
            f"for ({e}). Give --ca-file (ATOLL_CA_FILE) the server's installation CA — its GET "
            "/v1/ca.crt, or $ATOLL_HOME/ca/root.crt on the server — and check that the --server host "
            "is among the server's ATOLL_TLS_NAMES"
        )

    async def certify(self) -> None:
        """Have the installation CA sign this worker's key (before registering: the server calls
        the worker over TLS as soon as it is registered)."""
        assert self.identity is not None
        body = {"name": self.s.name, "url": self.url, "csr": self.identity.csr.decode()}
        r = await self._http.post("/v1/workers/certificate", json=body)
        if r.status_code == 401:
            raise Fatal(
                f"the server at {self.server} refused this worker's key: set ATOLL_API_KEY to a "
                "`worker` key (`atoll key create --scope worker`)"
            )
        if r.status_code >= 400:
            e = self._refusal(r)
            if r.status_code < 500:
                raise Fatal(f"the server refused to certify this worker: {e.code}: {e.message}")
            raise e
        try:
            self.identity.install(r.json()["certificate"].encode())
        except (ssl.SSLError, KeyError, ValueError) as e:
            raise Fatal(f"the server's certificate for this worker cannot be used: {e}") from None
        log.info("certified by the installation CA for %s", self.url)

    async def register(self) -> None:
        try:
            await self._register()
        except httpx.HTTPError as e:
            fatal = self._untrusted(e)
            if fatal is not None:
                raise fatal from None
            raise

    async def _register(self) -> None:
        if self.identity is not None and not self.identity.ready:
            await self.certify()
        info = await self.node.info()
        body = {"url": self.url, "info": wire.dump(info)}
        if self.creds.token is not None:  # registering again: show the server it is this process
            body["proof"] = wire.registration_proof(self.creds.token.decode(), self.url)
        r = await self._http.post("/v1/workers/register", json=body)
        if r.status_code == 401:
            raise Fatal(
                f"the server at {self.server} refused this worker's key: set ATOLL_API_KEY to a "
                "`worker` key (`atoll key create --scope worker` with the admin key), or to the server's admin "
                "key (deprecated; its ATOLL_API_KEY or $ATOLL_HOME/admin.key on the server); a revoked or "
                "expired key is refused too"
            )
        if r.status_code == 404:
            raise Fatal(
                f"{self.server} is not an atoll server that takes workers (POST /v1/workers/register is 404)"
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
        log.info("registered with %s as %s (%s)", self.server, self.s.name, self.worker_id)

    async def heartbeat(self) -> bool:
        """False when the server no longer knows this registration."""
        r = await self._http.post(f"/v1/workers/{self.worker_id}/heartbeat", json={"epoch": self.epoch})
        if r.status_code == 409:
            log.info("the server forgot this worker's registration (it restarted?): registering again")
            return False
        if r.status_code == 401:
            raise Fatal("the server refused this worker's key (ATOLL_API_KEY changed on the server?)")
        if r.status_code == 503:  # the server is there, its records database is not: no reason to move
            log.warning("heartbeat to %s: %s", self.server, self._refusal(r).message)
            return True
        r.raise_for_status()
        return True

    async def run(self) -> None:
        pause = 0.5
        tried = 0
        while True:
            try:
                await self.register()
            except Fatal:
                raise
            except (httpx.HTTPError, errors.AtollError, ValueError, KeyError) as e:
                tried += 1
                there = isinstance(e, errors.AtollError) and e.code == "database_unavailable"
                if (
                    not there
                    and await self._next_server(f"cannot register: {e}")
                    and tried % len(self.servers)
                ):
                    continue  # the next server at once; a pause after a whole round
                log.warning("cannot register with %s (%s); retrying in %.1fs", self.server, e, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_RETRY_S)
                continue
            pause, tried = 0.5, 0
            failing: float | None = None
            while True:
                await asyncio.sleep(self.heartbeat_s)
                try:
                    if not await self.heartbeat():
                        break
                    if failing is not None:
                        log.info("heartbeats reach %s again", self.server)
                    failing = None
                except Fatal:
                    raise
                except (httpx.HTTPError, ValueError) as e:
                    if failing is None:  # the server is down or restarting: the sandboxes run on
                        log.warning("heartbeat to %s failed (%s); still trying", self.server, e)
                        failing = time.monotonic()
                    elif time.monotonic() - failing >= FAILOVER_BEATS * self.heartbeat_s and (
                        await self._next_server(
                            f"no heartbeat has reached it for {time.monotonic() - failing:.0f} s"
                        )
                    ):
                        break

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
