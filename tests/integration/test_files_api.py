"""The fuller files API (issue 9) on real gVisor sandboxes: stat/exists/mkdir/move/chmod, watch
(inotify inside gVisor) seeing what a command writes, a held watch as activity, directory tar round
trips through the SDK (hostile tars, refused whole with nothing written: tests/security/test_sandbox_boundary.py,
which uses this module's tar helpers)."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import tarfile
import threading
import time

import httpx
import pytest

import atoll
from atoll import errors
from tests.integration.conftest import run

pytestmark = pytest.mark.integration


@pytest.fixture
def sdk(atoll_server):
    with atoll.Client(base_url=atoll_server.url, api_key=atoll_server.api_key, request_timeout=120) as c:
        yield c


def _err(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    return body["message"]


def test_stat_mkdir_move_chmod(api, sdk, sandbox):
    sid = sandbox["id"]
    sb = sdk.sandboxes.get(sid)
    f = sb.files
    run(
        api,
        sid,
        "mkdir -p /w && printf hello > /w/a.txt && ln -s a.txt /w/link && ln -s /nowhere /w/dangling",
    )
    st = f.stat("/w/a.txt")
    assert (st.type, st.size, st.name, st.target, st.is_file) == ("file", 5, "a.txt", None, True)
    assert st.mode == 0o644 and st.mtime > 0
    link = f.stat("/w/link")
    assert (link.type, link.target) == ("symlink", "a.txt")
    assert f.stat("/w").is_dir
    assert f.exists("/w/dangling") and f.exists("/w/a.txt") and not f.exists("/w/none")
    with pytest.raises(errors.FileNotFound) as e:
        f.stat("/w/none")
    assert "/w/none" in str(e.value)

    assert f.mkdir("/w/d/e/f") is True
    assert f.mkdir("/w/d/e/f") is False
    assert run(api, sid, "test -d /w/d/e/f && echo ok")["stdout"] == "ok\n"
    msg = _err(api.post(f"/v1/sandboxes/{sid}/files/mkdir", params={"path": "/w/a.txt"}), 400, "invalid_path")
    assert "in the way" in msg

    moved = f.move("/w/a.txt", "/w/new/dir/b.txt")  # parents of the destination are created
    assert moved.path == "/w/new/dir/b.txt" and moved.size == 5
    assert run(api, sid, "cat /w/new/dir/b.txt; test -e /w/a.txt || echo gone")["stdout"] == "hellogone\n"
    f.move("/w/d", "/w/d2")  # a directory, with what is in it
    assert run(api, sid, "test -d /w/d2/e/f && echo ok")["stdout"] == "ok\n"
    _err(
        api.post(f"/v1/sandboxes/{sid}/files/move", json={"from": "/w/x", "to": "/w/y"}),
        404,
        "file_not_found",
    )
    msg = _err(
        api.post(f"/v1/sandboxes/{sid}/files/move", json={"from": "/w/d2", "to": "/w/d2/e/inside"}),
        400,
        "invalid_path",
    )
    assert "into itself" in msg
    run(api, sid, "mkdir -p /w/full && touch /w/full/x")
    _err(
        api.post(f"/v1/sandboxes/{sid}/files/move", json={"from": "/w/d2", "to": "/w/full"}),
        400,
        "invalid_path",
    )

    assert f.chmod("/w/new/dir/b.txt", "750").mode == 0o750
    assert f.chmod("/w/new/dir/b.txt", 0o600).mode == 0o600
    assert run(api, sid, "stat -c %a /w/new/dir/b.txt")["stdout"] == "600\n"
    for bad in ("8", "rwx", 99999):
        msg = _err(
            api.post(f"/v1/sandboxes/{sid}/files/chmod", json={"path": "/w/new/dir/b.txt", "mode": bad}),
            400,
            "invalid_request",
        )
        assert "mode" in msg
    _err(
        api.post(f"/v1/sandboxes/{sid}/files/chmod", json={"path": "/w/no", "mode": "644"}),
        404,
        "file_not_found",
    )


def test_a_file_read_is_over_once_its_answer_is(api, atoll_server):
    """A read whose whole answer has arrived no longer counts as a call in progress: a pause sent
    right after it on another connection (a second client, a pool, another thread) is not refused
    as sandbox_busy. (The read used to release the sandbox only after its last byte was sent: with a
    64 MB sandbox ~1 pause in 4 fell into that window, with a 512 MB one hardly any.)"""
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 64})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        for name, content in (("r.txt", b"hello"), ("empty", b"")):  # an empty one: headers only
            r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": f"/tmp/{name}"}, content=content)
            assert r.status_code in (200, 201, 204), r.text
        with httpx.Client(base_url=atoll_server.url, headers=atoll_server.headers(), timeout=120) as other:
            for i in range(60):
                name, content = ("r.txt", b"hello") if i % 2 else ("empty", b"")
                r = api.get(f"/v1/sandboxes/{sid}/files", params={"path": f"/tmp/{name}"})
                assert (r.status_code, r.content) == (200, content), r.text
                p = other.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
                assert p.status_code == 200, p.text
                assert other.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_relative_paths_resolve_against_the_working_directory(api, sandbox):
    sid = sandbox["id"]
    wd = run(api, sid, "pwd")["stdout"].strip()
    r = api.post(f"/v1/sandboxes/{sid}/files/mkdir", params={"path": "rel/dir"})
    assert r.status_code == 200, r.text
    assert r.json()["path"] == f"{wd.rstrip('/')}/rel/dir"
    assert api.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "rel/dir"}).json()["type"] == "dir"
    # a file written by a relative path is where a command without cwd finds it
    assert api.put(
        f"/v1/sandboxes/{sid}/files", params={"path": "rel/dir/n.txt"}, content=b"42"
    ).status_code in (200, 201, 204)
    assert run(api, sid, "cat rel/dir/n.txt")["stdout"] == "42"
    assert run(api, sid, "rm -r rel")["exit_code"] == 0


class _Events:
    """The events of an open SDK watch, read on a thread of their own so that the test waits for
    them with a deadline: iterating a quiet watch blocks until its next event (the SDK skips the
    keep-alive lines), so a missed event would otherwise hang the test past any deadline (until
    pytest-timeout's 300 s). The thread ends when the stream does (closed, or the sandbox deleted)."""

    def __init__(self, watch):
        self.seen: list = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(watch,), daemon=True).start()

    def _read(self, watch) -> None:
        try:
            for ev in watch:
                self._queue.put(ev)
        except Exception as e:  # closed under the reader, or broken: `until` reports it
            self._queue.put(e)

    def until(self, done, seconds: float = 20) -> list:
        """Every event read so far once `done(events)` is true; fails after `seconds` otherwise."""
        deadline = time.monotonic() + seconds
        while not done(self.seen):
            try:
                ev = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(
                    f"the watch did not report what was expected in {seconds} s; it reported {self.seen}"
                )
            if isinstance(ev, Exception):
                pytest.fail(f"the watch stream ended ({ev!r}) after {self.seen}")
            self.seen.append(ev)
        return self.seen


