"""Stopping atoll never loses a sandbox; the next `atoll up` with the same home reattaches to it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from tests.integration.conftest import client as _client
from tests.integration.conftest import exec_ok as _exec

pytestmark = pytest.mark.integration


def test_restart_reattaches_running_memory_and_disk(local):
    local.start(timeout=600)
    with _client(local) as c:
        sids = {}
        assert c.post("/v1/volumes", json={"name": "kept", "size_mb": 16}).status_code == 201
        for name in ("running", "memory", "disk"):
            body = {"idle_timeout_s": 0, "metadata": {"role": name}}
            if name == "disk":  # a volume comes back with its sandbox and with atoll
                body["volumes"] = [{"name": "kept", "path": "/data"}]
            sid = c.post("/v1/sandboxes", json=body).json()["id"]
            _exec(c, sid, f"echo {name} > /root/name")
            _exec(
                c,
                sid,
                # The beat file is replaced atomically, so a reader never sees it half written.
                'python3 -c \'import os, time\nx=[0]\nwhile True:\n  x[0]+=1; open("/tmp/beat.tmp","w").write(str(x[0])); os.replace("/tmp/beat.tmp", "/tmp/beat"); time.sleep(0.1)\' &',
            )
            sids[name] = sid
        _exec(c, sids["disk"], "echo volume > /data/v")
        assert (
            c.post(f"/v1/sandboxes/{sids['memory']}/pause", json={"tier": "memory"}).json()["standby_tier"]
            == "memory"
        )
        assert (
            c.post(f"/v1/sandboxes/{sids['disk']}/pause", json={"tier": "disk"}).json()["standby_tier"]
            == "disk"
        )
    helpers = _helpers(local)
    assert set(helpers) == {"gateway", "ingress"}, helpers  # the data plane's processes
    t0 = time.monotonic()
    local.stop(reap=False)
    assert time.monotonic() - t0 < 10, "stopping atoll must take seconds"
    assert _gone(helpers.values()), "the gateway and the router stop with atoll"
    # as after a reboot of the host: the volume's filesystem is not mounted (the start mounts it)
    fs = os.path.join(local.home, "stores", "volume", "kept", "fs")
    subprocess.run(["umount", fs], check=True)
    time.sleep(1)
    local.start(timeout=600)
    with _client(local) as c:
        assert c.get("/v1/volumes/kept").json()["attached_to"] == sids["disk"]
        got = {n: c.get(f"/v1/sandboxes/{sid}").json() for n, sid in sids.items()}
        assert got["running"]["state"] == "running"
        assert (got["memory"]["state"], got["memory"]["standby_tier"]) == ("standby", "memory")
        assert (got["disk"]["state"], got["disk"]["standby_tier"]) == ("standby", "disk")
        for name, sid in sids.items():
            assert _exec(c, sid, "cat /root/name")["stdout"] == f"{name}\n"
            a = int(_exec(c, sid, "cat /tmp/beat")["stdout"])
            time.sleep(0.5)
            b = int(_exec(c, sid, "cat /tmp/beat")["stdout"])
            assert b > a, f"{name}: the background process must still be running after the restart"
        assert _exec(c, sids["disk"], "cat /data/v")["stdout"] == "volume\n"


def test_sigkill_during_checkpoint_never_loses_the_sandbox(local):
    local.start(timeout=600)
    with _client(local) as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 1024}).json()["id"]
        _exec(c, sid, "echo safe > /root/file")
        _exec(c, sid, "python3 -c 'import os,time; b=os.urandom(300*1024*1024); time.sleep(10**6)' &")
        time.sleep(3)
        th = threading.Thread(target=lambda: _try_pause(c, sid))
        th.start()
        time.sleep(0.4)
        helpers = _helpers(local)
        local.kill()
        th.join()
    # killed, atoll cannot stop its helpers: they stop when their channel to it closes
    assert _gone(helpers.values()), helpers
    local.start(timeout=600)
    with _client(local) as c:
        sb = c.get(f"/v1/sandboxes/{sid}").json()
        assert sb["state"] in ("running", "standby", "failed"), sb
        if sb["state"] == "failed":
            assert sb["failure_reason"], "a failed sandbox must say why"
        else:
            assert _exec(c, sid, "cat /root/file")["stdout"] == "safe\n"


def _helpers(local) -> dict[str, int]:
    from bench.bench_flood import _children

    return _children(local.proc.pid)


def _gone(pids, within: float = 10.0) -> bool:
    """Every pid has exited (a zombie whose parent was killed counts: it runs no more)."""

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _try_pause(c, sid):
    try:
        c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    except httpx.HTTPError:
        pass


def test_two_installations_side_by_side(local, api, atoll_server):
    """A second installation (other home and port) runs beside the session one; names never collide."""
    local.start(timeout=600)
    with _client(local) as c:
        mine = c.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
        theirs = api.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
        try:
            assert _exec(c, mine, "echo one")["stdout"] == "one\n"
            assert (
                api.post(f"/v1/sandboxes/{theirs}/exec", json={"cmd": "echo two"}).json()["stdout"] == "two\n"
            )
            ids = {open(os.path.join(h, "installation-id")).read() for h in (local.home, atoll_server.home)}
            assert len(ids) == 2
            assert c.get(f"/v1/sandboxes/{theirs}").status_code == 404
            # Pausing and deleting in one installation leaves the other alone.
            assert (
                c.post(f"/v1/sandboxes/{mine}/pause", json={"tier": "disk"}).json()["standby_tier"] == "disk"
            )
            c.delete(f"/v1/sandboxes/{mine}")
            assert (
                api.post(f"/v1/sandboxes/{theirs}/exec", json={"cmd": "echo still"}).json()["stdout"]
                == "still\n"
            )
        finally:
            api.delete(f"/v1/sandboxes/{theirs}")


def test_start_removes_template_images_of_other_versions(local):
    root = os.path.join(local.home, "builds")
    user_build = os.path.join(root, "bld-0123456789abcdef")
    stale = [
        # an older version's build of `base`, and the layout before built-in templates were builds
        os.path.join(root, "base-0123456789abcdef", "images", "0123456789abcdef", "512m"),
        os.path.join(local.home, "template-images", "base-512m-0123456789abcdef"),
        # a user build's images made under another agent or runsc, and before images were keyed
        os.path.join(user_build, "images", "0123456789abcdef", "512m"),
        os.path.join(user_build, "images", "512m"),
    ]
    for d in stale:
        os.makedirs(d)
        open(os.path.join(d, "manifest.json"), "w").write("{}")
    open(os.path.join(user_build, "log"), "w").write("the build itself is kept\n")
    local.start(timeout=600)
    deadline = time.monotonic() + 120
    while not glob.glob(os.path.join(root, "base-*", "images", "*", "512m", "manifest.json")) or any(
        map(os.path.exists, stale)
    ):
        assert time.monotonic() < deadline, os.listdir(root)
        time.sleep(0.2)
    assert os.path.exists(os.path.join(user_build, "log"))
    assert not os.path.exists(os.path.join(local.home, "template-images"))
    assert len(glob.glob(os.path.join(root, "base-*"))) == 1


def _until(what, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(0.2)
    return got


def test_a_restart_under_another_runsc_makes_the_images_and_the_pool_again(local, tmp_path):
    """The same agent and runsc after a restart: the images are kept. Another runsc (here the same
    program at another path, ATOLL_RUNSC): `base`'s image is made again under the new runtime key,
    the old one removed, and the pool member frozen before the restart is replaced, not claimed."""
    local.env["ATOLL_DEFAULT_POOL"] = "1"
    images = os.path.join(local.home, "builds", "base-*", "images")

    def keys():
        """the runtime keys with a 512 MB image of base"""
        return sorted(
            os.path.basename(os.path.dirname(os.path.dirname(p)))
            for p in glob.glob(os.path.join(images, "*", "512m", "manifest.json"))
        )

    def members():
        """the pool's member, ready"""
        with _client(local) as c:
            pool = c.get("/v1/templates/base/pool").json()
        sids = os.listdir(os.path.join(local.home, "sandboxes"))
        return sids if pool["ready"] == 1 and len(sids) == 1 else None

    local.start(timeout=600)
    [key] = _until(keys)
    [old_member] = _until(members)
    local.stop(reap=False)
    local.start(timeout=600)
    assert keys() == [key]  # nothing changed: the image is kept
    assert _until(members) == [old_member]
    local.stop(reap=False)

    runsc_copy = tmp_path / "bin" / "runsc"
    runsc_copy.parent.mkdir()
    shutil.copy2(shutil.which("runsc") or "/usr/bin/runsc", runsc_copy)
    local.env["ATOLL_RUNSC"] = str(runsc_copy)
    local.start(timeout=600)
    [new_key] = _until(lambda: [k for k in keys() if k != key] if key not in keys() else None)
    [new_member] = _until(members)
    assert new_member != old_member
    with _client(local) as c:
        r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert sid == new_member  # claimed from the pool: the member made under the new runsc
        assert _exec(c, sid, "hostname")["stdout"] == f"{sid}\n"
    log = open(local.log_path).read()
    assert "were made under an earlier guest agent or runsc" in log
    assert "is not handed out" not in log  # never offered to a create
    assert keys() == [new_key]


