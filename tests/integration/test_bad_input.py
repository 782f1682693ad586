"""Bad input answered with the right 4xx (or 507) and a code, never a 500: deeply nested JSON, odd pids,
impossible resources, unwritable/unreadable paths, a full disk; and file names that are not UTF-8
round-trip through the files API (path_b64)."""

from __future__ import annotations

import base64
import os

import httpx
import pytest

import atoll
from tests.conftest import run

pytestmark = pytest.mark.integration


def _err(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text[:500]
    body = r.json()["error"]
    assert body["code"] == code, body
    assert body["message"] and "Traceback" not in r.text
    return body["message"]


def test_deeply_nested_json_is_400(api, sandbox):
    deep = b"[" * 100000
    msg = _err(api.post("/v1/sandboxes", content=deep), 400, "invalid_request")
    assert "nested" in msg
    msg = _err(
        api.post(f"/v1/sandboxes/{sandbox['id']}/exec", content=b'{"cmd": ' + deep), 400, "invalid_request"
    )
    assert "nested" in msg
    # moderately deep values inside an object reach validation and are refused there
    body = b'{"cmd": "true", "env": ' + b"[" * 500 + b"]" * 500 + b"}"
    _err(api.post(f"/v1/sandboxes/{sandbox['id']}/exec", content=body), 400, "invalid_request")


def test_a_large_environment_runs_or_is_400_and_the_sandbox_goes_on(api, sandbox):
    """~300 KB of env (within the 1 MiB body) once made the agent take its init for dead (the
    request datagram was larger than the socket's buffer: EMSGSIZE) and every later exec wait 30 s
    and fail. Now it runs; more than the init reads in one request is a 400, and the sandbox goes on."""
    sid = sandbox["id"]
    env = {f"A{i}": "x" * 100_000 for i in range(3)}
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["printenv", "A2"], "env": env, "timeout_s": 60})
    assert r.status_code == 200 and r.json()["stdout"] == "x" * 100_000 + "\n", r.text[:500]
    # a string command as well (gVisor's exec may refuse so large an environment: an exit code, not a 500)
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo ${#A0}", "env": env, "timeout_s": 60})
    assert r.status_code == 200, r.text[:500]
    big = {f"A{i}": "x" * 99_000 for i in range(10)}  # ~1 MB of env: more than the init reads at once
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "env": big, "timeout_s": 60})
    msg = _err(r, 400, "invalid_request")
    assert "bytes" in msg and "stdin" in msg
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo ok", "timeout_s": 20}, timeout=25)
    assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text[:500]


def test_pid_with_non_ascii_digits_is_400(api, sandbox):
    sid = sandbox["id"]
    bg = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 30", "background": True}).json()
    for pid in ("%D9%A3", "%EF%BC%93", "3%C2%B2"):  # Arabic-Indic three, fullwidth three, superscript two
        msg = _err(api.delete(f"/v1/sandboxes/{sid}/processes/{pid}"), 400, "invalid_request")
        assert "pid" in msg
    assert api.delete(f"/v1/sandboxes/{sid}/processes/{bg['pid']}").status_code == 204


def test_impossible_resources_are_400(api):
    msg = _err(api.post("/v1/sandboxes", json={"cpus": 1e-9}), 400, "invalid_request")
    assert "cpus" in msg
    host_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    if host_mb + 1024 > 65536:
        pytest.skip("this host has more memory than memory_mb's upper bound")
    msg = _err(api.post("/v1/sandboxes", json={"memory_mb": host_mb + 1024}), 400, "invalid_request")
    assert "memory_mb" in msg and str(host_mb) in msg
    assert not [s for s in api.get("/v1/sandboxes").json()["items"] if s["memory_mb"] == host_mb + 1024]


def test_files_errors_are_4xx(api, sandbox):
    sid = sandbox["id"]
    files = f"/v1/sandboxes/{sid}/files"
    run(api, sid, "mkdir -p /mnt/ro && mount -t tmpfs -o ro tmpfs /mnt/ro")
    msg = _err(api.put(files, params={"path": "/mnt/ro/a.txt"}, content=b"x"), 403, "read_only_path")
    assert "/mnt/ro/a.txt" in msg
    msg = _err(api.get(files, params={"path": "/proc/1/mem"}), 400, "io_error")
    assert "/proc/1/mem" in msg
    # a path nobody may create files in (procfs)
    _err(api.put(files, params={"path": "/proc/new.txt"}, content=b"x"), 403, "permission_denied")
    # the sandbox is fine afterwards
    assert run(api, sid, "echo ok")["stdout"] == "ok\n"