def _has(want: set):
    return lambda events: want <= {(e.type, e.path) for e in events}


@pytest.mark.seam
def test_watch_sees_what_a_command_writes(api, sdk, sandbox):
    sid = sandbox["id"]
    sb = sdk.sandboxes.get(sid)
    run(api, sid, "mkdir -p /watched")
    with pytest.raises(errors.FileNotFound):
        sb.files.watch("/not-there")
    _err(api.get(f"/v1/sandboxes/{sid}/files/watch", params={"path": "/not-there"}), 404, "file_not_found")

    with sb.files.watch("/watched", recursive=True) as w:
        events = _Events(w)
        run(api, sid, "echo hi > /watched/one.txt; mkdir -p /watched/a/b; echo x > /watched/a/b/deep.txt")
        # deep.txt is reported once /watched/a and /watched/a/b are watched too (by their own
        # watches, or by the look into a directory newly watched): only then is a move into
        # /watched/a one rename, since inotify pairs a move's halves across two watches; a move made
        # before the agent has read the mkdir is a delete and a create, which is what a loaded CI
        # run saw (as tests/unit/test_agent_fileops.py::test_watch_events_and_cleanup waits too)
        events.until(
            _has(
                {
                    ("create", "/watched/one.txt"),
                    ("modify", "/watched/one.txt"),
                    ("create", "/watched/a/b/deep.txt"),
                }
            )
        )
        run(
            api, sid, "mv /watched/one.txt /watched/a/two.txt; chmod 700 /watched/a; rm /watched/a/b/deep.txt"
        )
        seen = events.until(
            _has(
                {
                    ("rename", "/watched/a/two.txt"),
                    ("chmod", "/watched/a"),
                    ("delete", "/watched/a/b/deep.txt"),
                }
            )
        )
    rename = next(e for e in seen if e.type == "rename")
    assert rename.from_path == "/watched/one.txt"
    assert w.closed

    # not recursive: a change in a subdirectory is not reported, one at the top is
    with sb.files.watch("/watched", recursive=False) as w:
        run(api, sid, "echo 1 > /watched/a/b/inner.txt; echo 2 > /watched/top.txt")
        first = _Events(w).until(lambda events: len(events) >= 1)
    assert (first[0].type, first[0].path) == ("create", "/watched/top.txt")


