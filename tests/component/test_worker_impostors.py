"""A worker asking for a live worker's name (issue 21, faults), over real HTTP: the control plane's
app and a worker's API (FakeWorker behind worker.httpapi, its real registration loop) on loopback.
A registration under a live worker's name — with a `worker` key, from another URL, or from the
worker's own URL without the proof that it holds the worker's token — is refused (409
worker_conflict) whether it claims the worker's installation or another, and changes nothing: the worker keeps its registration and its sandboxes are served as before. The
installation CA does not sign a certificate naming a live worker either. A worker that restarted
(its old registration does not answer) takes its name back at once. (A worker serving another
worker's certificate is refused in the TLS handshake: tests/component/test_worker_tls.py.)"""

from __future__ import annotations

import asyncio
import ssl

from atoll.controlplane.authority import Authority
from atoll.core import pki, wire
from atoll.core import worker_api as api
from atoll.testing import FakeWorker, free_port
from tests.component import test_worker_protocol as protocol
from tests.component.test_worker_protocol import _info, _register, _until_ready, _worker

cluster = protocol.cluster  # the control plane and worker w1, on loopback


async def _worker_key(c) -> dict:
    r = await c.post("/v1/keys", json={"scope": "worker"})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']}"}


async def test_a_live_workers_name_is_not_taken_over(cluster):
    cp, c, fake, reg, wport = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    h = cp.manager.workers.handles[reg.worker_id]
    before = (h.record.url, h.epoch, h.worker)
    c.headers.update(await _worker_key(c))  # what a worker holds, not the admin key
    spoof = _info(name="w1", installation=fake.installation)  # its installation id, copied
    for info in (spoof, _info(name="w1", installation="another")):
        r = await _register(c, info, url=f"http://127.0.0.1:{free_port()}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "worker_conflict", r.text
    assert (
        "answering there" in (await _register(c, spoof, url="http://127.0.0.1:9")).json()["error"]["message"]
    )
    # nothing changed: the same registration, its heartbeats still good, its sandbox served
    assert (h.record.url, h.epoch, h.worker) == before and h.state == "ready"
    assert await reg.heartbeat()
    c.headers["Authorization"] = f"Bearer {cp.api_key}"
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


async def test_no_certificate_names_a_live_worker(cluster, tmp_path):
    cp, c, fake, reg, wport = cluster
    cp.manager.authority = Authority.open(str(tmp_path / "ca-home"))
    c.headers.update(await _worker_key(c))
    _, csr = pki.new_worker_request("w1")
    body = {"name": "w1", "url": f"https://127.0.0.1:{free_port()}", "csr": csr.decode()}
    hdr = {"Atoll-Protocol": str(api.PROTOCOL_VERSION)}
    r = await c.post("/v1/workers/certificate", json=body, headers=hdr)
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_conflict", r.text
    # another name is signed (the check is about live names only)
    r = await c.post("/v1/workers/certificate", json={**body, "name": "w7"}, headers=hdr)
    assert r.status_code == 200, r.text
    assert pki.worker_names(ssl.PEM_cert_to_DER_cert(r.json()["certificate"])) == ["w7"]


async def test_a_restarted_worker_takes_its_name_back_at_once(cluster):
    cp, c, fake, reg, wport = cluster
    cp.manager.workers.lost_after_s = 60.0  # still `ready` when it registers again
    w9 = FakeWorker("w9", installation="i9")
    async with _worker(str(c.base_url), w9) as (reg9, _task, port9):
        for _ in range(200):
            h = cp.manager.workers.handles.get(reg9.worker_id or "")
            if h is not None and h.state == "ready":
                break
            await asyncio.sleep(0.02)
        assert h is not None and h.state == "ready"
    # its process is gone (API closed): the same worker, restarted on another port
    r = await _register(c, _info(name="w9", installation="i9"), url=f"http://127.0.0.1:{free_port()}")
    assert r.status_code == 201 and r.json()["worker_id"] == h.id, r.text


async def test_a_live_workers_own_url_is_not_enough(cluster):
    """Found by review (issue 21): a registration claiming w1's name and installation from w1's
    own URL was taken for w1 registering again — 201, w1 marked lost (it refused the token it was
    never given) and its sandboxes 503. Naming the URL proves nothing: the registrant must show it
    holds w1's token (`proof`), which the real w1 does when it registers again."""
    cp, c, fake, reg, wport = cluster
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    h = cp.manager.workers.handles[reg.worker_id]
    url = f"http://127.0.0.1:{wport}"
    assert h.record.url == url
    before = (h.epoch, h.worker)
    c.headers.update(await _worker_key(c))
    spoof = _info(name="w1", installation=fake.installation)
    forged = wire.registration_proof("not-its-token", url)
    for body in ({"url": url, "info": spoof}, {"url": url + "/", "info": spoof, "proof": forged}):
        r = await c.post(
            "/v1/workers/register", json=body, headers={"Atoll-Protocol": str(api.PROTOCOL_VERSION)}
        )
        assert r.status_code == 409 and r.json()["error"]["code"] == "worker_conflict", r.text
    assert (h.epoch, h.worker) == before and h.state == "ready"
    assert await reg.heartbeat()
    c.headers["Authorization"] = f"Bearer {cp.api_key}"
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text
    # the real w1, still answering its registration, registers again: it proves it holds its token
    await reg.register()
    assert h.epoch == reg.epoch and h.epoch != before[0]
    assert await _until_ready(h, tries=200)
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text