def test_a_sandbox_keeps_the_agent_files_of_its_version_across_an_upgrade(local, tmp_path):
    """Each agent version's files live in a directory of their own: a sandbox mounts the one it
    was started with (its agent in memory restarts its atoll-init from it) and keeps it after the
    worker is upgraded; the directory goes once no sandbox runs that version. The upgrade here is
    another gcc (a wrapper at another path): atoll-init's key, so the agent's digest, changes."""

    def record(sid):
        with open(os.path.join(local.home, "sandboxes", sid, "runtime.json")) as f:
            return json.load(f)

    def mount_source(sid):
        with open(os.path.join(local.home, "sandboxes", sid, "bundle", "config.json")) as f:
            mounts = json.load(f)["mounts"]
        return next(m["source"] for m in mounts if m["destination"] == "/opt/atoll")

    def versions():
        return sorted(n for n in os.listdir(os.path.join(local.home, "agent")) if n.startswith("v-"))

    local.start(timeout=600)
    with _client(local) as c:
        old = c.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
        _exec(c, old, "true")
    old_dir = record(old)["agent_dir"]
    assert os.path.dirname(old_dir) == os.path.join(local.home, "agent")
    assert versions() == [os.path.basename(old_dir)] and mount_source(old) == old_dir
    local.stop(reap=False)

    gcc = tmp_path / "bin" / "gcc"
    gcc.parent.mkdir()
    gcc.write_text(f'#!/bin/sh\nexec {shutil.which("gcc")} "$@"\n')
    gcc.chmod(0o755)
    local.env["PATH"] = f"{gcc.parent}:{os.environ['PATH']}"
    local.start(timeout=600)
    [new_version] = [v for v in versions() if v != os.path.basename(old_dir)]
    new_dir = os.path.join(local.home, "agent", new_version)
    assert os.path.exists(os.path.join(old_dir, "atoll-init"))  # kept: a sandbox runs that version
    with _client(local) as c:
        new = c.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
        assert record(new)["agent_dir"] == new_dir and mount_source(new) == new_dir
        # the old sandbox's agent restarts its atoll-init from its own version's files
        r = c.post(f"/v1/sandboxes/{old}/exec", json={"cmd": "kill -9 1", "timeout_s": 30})
        assert r.status_code == 200 and r.json()["exit_code"] == 137, r.text
        assert _exec(c, old, "echo alive")["stdout"] == "alive\n"
        assert record(old)["agent_dir"] == old_dir
        # a disk-tier round trip writes its bundle again: still its own version's files
        assert c.post(f"/v1/sandboxes/{old}/pause", json={"tier": "disk"}).json()["standby_tier"] == "disk"
        assert _exec(c, old, "echo back")["stdout"] == "back\n"
        assert mount_source(old) == old_dir
        assert c.delete(f"/v1/sandboxes/{old}").status_code == 204
    local.stop(reap=False)
    local.start(timeout=600)
    assert versions() == [new_version]  # nobody runs the old version any more