@pytest.mark.seam
def test_watch_ends_inside_the_sandbox_when_the_client_leaves(api, atoll_server, sandbox):
    """Ten watches opened and dropped without reading to the end: the agent still answers, and a
    new watch still works (leaked inotify instances or threads would pile up and fail it)."""
    sid = sandbox["id"]
    run(api, sid, "mkdir -p /w2")
    for _ in range(10):
        with httpx.Client(base_url=atoll_server.url, headers=atoll_server.headers(), timeout=30) as c:
            with c.stream("GET", f"/v1/sandboxes/{sid}/files/watch", params={"path": "/w2"}) as r:
                assert r.status_code == 200
                first = next(r.iter_lines())
                assert json.loads(first)["type"] == "ready"
    lines: list = []

    def watch():
        with httpx.Client(base_url=atoll_server.url, headers=atoll_server.headers(), timeout=30) as c:
            with c.stream("GET", f"/v1/sandboxes/{sid}/files/watch", params={"path": "/w2"}) as r:
                for line in r.iter_lines():
                    if line.strip():
                        lines.append(json.loads(line))
                    if len(lines) >= 2:
                        return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    run(api, sid, "touch /w2/after")
    t.join(20)
    assert [(e["type"], e["path"]) for e in lines] == [("ready", "/w2"), ("create", "/w2/after")]


@pytest.mark.seam
def test_an_open_watch_is_activity(api, sdk):
    sid = api.post("/v1/sandboxes", json={"idle_timeout_s": 1, "disk_after_s": 0}).json()["id"]
    try:
        sb = sdk.sandboxes.get(sid)
        run(api, sid, "mkdir -p /held")
        with sb.files.watch("/held"):
            time.sleep(4)  # four idle timeouts
            assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        deadline = time.monotonic() + 30
        while api.get(f"/v1/sandboxes/{sid}").json()["state"] != "standby" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "standby", "closed watch must let it idle"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def _tree(root: str) -> dict:
    """Every path under `root` (as bytes) -> what it is: file content, dir, or symlink target."""
    out = {}
    broot = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(broot):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, broot)
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isdir(full):
                out[rel] = ("dir",)
            else:
                with open(full, "rb") as fh:
                    out[rel] = ("file", fh.read(), os.stat(full).st_mode & 0o777)
    return out


