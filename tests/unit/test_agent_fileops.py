"""The guest agent's fuller files API on the host: tar validation (`tarball.plan`) against crafted
tars, and the agent run natively (as in test_guest_agent) for stat/mkdir/move/chmod, tar upload and
download, and inotify watches — including that a dropped watch closes its inotify fd."""

from __future__ import annotations

import io
import json
import os
import socket
import tarfile
import threading
import time
import urllib.parse

import httpx
import pytest

from atoll.guest.agent import tarball
from tests.unit.test_guest_agent import _start_agent


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    return m


def _tar(members, gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tf:
        for m, data in members:
            if data is not None:
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _plan(blob: bytes, root):
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:*") as tf:
        return tarball.plan(tf, root)


REFUSED = {
    "dotdot": ([(_m("../x"), b"x")], "'..'"),
    "nested dotdot": ([(_m("a/b/../../../x"), b"x")], "'..'"),
    "absolute": ([(_m("/etc/x"), b"x")], "absolute"),
    "absolute symlink": ([(_m("l", tarfile.SYMTYPE, "/etc"), None)], "absolute"),
    "symlink up": ([(_m("a/l", tarfile.SYMTYPE, "../../x"), None)], "outside"),
    "write through link": ([(_m("l", tarfile.SYMTYPE, ".."), None), (_m("l/x"), b"x")], "outside"),
    "chain": (
        [(_m("l", tarfile.SYMTYPE, "."), None), (_m("m", tarfile.SYMTYPE, "l/.."), None)],
        "outside",
    ),
    "hardlink to outside": ([(_m("h", tarfile.LNKTYPE, "../etc/passwd"), None)], "'..'"),
    "hardlink to nothing earlier": (
        [(_m("h", tarfile.LNKTYPE, "later"), None), (_m("later"), b"1")],
        "earlier",
    ),
    "hardlink to a symlink": (
        [(_m("s", tarfile.SYMTYPE, "x"), None), (_m("h", tarfile.LNKTYPE, "s"), None)],
        "earlier",
    ),
    "file then below it": ([(_m("f"), b"1"), (_m("f/x"), b"2")], "which is a file"),
    "file then a directory of that name": ([(_m("dd"), b"1"), (_m("dd", tarfile.DIRTYPE), None)], "both"),
    "directory then a file of that name": ([(_m("ee", tarfile.DIRTYPE), None), (_m("ee"), b"1")], "both"),
    "char device": ([(_m("d", tarfile.CHRTYPE), None)], "device"),
    "block device": ([(_m("d", tarfile.BLKTYPE), None)], "device"),
    "fifo": ([(_m("p", tarfile.FIFOTYPE), None)], "fifo"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_plan_refuses(name, tmp_path):
    members, why = REFUSED[name]
    with pytest.raises(tarball.Refused) as e:
        _plan(_tar([(_m("fine.txt"), b"ok"), *members]), str(tmp_path))
    assert why in str(e.value)


def test_plan_accepts_links_that_stay_inside(tmp_path):
    members = [
        (_m("./d/", tarfile.DIRTYPE), None),
        (_m("d/f"), b"1"),
        (_m("d/l", tarfile.SYMTYPE, "f"), None),
        (_m("d/up", tarfile.SYMTYPE, "../d/f"), None),
        (_m("top", tarfile.SYMTYPE, "d"), None),
        (_m("top/through.txt"), b"2"),  # written through a link that stays inside
        (_m("h", tarfile.LNKTYPE, "d/f"), None),
    ]
    planned = _plan(_tar(members), str(tmp_path))
    assert [rel for rel, _ in planned] == ["d", "d/f", "d/l", "d/up", "top", "top/through.txt", "h"]


def test_plan_follows_links_already_on_disk(tmp_path):
    os.symlink("/etc", tmp_path / "etc")
    os.symlink("inside", tmp_path / "ok")
    (tmp_path / "inside").mkdir()
    with pytest.raises(tarball.Refused):
        _plan(_tar([(_m("etc/passwd"), b"x")]), str(tmp_path))
    assert _plan(_tar([(_m("ok/x"), b"x")]), str(tmp_path))
    (tmp_path / "dir").mkdir()
    with pytest.raises(tarball.Refused, match="directory of that name exists"):
        _plan(_tar([(_m("dir"), b"x")]), str(tmp_path))


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    running = _start_agent(tmp_path_factory.mktemp("agent-fileops"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def client(agent):
    with httpx.Client(base_url=agent.url, timeout=30) as c:
        yield c


def test_stat_mkdir_move_chmod(client, tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    os.symlink("f", tmp_path / "l")
    st = client.get("/files/stat", params={"path": str(tmp_path / "l")}).json()
    assert (st["type"], st["target"], st["name"]) == ("symlink", "f", "l")
    raw = os.path.join(os.fsencode(tmp_path), b"n\xff")
    open(raw, "wb").close()
    st = client.get("/files/stat?path=" + urllib.parse.quote_from_bytes(raw)).json()
    assert st["path_b64"] and st["name"] == "n\ufffd"
    r = client.get("/files/stat", params={"path": str(tmp_path / "none")})
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
    assert client.post("/files/mkdir", params={"path": str(tmp_path / "a/b")}).json()["created"] is True
    r = client.post("/files/mkdir", params={"path": str(tmp_path / "f/x")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path"
    r = client.post("/files/move", params={"from": str(tmp_path / "f"), "to": str(tmp_path / "n/e/w")})
    assert r.status_code == 200 and (tmp_path / "n/e/w").read_bytes() == b"abc"
    r = client.post("/files/move", params={"from": str(tmp_path / "a"), "to": str(tmp_path / "a/b/c")})
    assert r.status_code == 400 and "into itself" in r.json()["error"]["message"]
    r = client.post("/files/chmod", params={"path": str(tmp_path / "n/e/w"), "mode": "711"})
    assert r.json()["mode"] == 0o711 and (os.stat(tmp_path / "n/e/w").st_mode & 0o777) == 0o711
    r = client.post("/files/chmod", params={"path": str(tmp_path / "n/e/w"), "mode": "99"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]


def test_tar_upload_refused_writes_nothing_and_keeps_the_connection(client, tmp_path):
    target = tmp_path / "t"
    body = _tar([(_m("a.txt"), b"a"), (_m("b/../../x"), b"x")], gz=True)
    r = client.put("/files/tar", params={"path": str(target)}, content=body)
    assert r.status_code == 400 and "nothing was written" in r.json()["error"]["message"]
    assert not target.exists() and not (tmp_path / "x").exists()
    good = _tar(
        [
            (_m("a.txt"), b"a"),
            (_m("sub/", tarfile.DIRTYPE), None),
            (_m("sub/b"), b"bb"),
            (_m("s", tarfile.SYMTYPE, "a.txt"), None),
        ]
    )
    r = client.put("/files/tar", params={"path": str(target)}, content=good)
    assert r.status_code == 200, r.text
    assert r.json() == {"path": str(target), "files": 2, "dirs": 1, "links": 1, "bytes": 3}
    assert os.readlink(target / "s") == "a.txt" and (target / "sub/b").read_bytes() == b"bb"
    assert not [n for n in os.listdir("/tmp") if n.startswith(".atoll-tar-")], "the spool is unlinked"


def test_tar_member_against_another_kind_on_disk_writes_nothing(client, tmp_path):
    target = tmp_path / "k"
    (target / "isdir").mkdir(parents=True)
    (target / "isfile").write_bytes(b"keep")
    for members in (
        [(_m("new.txt"), b"n"), (_m("isdir"), b"x")],
        [(_m("new.txt"), b"n"), (_m("isfile", tarfile.DIRTYPE), None)],
        [(_m("new.txt"), b"n"), (_m("dd"), b"1"), (_m("dd", tarfile.DIRTYPE), None)],
    ):
        r = client.put("/files/tar", params={"path": str(target)}, content=_tar(members))
        assert r.status_code == 400, r.text
        assert not (target / "new.txt").exists() and not (target / "dd").exists()
    assert (target / "isfile").read_bytes() == b"keep" and (target / "isdir").is_dir()


def test_tar_download_streams_the_tree(client, tmp_path):
    (tmp_path / "d/e").mkdir(parents=True)
    (tmp_path / "d/empty").mkdir()
    (tmp_path / "d/e/f").write_bytes(b"x" * 300_000)
    os.symlink("e/f", tmp_path / "d/l")
    open(os.path.join(os.fsencode(tmp_path), b"d/\xe9"), "wb").close()
    with client.stream("GET", "/files/tar", params={"path": str(tmp_path / "d")}) as r:
        assert r.headers["transfer-encoding"] == "chunked"
        blob = r.read()
    with tarfile.open(fileobj=io.BytesIO(blob), encoding="utf-8", errors="surrogateescape") as tf:
        members = {m.name: m for m in tf}
        assert os.fsencode("\udce9") in {os.fsencode(n) for n in members}
        assert members["l"].issym() and members["l"].linkname == "e/f"
        assert members["empty"].isdir() and tf.extractfile("e/f").read() == b"x" * 300_000
    r = client.get("/files/tar", params={"path": str(tmp_path / "nope")})
    assert r.status_code == 404


def test_tar_download_leaves_out_sockets_and_other_mounts(client, tmp_path):
    import socket as socket_mod

    (tmp_path / "t/sub").mkdir(parents=True)
    (tmp_path / "t/sub/a").write_bytes(b"a")
    os.link(tmp_path / "t/sub/a", tmp_path / "t/hard")
    s = socket_mod.socket(socket_mod.AF_UNIX)
    s.bind(str(tmp_path / "t/sock"))  # tarfile cannot hold a socket: it used to cut the stream
    try:
        blob = client.get("/files/tar", params={"path": str(tmp_path / "t")}).content
    finally:
        s.close()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        members = {m.name: m for m in tf}
        assert set(members) == {"hard", "sub", "sub/a"}, set(members)
        regular = next(m for m in members.values() if m.isreg())
        assert tf.extractfile(regular).read() == b"a"


def _inotify_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += "inotify" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


def _wait(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_watch_events_and_cleanup(agent, tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    events: list = []
    ready = threading.Event()

    def watch():
        with httpx.Client(base_url=agent.url, timeout=30) as c:
            with c.stream("GET", "/files/watch", params={"path": str(root), "recursive": "1"}) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(json.loads(line))
                        ready.set()
                    if any(e["type"] == "delete" and e["path"] == str(root) for e in events):
                        return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert ready.wait(10) and events[0]["type"] == "ready"
    assert _inotify_fds(agent.pid) == 1
    (root / "x.txt").write_text("1")
    os.makedirs(root / "p/q/r")
    (root / "p/q/r/deep").write_text("2")
    # the watches of new directories are added as their create events are read: a change made
    # before that is reported by the scan of the directory instead (tested in the next steps)
    assert _wait(lambda: any(e["path"] == str(root / "p/q/r/deep") for e in events))
    os.rename(root / "x.txt", root / "p/y.txt")
    os.rename(root / "p", root / "p2")
    (root / "p2/q/after").write_text("3")  # the watch of the renamed subtree follows the new name
    assert _wait(lambda: any(e["path"] == str(root / "p2/q/after") for e in events))
    for name in ("p2/q/after", "p2/q/r/deep", "p2/y.txt"):
        os.unlink(root / name)
    for d in ("p2/q/r", "p2/q", "p2"):
        os.rmdir(root / d)
    os.rmdir(root)  # the watched directory goes: a delete of it, and the stream ends
    t.join(10)
    assert not t.is_alive()
    pairs = [(e["type"], e["path"]) for e in events]
    assert ("create", str(root / "x.txt")) in pairs and ("modify", str(root / "x.txt")) in pairs
    # created before or after the move (the watch of a new directory reports what it finds in it)
    assert {("create", str(root / d / "q/r/deep")) for d in ("p", "p2")} & set(pairs), pairs
    rename = [e for e in events if e["type"] == "rename"]
    assert {"path": str(root / "p/y.txt"), "from": str(root / "x.txt")}.items() <= rename[0].items()
    assert pairs[-1] == ("delete", str(root))
    assert _wait(lambda: _inotify_fds(agent.pid) == 0), "the inotify fd must be closed"


def test_dropped_watch_closes_its_inotify_fd(agent, tmp_path):
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", agent.port))
        s.sendall(f"GET /files/watch?path={tmp_path} HTTP/1.1\r\nHost: a\r\n\r\n".encode())
        got = b""
        while b"ready" not in got:
            piece = s.recv(4096)
            assert piece, got
            got += piece
        s.close()
    assert _wait(lambda: _inotify_fds(agent.pid) == 0), "a watch whose client left must end"
    r = httpx.get(f"{agent.url}/files/watch", params={"path": str(tmp_path / "missing")})
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
    (tmp_path / "file").write_text("x")
    r = httpx.get(f"{agent.url}/files/watch", params={"path": str(tmp_path / "file")})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]


def test_watch_limit_on_directories(tmp_path, monkeypatch):
    from atoll.guest.agent import errors as agent_errors
    from atoll.guest.agent import watch

    monkeypatch.setattr(watch, "MAX_WATCHES", 3)
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    with pytest.raises(agent_errors.ApiError) as e:
        watch.Watcher(str(tmp_path), True)
    assert e.value.status == 400 and "more than 3 directories" in e.value.message
    w = watch.Watcher(str(tmp_path / "a"), True)  # 1 watch; a tree that grows past the limit ends it
    seen: list = []

    def ended() -> bool:
        events, end = w.read()
        seen.extend(events)
        return end

    try:
        os.makedirs(tmp_path / "a/x/y/z")
        assert _wait(ended)
        assert seen[-1]["type"] == "overflow"
    finally:
        w.close()


def test_open_watches_are_bounded(tmp_path, monkeypatch):
    """Past MAX_OPEN watches a sandbox answers 409 instead of starving its agent (150 recursive
    watches of / at once used to make the worker give the sandbox up as unresponsive)."""
    import threading

    from atoll.guest.agent import errors as agent_errors
    from atoll.guest.agent import watch

    monkeypatch.setattr(watch, "_open", threading.BoundedSemaphore(1))
    assert watch._open.acquire(blocking=False)  # the one slot is taken by an open watch
    try:
        with pytest.raises(agent_errors.ApiError) as e:
            watch.serve(None, str(tmp_path), True)  # type: ignore[arg-type]
        assert e.value.status == 409 and "file watches open" in e.value.message
    finally:
        watch._open.release()