def test_full_disk_is_507(api):
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "disk_mb": 64})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        files = f"/v1/sandboxes/{sid}/files"
        run(api, sid, "dd if=/dev/zero of=/root/fill bs=1M count=200 2>/dev/null; sync; true")
        msg = _err(
            api.put(files, params={"path": "/root/more.bin"}, content=b"y" * (4 * 1024 * 1024)),
            507,
            "disk_full",
        )
        assert "disk_mb" in msg
        # a big upload that fails early is still answered properly (the rest of the body is drained)
        msg = _err(
            api.put(files, params={"path": "/root/big.bin"}, content=b"z" * (40 * 1024 * 1024)),
            507,
            "disk_full",
        )
        # no temp file is left behind, and freeing space makes writes work again
        names = run(api, sid, "python3 -c 'import os; print(os.listdir(\"/root\"))'")["stdout"]
        assert "fill" in names and ".atoll-" not in names
        run(api, sid, "rm -f /root/fill")
        assert api.put(files, params={"path": "/root/more.bin"}, content=b"y" * 1024).status_code == 204
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_filling_tmp_is_507_and_the_sandbox_lives(api):
    """/tmp is a tmpfs in the sandbox's memory: bounded at half its memory_mb, a write past that is
    ENOSPC (507 naming /tmp), never the host's OOM killer stopping the sandbox (it did, at 1 GiB)."""
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 128})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        files = f"/v1/sandboxes/{sid}/files"
        assert run(api, sid, "df -m --output=size /tmp | tail -1")["stdout"].strip() == "64"
        msg = _err(
            api.put(files, params={"path": "/tmp/big.bin"}, content=b"z" * (96 << 20)), 507, "disk_full"
        )
        assert "/tmp is kept in the sandbox's memory" in msg and "memory_mb" in msg, msg
        # a program filling it gets ENOSPC too, and the sandbox goes on
        out = run(api, sid, "dd if=/dev/zero of=/tmp/fill bs=1M count=100; echo rc=$?")
        assert "No space left on device" in out["stderr"] and "rc=1" in out["stdout"], out
        run(api, sid, "rm -f /tmp/fill")
        assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert api.put(files, params={"path": "/tmp/small"}, content=b"ok").status_code == 204
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_non_utf8_file_names_round_trip(api, sandbox, atoll_server):
    sid = sandbox["id"]
    files = f"/v1/sandboxes/{sid}/files"
    run(
        api,
        sid,
        "mkdir -p /root/d && printf one > \"$(printf '/root/d/a\\377')\" && printf two > \"$(printf '/root/d/a\\376')\"",
    )
    items = api.get(f"{files}/list", params={"path": "/root/d"}).json()["items"]
    assert len(items) == 2
    raw = {base64.b64decode(i["path_b64"]) for i in items}
    assert raw == {b"/root/d/a\xff", b"/root/d/a\xfe"}
    for i in items:
        assert base64.b64decode(i["name_b64"]) in (b"a\xff", b"a\xfe")
    r = api.get(files, params={"path_b64": _b64(b"/root/d/a\xff")})
    assert r.status_code == 200 and r.content == b"one"
    r = api.get(files, params={"path_b64": _b64(b"/root/d/a\xfe")})
    assert r.status_code == 200 and r.content == b"two"
    # writing and listing a directory by raw bytes work too
    assert api.put(files, params={"path_b64": _b64(b"/root/d/b\xfd")}, content=b"three").status_code == 204
    lst = api.get(f"{files}/list", params={"path_b64": _b64(b"/root/d")}).json()["items"]
    assert len(lst) == 3
    assert api.delete(files, params={"path_b64": _b64(b"/root/d/a\xff")}).status_code == 204
    assert api.get(files, params={"path_b64": _b64(b"/root/d/a\xfe")}).content == b"two"
    assert api.delete(files, params={"path_b64": _b64(b"/root/d/a\xfe")}).status_code == 204
    left = run(api, sid, "python3 -c 'import os; print(os.listdir(b\"/root/d\"))'")["stdout"]
    assert left == "[b'b\\xfd']\n"
    # UTF-8 names carry path_b64 as well, equal to their UTF-8 bytes
    api.put(files, params={"path": "/root/d/é"}, content=b"e")
    by_name = {i["name"]: i for i in api.get(f"{files}/list", params={"path": "/root/d"}).json()["items"]}
    assert base64.b64decode(by_name["é"]["path_b64"]) == "/root/d/é".encode()
    # bad input
    _err(api.get(files, params={"path_b64": "not base64!"}), 400, "invalid_path")
    _err(api.get(files, params={"path_b64": _b64(b"relative")}), 400, "invalid_path")
    _err(api.get(files, params={"path": "/root/d/é", "path_b64": _b64(b"/x")}), 400, "invalid_path")

    # the SDK: list entries carry raw_path, and read/remove accept bytes
    with atoll.Client(base_url=atoll_server.url, api_key=atoll_server.api_key) as c:
        sb = c.sandboxes.get(sid)
        sb.files.write(b"/root/d/c\xfc", b"four")
        entries = {e.raw_path: e for e in sb.files.list("/root/d")}
        assert b"/root/d/c\xfc" in entries
        assert sb.files.read(entries[b"/root/d/c\xfc"].raw_path) == b"four"
        sb.files.remove(b"/root/d/c\xfc")
        assert b"/root/d/c\xfc" not in {e.raw_path for e in sb.files.list(b"/root/d")}
