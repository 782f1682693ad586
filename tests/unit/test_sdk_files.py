"""The SDK's fuller files API, hermetic (httpx.MockTransport): stat/exists/mkdir/move/chmod requests,
the watch stream (ready line, keep-alive blank lines, events, an in-band error, paths holding U+2028
and other Unicode line breaks, sync and async), the upload tar built
from a local tree (exact names, links, empty dirs, streamed in pieces) and a safe download extract."""

from __future__ import annotations

import io
import json
import os
import tarfile

import httpx
import pytest

import atoll
from atoll import errors
from atoll._client import _async, _sync, _tar
from tests.unit.test_sdk import _public, _shape

URL = "http://atoll.test"
NDJSON = "application/x-ndjson"
SB = {"id": "sb-0123456789abcdef", "state": "running", "template": "base", "metadata": {}}


def _client(handler) -> atoll.Client:
    return atoll.Client(base_url=URL, api_key="k", transport=httpx.MockTransport(handler))


def _sandbox(c: atoll.Client) -> atoll.Sandbox:
    return c.sandboxes.get(SB["id"])


def _route(routes: dict):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == f"/v1/sandboxes/{SB['id']}" and request.method == "GET":
            return httpx.Response(200, json=SB)
        key = (request.method, request.url.path.rsplit("/files", 1)[-1])
        answer = routes[key]
        return answer(request) if callable(answer) else answer

    return handler, seen


STAT = {
    "name": "a",
    "path": "/w/a",
    "name_b64": "YQ==",
    "path_b64": "L3cvYQ==",
    "type": "symlink",
    "size": 1,
    "mode": 0o777,
    "mtime": 1.5,
    "target": "b",
}


def test_watch_surfaces_match():
    sync_members, async_members = _public(_sync.Watch), _public(_async.AsyncWatch)
    rename = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__", "__aiter__": "__iter__"}
    rename["__anext__"] = "__next__"
    assert {rename.get(n, n) for n in async_members} == set(sync_members)
    for name, member in async_members.items():
        if callable(member):
            assert _shape(sync_members[rename.get(name, name)]) == _shape(member), name


def test_stat_exists_mkdir_move_chmod_requests():
    missing = httpx.Response(
        404, json={"error": {"code": "file_not_found", "message": "path '/x' does not exist"}}
    )
    calls = {"n": 0}

    def stat(request):
        calls["n"] += 1
        return httpx.Response(200, json=STAT) if request.url.params["path"] == "/w/a" else missing

    handler, seen = _route(
        {
            ("GET", "/stat"): stat,
            ("POST", "/mkdir"): httpx.Response(200, json={"path": "/w/d", "created": False}),
            ("POST", "/move"): httpx.Response(200, json={**STAT, "type": "file", "target": None}),
            ("POST", "/chmod"): httpx.Response(200, json={**STAT, "type": "file", "mode": 0o750}),
        }
    )
    with _client(handler) as c:
        f = _sandbox(c).files
        st = f.stat("/w/a")
        assert (st.type, st.target, st.is_symlink, st.mode, st.raw_path) == (
            "symlink",
            "b",
            True,
            0o777,
            b"/w/a",
        )
        assert f.exists("/w/a") is True and f.exists("/x") is False
        with pytest.raises(errors.FileNotFound):
            f.stat("/x")
        assert f.mkdir("/w/d") is False
        assert f.move("/w/a", "/w/b").is_file
        assert f.chmod("/w/b", "750").mode == 0o750
    bodies = [json.loads(r.content) for r in seen if r.method == "POST" and r.content]
    assert {"from": "/w/a", "to": "/w/b"} in bodies and {"path": "/w/b", "mode": "750"} in bodies
    stat_bytes = [r for r in seen if r.url.path.endswith("/stat")]
    assert all("path" in r.url.params for r in stat_bytes)


def test_watch_iterates_events_skips_keepalives_and_raises_in_band_errors():
    lines = [
        {"type": "ready", "path": "/w", "is_dir": True},
        None,
        {"type": "create", "path": "/w/a", "is_dir": False},
        {"type": "rename", "path": "/w/b", "from": "/w/a", "is_dir": False},
        {"error": {"code": "sandbox_failed", "message": "sandbox died"}},
    ]
    body = b"".join(b"\n" if x is None else json.dumps(x).encode() + b"\n" for x in lines)
    handler, seen = _route(
        {
            ("GET", "/watch"): httpx.Response(
                200, content=body, headers={"content-type": "application/x-ndjson"}
            )
        }
    )
    with _client(handler) as c:
        w = _sandbox(c).files.watch("/w", recursive=False)
        assert seen[-1].url.params["recursive"] == "false"
        with w:
            first, second = next(w), next(w)
            assert (first.type, first.path, first.from_path) == ("create", "/w/a", None)
            assert (second.type, second.from_path) == ("rename", "/w/a")
            with pytest.raises(errors.SandboxFailed):
                next(w)
        assert w.closed
        assert list(w) == []


# Raw in JSON strings (atoll writes UTF-8, not \u escapes), yet line breaks to httpx's LineDecoder
# and str.splitlines: a watch that split there would cut the event in two.
ODD_PATH = "/w/a\u2028b\u0085c\u2029d"
ODD_EVENTS = [
    {"type": "ready", "path": "/w", "is_dir": True},
    {"type": "create", "path": ODD_PATH, "is_dir": False},
    {"type": "rename", "path": "/w/e", "from": ODD_PATH, "is_dir": False},
]
ODD_BODY = b"".join(json.dumps(x, ensure_ascii=False).encode() + b"\n" for x in ODD_EVENTS)


