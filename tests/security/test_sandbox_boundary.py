"""The sandbox boundary seen from inside a real gVisor sandbox (the security battery, issue 20; these
checks were first written for issues 5, 9 and 13 in tests/integration and moved here):

- host files: a link planted in the sandbox (to `/`, to a host path, `../..` chains) read through
  the files API resolves inside the sandbox's own root; a hostile tar (`..`, absolute paths, links
  out, hard links to host files, devices, FIFOs) is refused whole with nothing written; a drive's
  files API never follows a link a sandbox planted, and a mount path through a template's link is
  checked where it leads;
- processes: a sandbox sees none of the host's processes and none of another sandbox's;
- the network from inside: no DNS question leaves; the server's API, the ingress router and the
  host's addresses answer nothing (the egress policy cases are in tests/integration/test_egress.py).

Everything runs on the session's `atoll up` (tests/conftest.py); `seam` tests also on the split."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
import urllib.parse

import pytest

from tests.conftest import run
from tests.integration.test_files_api import _err, _m, _tar
from tests.integration.test_volumes import _create, _name

pytestmark = pytest.mark.integration


# ---- host files: links, the files API, tars and mounts --------------------------------------------
def test_symlinks_cannot_reach_the_host(api, shared_sandbox, tmp_path):
    sid = shared_sandbox["id"]
    marker = tmp_path / "host-secret.txt"
    marker.write_text("host secret")
    run(
        api,
        sid,
        f"ln -s / /tmp/rootlink && ln -s {marker} /tmp/direct && ln -s ../../../../../../../.. /tmp/up",
    )
    # Resolved inside the sandbox's own root: the host file does not exist there.
    for p in ("/tmp/direct", f"/tmp/rootlink{marker}", f"/tmp/up{marker}"):
        r = api.get(f"/v1/sandboxes/{sid}/files", params={"path": p})
        assert r.status_code in (400, 404), (p, r.text)
        assert b"host secret" not in r.content
    r = api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/up/etc/hostname"})
    assert r.status_code == 200 and r.content.strip().decode() == sid


EVIL = {
    "dotdot": [(_m("ok.txt"), b"1"), (_m("../escape.txt"), b"x")],
    "deep-dotdot": [(_m("ok.txt"), b"1"), (_m("a/../../escape.txt"), b"x")],
    "absolute": [(_m("ok.txt"), b"1"), (_m("/escape.txt"), b"x")],
    "symlink-out": [
        (_m("ok.txt"), b"1"),
        (_m("l", tarfile.SYMTYPE, "../../.."), None),
        (_m("l/escape.txt"), b"x"),
    ],
    "absolute-symlink": [(_m("ok.txt"), b"1"), (_m("l", tarfile.SYMTYPE, "/"), None)],
    "symlink-chain": [
        (_m("l", tarfile.SYMTYPE, "."), None),
        (_m("m", tarfile.SYMTYPE, "l/.."), None),
        (_m("m/escape.txt"), b"x"),
    ],
    "hardlink-out": [(_m("ok.txt"), b"1"), (_m("h", tarfile.LNKTYPE, "/etc/passwd"), None)],
    "hardlink-dotdot": [(_m("ok.txt"), b"1"), (_m("h", tarfile.LNKTYPE, "../../etc/passwd"), None)],
    "device": [(_m("ok.txt"), b"1"), (_m("null", tarfile.CHRTYPE), None)],
    "fifo": [(_m("ok.txt"), b"1"), (_m("pipe", tarfile.FIFOTYPE), None)],
}


@pytest.mark.parametrize("name", list(EVIL))
def test_hostile_tar_is_refused_whole(api, shared_sandbox, name):
    sid = shared_sandbox["id"]
    target = f"/dst/{name}"
    r = api.put(f"/v1/sandboxes/{sid}/files/tar", params={"path": target}, content=_tar(EVIL[name], gz=True))
    msg = _err(r, 400, "invalid_request")
    assert "nothing was written" in msg, msg
    out = run(api, sid, f"test -e {target} && echo inside; test -e /escape.txt && echo outside; ls /dst 2>&1")
    assert "inside" not in out["stdout"] and "outside" not in out["stdout"], out


@pytest.mark.seam
def test_a_drive_is_shared_by_sandboxes_and_the_api_without_following_their_links(api):
    drive = _name("drv")
    assert api.post("/v1/drives", json={"name": drive, "size_mb": 16}).status_code == 201
    sids: list[str] = []
    try:
        a = _create(api, drives=[{"name": drive, "path": "/shared"}])
        sids.append(a)
        b = _create(api, drives=[{"name": drive, "path": "/shared", "read_only": True}])
        sids.append(b)
        run(
            api, a, "mkdir -p /shared/out && echo built > /shared/out/artifact && ln -s /etc /shared/etc-link"
        )
        assert run(api, b, "cat /shared/out/artifact")["stdout"] == "built\n"
        out = api.post(f"/v1/sandboxes/{b}/exec", json={"cmd": "echo x > /shared/nope"}).json()
        assert out["exit_code"] != 0, out  # mounted read-only
        r = api.put(f"/v1/drives/{drive}/files", params={"path": "/from-api.txt"}, content=b"api")
        assert r.status_code == 200, r.text
        assert run(api, b, "cat /shared/from-api.txt")["stdout"] == "api"  # visible at once
        assert api.get(f"/v1/drives/{drive}/files", params={"path": "/out/artifact"}).content == b"built\n"
        names = {
            e["name"] for e in api.get(f"/v1/drives/{drive}/files/list", params={"path": "/"}).json()["items"]
        }
        assert names == {"out", "etc-link", "from-api.txt"}
        for path in ("/etc-link/passwd", "/etc-link", "/../../etc/passwd"):
            r = api.get(f"/v1/drives/{drive}/files", params={"path": path})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path", (path, r.text)
        r = api.put(f"/v1/drives/{drive}/files", params={"path": "/etc-link/evil"}, content=b"x")
        assert r.status_code == 400, r.text
        r = api.put(f"/v1/drives/{drive}/files", params={"path": "/big"}, content=b"\0" * (20 * 1024 * 1024))
        assert r.status_code in (413, 507), r.text  # over the file limit or the drive's size
        assert (
            run(api, a, "ls /shared | sort")["stdout"] == "etc-link\nfrom-api.txt\nout\n"
        )  # nothing half-written
        assert sorted(api.get(f"/v1/drives/{drive}").json()["attached_to"]) == sorted(sids)
        with tarfile.open(fileobj=io.BytesIO(api.get(f"/v1/drives/{drive}/tar").content)) as t:
            assert {"out/artifact", "etc-link", "from-api.txt"} <= set(t.getnames())
    finally:
        for sid in sids:
            api.delete(f"/v1/sandboxes/{sid}")
        deadline = time.monotonic() + 60
        while api.delete(f"/v1/drives/{drive}").status_code == 409 and time.monotonic() < deadline:
            time.sleep(0.2)


def test_a_mount_path_through_a_template_link_is_checked_where_it_leads(api):
    drive = _name("drv")
    assert api.post("/v1/drives", json={"name": drive, "size_mb": 8}).status_code == 201
    try:
        for path in ("/var/run", "/var/run/atoll", "/usr", "/bin"):  # /var/run -> /run in Debian
            r = api.post("/v1/sandboxes", json={"drives": [{"name": drive, "path": path}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path", (path, r.text)
        assert api.get(f"/v1/drives/{drive}").json()["attached_to"] == []  # failed creates hold nothing
    finally:
        for sb in api.get("/v1/sandboxes", params={"state": "failed"}).json()["items"]:
            api.delete(f"/v1/sandboxes/{sb['id']}")
        assert api.delete(f"/v1/drives/{drive}").status_code == 204


# ---- processes -----------------------------------------------------------------------------------
def test_a_sandbox_sees_no_process_of_the_host_or_of_another_sandbox(api, atoll_server):
    """A process on the host and one in another sandbox, each with a unique marker in its command
    line: neither appears in the sandbox's /proc, and the sandbox cannot signal the host's by pid."""
    marker = f"atoll-marker-{os.getpid()}-{time.monotonic_ns()}"
    host_proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", marker],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    a, b = _create(api), _create(api)
    try:
        r = api.post(
            f"/v1/sandboxes/{b}/exec",
            json={
                "cmd": ["python3", "-c", "import time; time.sleep(300)", marker + "-b"],
                "background": True,
            },
        )
        assert r.status_code in (200, 201), r.text
        seen_b = run(api, b, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")["stdout"]
        assert marker + "-b" in seen_b  # the marker is findable where it is (so its absence counts)
        listing = run(api, a, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo; ls /proc")["stdout"]
        assert marker not in listing, listing
        pids = {int(p) for p in listing.split() if p.isdigit()}
        if host_proc.pid not in pids:  # (a sandbox's own pid may be the same number by chance)
            out = run(api, a, f"kill -0 {host_proc.pid} 2>&1; echo rc=$?")
            assert "rc=0" not in out["stdout"], out
        assert host_proc.poll() is None  # the host's process lives on
    finally:
        host_proc.kill()
        host_proc.wait()
        for sid in (a, b):
            api.delete(f"/v1/sandboxes/{sid}")


# ---- the network from inside ---------------------------------------------------------------------
def test_dns_never_leaves_the_sandbox(api, shared_sandbox):
    sid = shared_sandbox["id"]
    r = run(api, sid, "python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'")
    assert r["exit_code"] == 0 and r["stdout"].startswith("127."), r
    # the only resolver is the worker's egress gateway, which answers no name without a policy
    # (it never forwards the question: a name the policy does not allow is REFUSED at once)
    assert "nameserver 10.99.0.1" in run(api, sid, "cat /etc/resolv.conf")["stdout"]
    r = run(
        api,
        sid,
        [
            "python3",
            "-c",
            "import socket\ntry:\n socket.gethostbyname('example.com')\nexcept OSError as e:\n print('no', e)",
        ],
    )
    assert r["stdout"].startswith("no"), r


PROBE = """
import socket, sys
for ip, port in [{targets}]:
    try:
        s = socket.create_connection((ip, port), timeout=3)
        s.sendall(b"GET /healthz HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
        s.settimeout(3)
        print(ip, port, "answer", repr(s.recv(400)))
    except OSError as e:
        print(ip, port, "no", type(e).__name__)
"""


def test_the_servers_api_and_the_ingress_router_are_not_reachable_from_inside(
    api, atoll_server, shared_sandbox
):
    """The control plane's API and the ingress router listen on the host: a sandbox with the default
    policy reaches neither on any address it could try (its gateway's, loopback, metadata)."""
    sid = shared_sandbox["id"]
    port = urllib.parse.urlsplit(atoll_server.url).port
    targets = [
        (ip, p)
        for ip in ("10.99.0.1", "127.0.0.1", "169.254.169.254")
        for p in (port, atoll_server.ingress_port)
    ]
    code = PROBE.format(targets=", ".join(repr(t) for t in targets))
    out = run(api, sid, ["python3", "-c", code], timeout_s=60)["stdout"]
    lines = out.splitlines()
    assert len(lines) == len(targets), out
    for line in lines:  # nothing answers, or the egress gateway refuses: never atoll's API or router
        assert " no " in line or ("x-atoll-egress: refused" in line and "never reachable" in line), line
