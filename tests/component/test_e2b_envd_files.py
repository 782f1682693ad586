"""envd's Filesystem service over the seam (atoll.e2b.envd_files), served by the generated
connectrpc application and called in the framing the `e2b` SDKs use (Connect, JSON), against an
in-memory worker (FakeWorker): stat, list to a depth, make_dir twice, move, remove (twice: envd's
RemoveAll), relative paths against the home, a streamed watch and a polled watcher, and the
errors the SDKs map (not_found, already_exists, invalid_argument)."""

from __future__ import annotations

import asyncio
import json
import struct

import httpx
import pytest

from atoll.core import worker_api as api
from atoll.e2b import envd_files
from atoll.e2b.proto.filesystem import filesystem_connect
from atoll.testing.fake_worker import FakeWorker

SID = "sb-eeeeeeeeeeeeeeee"


async def _files(worker: FakeWorker, path: str, data: bytes) -> None:
    async def chunks():
        yield data

    await worker.write_file(SID, path, chunks(), len(data))


@pytest.fixture
async def envd():
    worker = FakeWorker()
    await worker.create(api.SandboxSpec(SID, "base", 512, 1, 64))
    service = envd_files.FilesystemService(worker, SID, home="/home/user")
    app = filesystem_connect.FilesystemASGIApplication(service)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as c:

        async def call(rpc: str, body: dict) -> httpx.Response:
            return await c.post(f"/filesystem.Filesystem/{rpc}", json=body)

        yield worker, service, call, c
    await service.close()


async def test_stat_list_mkdir_move_remove(envd):
    worker, _, call, _ = envd
    await worker.make_dir(SID, "/home/user")
    await _files(worker, "/home/user/a.txt", b"hello")
    await _files(worker, "/home/user/sub/deep/b.txt", b"x")

    r = await call("Stat", {"path": "a.txt"})  # relative: against the home
    assert r.status_code == 200, r.text
    e = r.json()["entry"]
    assert (e["name"], e["path"], e["type"], e["size"], e["permissions"]) == (
        "a.txt",
        "/home/user/a.txt",
        "FILE_TYPE_FILE",
        "5",
        "-rw-r--r--",
    )
    r = await call("ListDir", {"path": "/home/user", "depth": 1})
    assert sorted(x["name"] for x in r.json()["entries"]) == ["a.txt", "sub"]
    r = await call("ListDir", {"path": "/home/user", "depth": 3})
    assert sorted(x["path"] for x in r.json()["entries"]) == [
        "/home/user/a.txt",
        "/home/user/sub",
        "/home/user/sub/deep",
        "/home/user/sub/deep/b.txt",
    ]
    r = await call("MakeDir", {"path": "/home/user/new"})
    assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY", r.text
    assert r.json()["entry"]["permissions"].startswith("d")
    r = await call("MakeDir", {"path": "/home/user/new"})
    assert r.status_code == 409 and r.json()["code"] == "already_exists", r.text
    r = await call("Move", {"source": "a.txt", "destination": "/home/user/new/a.txt"})
    assert r.status_code == 200 and r.json()["entry"]["path"] == "/home/user/new/a.txt", r.text
    r = await call("Stat", {"path": "/home/user/a.txt"})
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    assert "file_not_found" in r.json()["message"]
    for _ in range(2):  # the second: already gone, still done (RemoveAll)
        r = await call("Remove", {"path": "/home/user/new/a.txt"})
        assert r.status_code == 200 and r.json() == {}, r.text
    r = await call("ListDir", {"path": "/home/user/sub/deep/b.txt"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    r = await call("ListDir", {"path": "/home/user", "depth": 99})
    assert r.status_code == 400 and "depth 99" in r.json()["message"], r.text
    r = await call("Stat", {"path": ""})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text


def _frames(body: bytes) -> list[tuple[int, dict]]:
    out = []
    while body:
        flags, n = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + n])))
        body = body[5 + n :]
    return out


async def test_a_streamed_watch_and_a_polled_watcher(envd):
    worker, service, call, c = envd
    await worker.make_dir(SID, "/w")
    req = json.dumps({"path": "/w"}).encode()

    async def changes():
        await asyncio.sleep(0.1)
        await _files(worker, "/w/f", b"1")
        await worker.move_file(SID, "/w/f", "/w/g")
        await worker.delete_file(SID, "/w/g")

    async def watch():
        async with c.stream(
            "POST",
            "/filesystem.Filesystem/WatchDir",
            content=struct.pack(">BI", 0, len(req)) + req,
            headers={"Content-Type": "application/connect+json", "Connect-Timeout-Ms": "1500"},
        ) as r:
            return r.status_code, await r.aread()

    status, body = (await asyncio.gather(watch(), changes()))[0]
    assert status == 200
    frames = _frames(body)
    assert frames[0] == (0, {"start": {}})
    events = [f[1]["filesystem"] for f in frames if "filesystem" in f[1]]
    assert events == [
        {"name": "f", "type": "EVENT_TYPE_CREATE"},
        {"name": "f", "type": "EVENT_TYPE_RENAME"},
        {"name": "g", "type": "EVENT_TYPE_CREATE"},
        {"name": "g", "type": "EVENT_TYPE_REMOVE"},
    ], frames
    assert frames[-1][0] == 2  # ended by its deadline: an end-of-stream frame
    assert frames[-1][1]["error"]["code"] == "deadline_exceeded"

    r = await call("CreateWatcher", {"path": "/w", "recursive": True})
    assert r.status_code == 200, r.text
    wid = r.json()["watcherId"]
    await _files(worker, "/w/h", b"2")
    await asyncio.sleep(0.05)
    r = await call("GetWatcherEvents", {"watcherId": wid})
    assert r.json() == {"events": [{"name": "h", "type": "EVENT_TYPE_CREATE"}]}, r.text
    r = await call("GetWatcherEvents", {"watcherId": wid})
    assert r.json() == {}, r.text  # nothing new
    assert (await call("RemoveWatcher", {"watcherId": wid})).status_code == 200
    r = await call("GetWatcherEvents", {"watcherId": wid})
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    r = await call("CreateWatcher", {"path": "/nowhere"})
    assert r.status_code == 404, r.text
    assert not service._watchers


async def test_a_watch_keeps_its_events_across_keepalives(envd):
    """Silence longer than `Keepalive-Ping-Interval` sends a keepalive and the watch goes on: an
    event after it still arrives (waiting for it with a timeout must not close the stream)."""
    worker, _, _, c = envd
    await worker.make_dir(SID, "/k")
    req = json.dumps({"path": "/k"}).encode()

    async def later():
        await asyncio.sleep(1.6)
        await _files(worker, "/k/late", b"1")

    async def watch():
        async with c.stream(
            "POST",
            "/filesystem.Filesystem/WatchDir",
            content=struct.pack(">BI", 0, len(req)) + req,
            headers={
                "Content-Type": "application/connect+json",
                "Connect-Timeout-Ms": "3000",
                "Keepalive-Ping-Interval": "1",
            },
        ) as r:
            return await r.aread()

    body = (await asyncio.gather(watch(), later()))[0]
    kinds = [next(iter(f[1])) for f in _frames(body) if f[0] == 0]
    assert kinds[0] == "start" and "keepalive" in kinds, kinds
    assert kinds.index("keepalive") < kinds.index("filesystem"), kinds