def _odd_watch_transport(chunks) -> httpx.MockTransport:
    """The watch route answering ODD_BODY in 3-byte chunks (lines and characters cut anywhere)."""
    handler, _ = _route(
        {
            ("GET", "/watch"): lambda _r: httpx.Response(
                200, content=chunks(), headers={"content-type": NDJSON}
            )
        }
    )
    return httpx.MockTransport(handler)


def test_watch_keeps_an_event_whose_path_holds_unicode_line_breaks():
    def chunks():
        for i in range(0, len(ODD_BODY), 3):
            yield ODD_BODY[i : i + 3]

    with atoll.Client(base_url=URL, api_key="k", transport=_odd_watch_transport(chunks)) as c:
        with _sandbox(c).files.watch("/w") as w:
            got = [(e.type, e.path, e.from_path) for e in w]
    assert got == [("create", ODD_PATH, None), ("rename", "/w/e", ODD_PATH)]


async def test_async_watch_keeps_an_event_whose_path_holds_unicode_line_breaks():
    async def chunks():
        for i in range(0, len(ODD_BODY), 3):
            yield ODD_BODY[i : i + 3]

    async with atoll.AsyncClient(base_url=URL, api_key="k", transport=_odd_watch_transport(chunks)) as c:
        sandbox = await c.sandboxes.get(SB["id"])
        async with await sandbox.files.watch("/w") as w:
            got = [(e.type, e.path, e.from_path) async for e in w]
    assert got == [("create", ODD_PATH, None), ("rename", "/w/e", ODD_PATH)]


def test_watch_errors_before_the_stream():
    missing = httpx.Response(
        404, json={"error": {"code": "file_not_found", "message": "directory '/n' does not exist"}}
    )
    handler, _ = _route({("GET", "/watch"): missing})
    with _client(handler) as c, pytest.raises(errors.FileNotFound, match="/n"):
        _sandbox(c).files.watch("/n")


def _tree(root: bytes) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isdir(full):
                out[rel] = ("dir",)
            elif os.path.isfile(full):
                with open(full, "rb") as fh:
                    out[rel] = ("file", fh.read())
    return out


def test_tar_chunks_streams_a_tree_with_exact_names(tmp_path):
    src = os.fsencode(tmp_path / "src")
    os.makedirs(os.path.join(src, b"a/b"))
    os.makedirs(os.path.join(src, b"empty"))
    big = os.urandom(700_000)
    with open(os.path.join(src, b"a/b/big.bin"), "wb") as fh:
        fh.write(big)
    with open(os.path.join(src, b"caf\xe9"), "wb") as fh:
        fh.write(b"latin-1 name")
    os.symlink(b"a/b/big.bin", os.path.join(src, b"link"))
    os.link(os.path.join(src, b"caf\xe9"), os.path.join(src, b"hard"))
    os.mkfifo(os.path.join(src, b"fifo"))  # skipped: the server refuses special files
    pieces = list(_tar.tar_chunks(os.fsdecode(src)))
    assert max(len(p) for p in pieces) <= _tar.CHUNK, "a big file goes in pieces, never whole"
    blob = b"".join(pieces)
    assert len(blob) % tarfile.BLOCKSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(blob), encoding="utf-8", errors="surrogateescape") as tf:
        names = {os.fsencode(m.name) for m in tf}
        assert b"fifo" not in names and b"caf\xe9" in names
    dst = tmp_path / "dst"
    assert _tar.extract(io.BytesIO(blob), dst) == len(names)
    expected = {k: v for k, v in _tree(src).items() if k != b"fifo"}
    assert _tree(os.fsencode(dst)) == expected


def test_extract_refuses_what_points_outside(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    buf.seek(0)
    with pytest.raises(errors.InvalidRequest) as e:
        _tar.extract(buf, tmp_path / "dst")
    assert e.value.code == "unsafe_member" and "outside" in e.value.message
    assert not (tmp_path / "escape").exists()


def test_extract_keeps_absolute_symlinks_but_writes_nothing_through_them(tmp_path):
    def tar(*members) -> io.BytesIO:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for name, link, data in members:
                info = tarfile.TarInfo(name)
                if link is not None:
                    info.type, info.linkname = tarfile.SYMTYPE, link
                    tf.addfile(info)
                else:
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        buf.seek(0)
        return buf

    # a venv: bin/python3 -> /usr/bin/python3 (the case download_dir refused)
    assert (
        _tar.extract(
            tar(("venv/bin/python3", "/usr/bin/python3", None), ("a.txt", None, b"a")), tmp_path / "d"
        )
        == 2
    )
    assert os.readlink(tmp_path / "d/venv/bin/python3") == "/usr/bin/python3"
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(errors.InvalidRequest):
        _tar.extract(tar(("l", str(outside), None), ("l/x", None, b"x")), tmp_path / "e")
    assert not (outside / "x").exists()


def test_upload_dir_sends_one_tar(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("x")
    got: dict = {}

    def put(request):
        got["params"] = dict(request.url.params)
        got["body"] = request.read()
        return httpx.Response(200, json={"path": "/r", "files": 1, "dirs": 0, "links": 0, "bytes": 1})

    handler, _ = _route({("PUT", "/tar"): put})
    with _client(handler) as c:
        assert _sandbox(c).files.upload_dir(tmp_path / "d", "/r")["files"] == 1
    assert got["params"] == {"path": "/r"}
    with tarfile.open(fileobj=io.BytesIO(got["body"])) as tf:
        assert tf.getnames() == ["x.txt"]