def test_create_boots_cold_when_the_template_image_is_damaged(local):
    """Sandboxes normally start from the template image; a damaged image costs speed, not a create."""
    local.start(timeout=600)
    deadline = time.monotonic() + 120
    images = []
    while time.monotonic() < deadline and not images:
        images = glob.glob(os.path.join(local.home, "builds", "base-*", "images", "*", "*m", "manifest.json"))
        time.sleep(0.2)
    assert images, "the base template image was not made at start-up"
    with _client(local) as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
        assert _exec(c, sid, "hostname")["stdout"] == f"{sid}\n"
        img = os.path.join(os.path.dirname(images[0]), "checkpoint.img")
        with open(img, "r+b") as f:
            f.write(b"\x00" * 4096)
        r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "env": {"K": "v"}})
        assert r.status_code == 201, r.text
        sid2 = r.json()["id"]
        assert _exec(c, sid2, "echo $K; hostname")["stdout"] == f"v\n{sid2}\n"
    log = open(local.log_path).read()
    assert "sandbox runtime started" in log and "by template image" in log
    assert "booting cold" in log


@pytest.mark.parametrize("delay_s", [0.0, 0.4])  # lands in the build's cold boot, or around its checkpoint
def test_stop_during_a_background_template_image_build_leaves_no_sandbox_behind(local, delay_s):
    local.start(timeout=600)
    with _client(local) as c:
        # a size without an image: this create boots cold and starts that size's image build
        sid = c.post("/v1/sandboxes", json={"memory_mb": 192, "idle_timeout_s": 0}).json()["id"]
    sandboxes = os.path.join(local.home, "sandboxes")
    deadline = time.monotonic() + 10
    while len(os.listdir(sandboxes)) < 2:  # the build's temporary sandbox has appeared
        assert time.monotonic() < deadline, os.listdir(sandboxes)
        time.sleep(0.01)
    time.sleep(delay_s)
    # wherever the cancellation lands (its cold boot, the checkpoint, the commit), nothing may stay
    assert local.stop(reap=False) is not None
    assert os.listdir(sandboxes) == [sid]  # the temporary one was deleted on the way out
    # the image was abandoned, or committed whole if the stop came after its commit: never half-made
    for d in glob.glob(os.path.join(local.home, "builds", "base-*", "images", "*", "192m")):
        assert os.path.exists(os.path.join(d, "manifest.json")), d
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    others = [line for line in ps.splitlines() if local.home in line and sid not in line]
    assert not [line for line in others if "runsc" in line], others
