"""envd's plain-HTTP `/files` routes over the seam (atoll.e2b.envd_http), mounted in Starlette and
called as the `e2b` SDKs call them (httpx multipart with field `file` and the path as filename,
raw octet-stream, gzip), against an in-memory worker (FakeWorker): reads streamed back, writes
streamed in (a large upload reaches write_file in pieces), the non-empty JSON array the SDKs
check, relative paths against the home, and errors as `{"code": <int>, "message"}`."""

from __future__ import annotations

import gzip

import httpx
import pytest
from starlette.applications import Starlette

from atoll.core import worker_api as api
from atoll.e2b import envd_http
from atoll.testing.fake_worker import FakeWorker

SID = "sb-hhhhhhhhhhhhhhhh"


@pytest.fixture
async def envd():
    worker = FakeWorker()
    await worker.create(api.SandboxSpec(SID, "base", 512, 1, 64))
    files = envd_http.FilesHTTP(worker, SID, home="/home/user")
    app = Starlette(routes=files.routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as c:
        yield worker, c
    await worker.aclose()


def _stored(worker: FakeWorker, path: str) -> bytes | None:
    return worker.runtimes[SID].files.get(path.encode())


async def test_multipart_writes_and_reads_back(envd):
    worker, c = envd
    # one file: the path in the query, the SDK's filename is the same path
    r = await c.post("/files", params={"path": "notes/a.txt"}, files=[("file", ("notes/a.txt", b"hello"))])
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "a.txt", "type": "file", "path": "/home/user/notes/a.txt"}]
    assert _stored(worker, "/home/user/notes/a.txt") == b"hello"
    # several files: each part's filename is its path; binary content intact
    blob = bytes(range(256)) * 4
    r = await c.post(
        "/files",
        files=[("file", ("/tmp/x.bin", blob)), ("file", ("/tmp/y.txt", b"y")), ("other", ("ignored", b"z"))],
    )
    assert r.status_code == 200, r.text
    assert [e["path"] for e in r.json()] == ["/tmp/x.bin", "/tmp/y.txt"]
    assert _stored(worker, "/tmp/x.bin") == blob and _stored(worker, "/tmp/y.txt") == b"y"
    assert _stored(worker, "/home/user/ignored") is None
    r = await c.get("/files", params={"path": "/tmp/x.bin"})
    assert r.status_code == 200 and r.content == blob
    assert r.headers["content-type"] == "application/octet-stream"
    r = await c.get("/files", params={"path": "notes/a.txt"}, headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200 and r.content == b"hello"
    # username picks the home a relative path resolves against
    r = await c.post(
        "/files", params={"path": "r.txt", "username": "root"}, files=[("file", ("r.txt", b"r"))]
    )
    assert r.json()[0]["path"] == "/root/r.txt", r.text


async def test_octet_stream_and_gzip_are_streamed(envd, monkeypatch):
    worker, c = envd
    pieces: list[int] = []
    write_file = worker.write_file

    async def counting(sid, path, chunks, size):
        async def seen():
            async for chunk in chunks:
                pieces.append(len(chunk))
                yield chunk

        await write_file(sid, path, seen(), size)

    monkeypatch.setattr(worker, "write_file", counting)
    big = b"0123456789abcdef" * (1 << 16)  # 1 MiB

    async def body():
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    r = await c.post(
        "/files",
        params={"path": "/data/big"},
        content=body(),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.json() == [{"name": "big", "type": "file", "path": "/data/big"}], r.text
    assert _stored(worker, "/data/big") == big and len(pieces) > 1  # never one whole body
    r = await c.post(
        "/files",
        params={"path": "/data/z"},
        content=gzip.compress(b"zipped " * 1000),
        headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 200, r.text
    assert _stored(worker, "/data/z") == b"zipped " * 1000
    # a multipart upload in many pieces too
    pieces.clear()
    r = await c.post("/files", files=[("file", ("/data/m", big))])
    assert r.status_code == 200 and _stored(worker, "/data/m") == big and len(pieces) >= 1, r.text


async def test_errors_are_envds(envd):
    _, c = envd
    r = await c.get("/files", params={"path": "/nope"})
    assert r.status_code == 404 and r.json()["code"] == 404 and "/nope" in r.json()["message"], r.text
    r = await c.get("/files")
    assert r.status_code == 400 and r.json()["code"] == 400 and "path is empty" in r.json()["message"]
    for kwargs, words in [
        ({"content": b"raw", "headers": {"Content-Type": "application/octet-stream"}}, "path is empty"),
        (
            {
                "params": {"path": "/a"},
                "content": b"not gzip",
                "headers": {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
            },
            "not valid gzip",
        ),
        (
            {
                "params": {"path": "/a"},
                "content": gzip.compress(b"x" * 100)[:20],
                "headers": {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
            },
            "truncated",
        ),
        (
            {"params": {"path": "/a"}, "content": b"x", "headers": {"Content-Encoding": "br"}},
            "Content-Encoding",
        ),
        ({"content": b"--x\r\n", "headers": {"Content-Type": "multipart/form-data"}}, "boundary"),
        (
            {
                "content": b"garbage without a boundary line",
                "headers": {"Content-Type": "multipart/form-data; boundary=x"},
            },
            "malformed",
        ),
        ({"files": [("other", ("/a", b"x"))]}, 'no part named "file"'),
        (
            {"params": {"path": "a", "username": "../etc"}, "files": [("file", ("a", b"x"))]},
            "not a user name",
        ),
        (
            {
                "content": b'--x\r\nContent-Disposition: form-data; name="file"; filename="/a"\r\n\r\nhalf',
                "headers": {"Content-Type": "multipart/form-data; boundary=x"},
            },
            "ended inside a part",
        ),
    ]:
        r = await c.post("/files", **kwargs)
        assert r.status_code == 400 and r.json()["code"] == 400, (kwargs, r.text)
        assert words in r.json()["message"], (words, r.text)
    r = await c.put("/files", content=b"x")
    assert r.status_code == 405


async def test_a_failed_write_answers_its_error_without_reading_on(envd):
    worker, c = envd
    worker.fail.add("write_file")
    big = b"x" * (4 << 20)
    for kwargs in (
        {"files": [("file", ("/data/f", big))]},
        {
            "params": {"path": "/data/f"},
            "content": big,
            "headers": {"Content-Type": "application/octet-stream"},
        },
    ):
        r = await c.post("/files", **kwargs)
        assert r.status_code >= 500 and r.json()["code"] == r.status_code, r.text
        assert r.json()["message"].startswith("runtime_"), r.text
    assert _stored(worker, "/data/f") is None