@pytest.mark.seam
def test_tar_round_trip_of_a_tree(api, sdk, sandbox, tmp_path):
    sid = sandbox["id"]
    sb = sdk.sandboxes.get(sid)
    src = tmp_path / "src"
    (src / "a" / "b" / "c").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "top.txt").write_bytes(b"top\n")
    (src / "a" / "b" / "c" / "deep.bin").write_bytes(bytes(range(256)) * 40)
    (src / "a" / "exe.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "a" / "exe.sh", 0o755)
    os.symlink("b/c/deep.bin", src / "a" / "link")
    os.symlink("../top.txt", src / "a" / "up-link")
    with open(os.path.join(os.fsencode(src), b"caf\xe9-latin1.txt"), "wb") as fh:
        fh.write(b"not utf-8 name")
    os.link(src / "top.txt", src / "hard.txt")

    written = sb.files.upload_dir(src, "/up/tree")
    assert (written["files"], written["dirs"], written["links"]) == (4, 4, 3), written
    out = run(api, sid, "cd /up/tree && find . | LC_ALL=C sort && readlink a/link && sh a/exe.sh && ls empty")
    assert out["exit_code"] == 0, out
    listing = out["stdout"].splitlines()
    for p in ("./a/b/c/deep.bin", "./empty", "./a/link", "./a/up-link", "./hard.txt"):
        assert p in listing, listing
    assert "b/c/deep.bin" in listing and "hi" in listing
    raw = sb.files.list("/up/tree")
    assert any(e.raw_path == b"/up/tree/caf\xe9-latin1.txt" for e in raw)

    dst = tmp_path / "dst"
    n = sb.files.download_dir("/up/tree", dst)
    assert n >= 10
    assert _tree(str(dst)) == _tree(str(src))
    _err(api.get(f"/v1/sandboxes/{sid}/files/tar", params={"path": "/up/none"}), 404, "file_not_found")
    _err(api.get(f"/v1/sandboxes/{sid}/files/tar", params={"path": "/up/tree/top.txt"}), 400, "invalid_path")


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tf:
        for m, data in members:
            if data is not None:
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    return m


@pytest.mark.seam
def test_tar_upload_into_an_existing_tree_and_bad_bodies(api, sandbox):
    sid = sandbox["id"]
    run(api, sid, "mkdir -p /ex/keep && echo old > /ex/keep/old.txt && ln -s /etc /ex/etc-link")
    body = _tar([(_m("keep/new.txt"), b"new"), (_m("fresh/", tarfile.DIRTYPE), None)])
    r = api.put(f"/v1/sandboxes/{sid}/files/tar", params={"path": "/ex"}, content=body)
    assert r.status_code == 200 and r.json()["files"] == 1, r.text
    assert run(api, sid, "cat /ex/keep/old.txt /ex/keep/new.txt")["stdout"] == "old\nnew"
    # a symlink already in the target that leads out is not followed either
    r = api.put(
        f"/v1/sandboxes/{sid}/files/tar", params={"path": "/ex"}, content=_tar([(_m("etc-link/x"), b"x")])
    )
    _err(r, 400, "invalid_request")
    assert run(api, sid, "test -e /etc/x || echo clean")["stdout"] == "clean\n"
    _err(
        api.put(f"/v1/sandboxes/{sid}/files/tar", params={"path": "/ex"}, content=b"garbage" * 300),
        400,
        "invalid_request",
    )
    _err(
        api.put(f"/v1/sandboxes/{sid}/files/tar", params={"path": "/ex/keep/old.txt"}, content=body),
        400,
        "invalid_path",
    )
    _err(api.put(f"/v1/sandboxes/{sid}/files/tar", content=body), 400, "invalid_path")


def _cli(atoll_server, *args: str):
    import subprocess
    import sys

    env = {**os.environ, "ATOLL_URL": atoll_server.url, "ATOLL_API_KEY": atoll_server.api_key}
    atoll_bin = os.path.join(os.path.dirname(sys.executable), "atoll")  # the venv's console script
    return subprocess.run([atoll_bin, *args], env=env, capture_output=True, text=True, timeout=120)


def test_cli_upload_and_download(atoll_server, sandbox, tmp_path):
    sid = sandbox["id"]
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "README").write_text("hi\n")
    r = _cli(atoll_server, "sandbox", "upload", sid, str(src), "/proj")
    assert r.returncode == 0, r.stderr
    assert "2 files" in r.stdout
    r = _cli(atoll_server, "sandbox", "download", sid, "/proj", str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "back" / "pkg" / "mod.py").read_text() == "X = 1\n"
    r = _cli(atoll_server, "sandbox", "upload", sid, str(src / "README"), "/single/README")
    assert r.returncode == 0, r.stderr
    (tmp_path / "one").mkdir()
    r = _cli(atoll_server, "sandbox", "download", sid, "/single/README", str(tmp_path / "one"))
    assert r.returncode == 0 and (tmp_path / "one" / "README").read_text() == "hi\n", r.stderr
    r = _cli(atoll_server, "sandbox", "download", sid, "/nope", str(tmp_path / "x"))
    assert r.returncode == 1 and "file_not_found" in r.stderr and "Traceback" not in r.stderr
    r = _cli(atoll_server, "sandbox", "upload", sid, str(tmp_path / "missing"), "/x")
    assert r.returncode == 2 and "does not exist" in _unboxed(r.stderr), r.stderr


def _unboxed(text: str) -> str:
    """Text rich printed inside its error box, as one line: the box's frame gone and the lines it
    wrapped (at the terminal's width, around a long path) joined again."""
    return " ".join(re.sub("[\u2500-\u257f]", " ", text).split())
