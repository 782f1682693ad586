"""The fuller files API (issue 9) through the real control plane over the fake worker: stat, mkdir,
move, chmod, tar upload/download and their bad input; the watch's errors before its stream starts
(httpx's ASGI transport buffers whole answers, so the live stream is tested in integration)."""

from __future__ import annotations

import io
import tarfile

import pytest

from atoll.core import errors
from atoll.testing import FakeAtoll
from tests.component.conftest import KEY, create


@pytest.fixture
async def roomy(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY, max_file_bytes=1 << 20) as f:
        yield f


def _tar(members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for m in members:
            content = (data or {}).get(m.name)
            if content is not None:
                m.size = len(content)
            tf.addfile(m, io.BytesIO(content) if content is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = kind
    m.linkname = link
    return m


def _err(r, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    return body["message"]


async def test_stat_mkdir_move_chmod(fake):
    c = fake.http
    sid = await create(c)
    base = f"/v1/sandboxes/{sid}/files"
    assert (await c.put(base, params={"path": "/w/a.txt"}, content=b"hello")).status_code == 204
    st = (await c.get(base + "/stat", params={"path": "/w/a.txt"})).json()
    assert (st["type"], st["size"], st["name"], st["target"]) == ("file", 5, "a.txt", None)
    assert (await c.get(base + "/stat", params={"path": "/w"})).json()["type"] == "dir"
    msg = _err(await c.get(base + "/stat", params={"path": "/w/nope"}), 404, "file_not_found")
    assert "/w/nope" in msg

    r = await c.post(base + "/mkdir", params={"path": "/w/d/e"})
    assert r.status_code == 200 and r.json() == {"path": "/w/d/e", "created": True}
    assert (await c.post(base + "/mkdir", params={"path": "/w/d/e"})).json()["created"] is False
    _err(await c.post(base + "/mkdir", params={"path": "/w/a.txt/x"}), 400, "invalid_path")

    r = await c.post(base + "/move", json={"from": "/w/a.txt", "to": "/w/d/b.txt"})
    assert r.status_code == 200 and r.json()["path"] == "/w/d/b.txt"
    _err(await c.get(base + "/stat", params={"path": "/w/a.txt"}), 404, "file_not_found")
    _err(await c.post(base + "/move", json={"from": "/w/gone", "to": "/w/x"}), 404, "file_not_found")
    _err(await c.post(base + "/move", json={"from": "/w/d", "to": "/w/d/e/f"}), 400, "invalid_path")
    msg = _err(await c.post(base + "/move", json={"from": "/w/d", "too": "/x"}), 400, "invalid_request")
    assert "too" in msg

    r = await c.post(base + "/chmod", json={"path": "/w/d/b.txt", "mode": "750"})
    assert r.status_code == 200 and r.json()["mode"] == 0o750
    assert (await c.post(base + "/chmod", json={"path": "/w/d/b.txt", "mode": 0o600})).json()["mode"] == 0o600
    for bad in ("9", "abc", 70000, -1, True, ""):
        msg = _err(
            await c.post(base + "/chmod", json={"path": "/w/d/b.txt", "mode": bad}), 400, "invalid_request"
        )
        assert "mode" in msg
    _err(await c.post(base + "/chmod", json={"path": "/w/none", "mode": "644"}), 404, "file_not_found")


async def test_relative_paths_and_bad_paths(fake):
    c = fake.http
    sid = await create(c)
    base = f"/v1/sandboxes/{sid}/files"
    for route, method in (("/stat", "GET"), ("/mkdir", "POST"), ("/watch", "GET"), ("/tar", "GET")):
        msg = _err(await c.request(method, base + route), 400, "invalid_path")
        assert "path" in msg
        _err(await c.request(method, base + route, params={"path": "/a/../etc"}), 400, "invalid_path")
    _err(await c.post(base + "/move", json={"from": "/a/../b", "to": "/c"}), 400, "invalid_path")
    _err(
        await c.get("/v1/sandboxes/sb-0000000000000000/files/stat", params={"path": "/x"}),
        404,
        "sandbox_not_found",
    )


async def test_tar_upload_download_and_refusals(roomy):
    c = roomy.http
    sid = await create(c)
    base = f"/v1/sandboxes/{sid}/files"
    good = _tar(
        [
            _member("a.txt"),
            _member("sub/", tarfile.DIRTYPE),
            _member("sub/b.txt"),
            _member("l", tarfile.SYMTYPE, "a.txt"),
        ],
        {"a.txt": b"A", "sub/b.txt": b"BB"},
    )
    r = await c.put(base + "/tar", params={"path": "/up"}, content=good)
    assert r.status_code == 200, r.text
    assert r.json() == {"path": "/up", "files": 2, "dirs": 1, "links": 1, "bytes": 3}
    assert (await c.get(base, params={"path": "/up/sub/b.txt"})).content == b"BB"
    r = await c.get(base + "/tar", params={"path": "/up"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    names = tarfile.open(fileobj=io.BytesIO(r.content)).getnames()
    assert sorted(names) == ["a.txt", "sub/b.txt"]

    evil = {
        "dotdot": [_member("ok.txt"), _member("../escape.txt")],
        "absolute": [_member("ok.txt"), _member("/etc/escape.txt")],
        "symlink out": [_member("ok.txt"), _member("l", tarfile.SYMTYPE, "../../etc")],
        "absolute symlink": [_member("ok.txt"), _member("l", tarfile.SYMTYPE, "/etc")],
        "through a symlink": [
            _member("l", tarfile.SYMTYPE, "."),
            _member("m", tarfile.SYMTYPE, "l/.."),
            _member("m/x"),
        ],
        "hardlink out": [_member("ok.txt"), _member("h", tarfile.LNKTYPE, "../../etc/passwd")],
        "device": [_member("ok.txt"), _member("dev", tarfile.CHRTYPE)],
        "fifo": [_member("ok.txt"), _member("p", tarfile.FIFOTYPE)],
    }
    for what, members in evil.items():
        r = await c.put(
            base + "/tar", params={"path": f"/evil-{what.replace(' ', '-')}"}, content=_tar(members)
        )
        msg = _err(r, 400, "invalid_request")
        assert "nothing was written" in msg, (what, msg)
        st = await c.get(base + "/stat", params={"path": f"/evil-{what.replace(' ', '-')}"})
        assert st.status_code == 404, (what, st.text)  # not even the target directory
    _err(
        await c.put(base + "/tar", params={"path": "/x"}, content=b"not a tar at all" * 100),
        400,
        "invalid_request",
    )
    _err(await c.put(base + "/tar", params={"path": "/up/a.txt"}, content=good), 400, "invalid_path")
    too_big = await c.put(base + "/tar", params={"path": "/big"}, content=b"x" * (2 << 20))
    _err(too_big, 413, "payload_too_large")


async def test_watch_errors_before_the_stream_and_fake_events(fake):
    c = fake.http
    sid = await create(c)
    base = f"/v1/sandboxes/{sid}/files"
    msg = _err(await c.get(base + "/watch", params={"path": "/nope"}), 404, "file_not_found")
    assert "/nope" in msg
    # the fake's watch sees the fake's own changes, in order, after `ready`
    w = fake.worker
    await w.make_dir(sid, "/w")
    async with w.watch_files(sid, "/w", True) as events:
        assert (await anext(events)).type == "ready"
        assert (await c.put(base, params={"path": "/w/x/y.txt"}, content=b"1")).status_code == 204
        await c.post(base + "/move", json={"from": "/w/x/y.txt", "to": "/w/z.txt"})
        ev1, ev2 = await anext(events), await anext(events)
    assert (ev1.type, ev1.path) == ("create", "/w/x/y.txt")
    assert (ev2.type, ev2.path, ev2.from_path) == ("rename", "/w/z.txt", "/w/x/y.txt")
    assert not any(w.__dict__["_fake_watches"][sid])
    try:
        async with w.watch_files(sid, "/w/z.txt", False):
            raise AssertionError("a watch on a file must fail")
    except errors.InvalidPath:
        pass
