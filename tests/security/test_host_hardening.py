"""Host-side hardening: what a sandbox writes never becomes a setuid program or a device on the host,
other host users cannot reach $ATOLL_HOME, a deleted sandbox never keeps running (not even when atoll
stops right after the delete), start-up removes runtime objects no live record owns, and nothing of
an installation (down to its parent cgroups) stays on the host once its sandboxes are gone."""

from __future__ import annotations

import glob
import os
import sqlite3
import stat
import subprocess
import time

import pytest

from atoll.testing import LocalAtoll
from tests.conftest import TEMPLATE_CACHE
from tests.integration.conftest import client as _client
from tests.integration.conftest import exec_ok as _exec

pytestmark = pytest.mark.integration

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _create(c):
    r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _mount_options(mountpoint: str) -> set[str]:
    """Per-mount options (field 6 of mountinfo: nosuid, nodev, noexec live there) of `mountpoint`."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == os.path.realpath(mountpoint):
                return set(fields[5].split(","))
    raise AssertionError(f"{mountpoint} is not mounted")


def _exec_as_nobody_through_fd(path: str, *args: str) -> subprocess.CompletedProcess:
    """Run `path` as uid 65534 through an fd the parent (root) opened: the directory modes on the way
    are bypassed, so only the file's own mode and its mount's options decide what the exec does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return subprocess.run(
            [*NOBODY, f"/proc/self/fd/{fd}", *args],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(fd)


def _install_id(la) -> str:
    with open(os.path.join(la.home, "installation-id")) as f:
        return f.read().strip()


def _leftovers(la, sid: str) -> list[str]:
    """Everything of sandbox `sid` still on the host: processes, runsc state, netns, cgroups, mounts, dir."""
    inst = _install_id(la)
    name = f"atoll-{inst}-{sid[3:]}"
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace")
        except OSError:
            continue
        if "runsc" in argv and (name in argv or sid in argv):
            found.append(f"process {pid}: {argv.replace(chr(0), ' ')[:200]}")
    found += [f"runsc state {p}" for p in glob.glob(os.path.join(la.home, "runsc", f"{name}-*"))]
    found += [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith(name)]
    found += [f"cgroup {p}" for p in glob.glob(f"/sys/fs/cgroup/*/atoll-{inst}/{sid}-*")]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {ln.split()[4]}" for ln in f if sid in ln.split()[4]]
    if os.path.exists(os.path.join(la.home, "sandboxes", sid)):
        found.append(f"dir {os.path.join(la.home, 'sandboxes', sid)}")
    return found


def _wait_gone(la, sid: str, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _leftovers(la, sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One running installation for the tests that never stop it (each works on sandboxes of its
    own); the tests that stop, restart or purge an installation take `local`, their own."""
    la = LocalAtoll(
        home=tmp_path_factory.mktemp("hardening") / "home", env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE}
    )
    la.start(timeout=600)
    yield la
    la.stop(reap=True)


# ---- item 1: nothing a sandbox writes is setuid (or a device) on the host -------------------------


def test_a_setuid_file_written_in_a_sandbox_is_not_setuid_on_the_host(shared):
    with _client(shared) as c:
        sid = _create(c)
        _exec(c, sid, "cp /bin/bash /etc/sbash && chmod 4755 /etc/sbash")
        r = c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
        assert r.json()["standby_tier"] == "disk", r.text  # the upper layer is what is on disk
    sbx = os.path.join(shared.home, "sandboxes", sid)
    for mp in ("upper", "rootfs"):
        opts = _mount_options(os.path.join(sbx, mp))
        assert {"nosuid", "nodev"} <= opts, (mp, opts)
        assert "noexec" not in opts, (mp, opts)  # gVisor maps host files executable
    for path in (
        os.path.join(sbx, "upper", "upper", "etc", "sbash"),
        os.path.join(sbx, "rootfs", "etc", "sbash"),
    ):
        st = os.stat(path)
        assert st.st_uid == 0 and st.st_mode & stat.S_ISUID, "the sandbox's setuid-root file must be there"
        p = _exec_as_nobody_through_fd(path, "-p", "-c", "id -u; id -ru")
        deadline = time.monotonic() + 15
        while "Text file busy" in p.stderr and time.monotonic() < deadline:
            # the checkpointed container's gofer, discarded in the background after the pause
            # answered, may still hold the file open for writing for a moment
            time.sleep(0.2)
            p = _exec_as_nobody_through_fd(path, "-p", "-c", "id -u; id -ru")
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == ["65534", "65534"], (
            f"{path}: euid/uid {p.stdout.split()} (setuid took effect)"
        )
    with _client(shared) as c:  # the sandbox still works from its nosuid,nodev layers, modes intact
        mode = "python3 -c 'import os, stat; print(stat.filemode(os.stat(\"/etc/sbash\").st_mode))'"
        assert _exec(c, sid, f"/etc/sbash -c 'echo ok' && {mode}")["stdout"] == "ok\n-rwsr-xr-x\n"


def test_other_host_users_cannot_reach_the_home(shared):
    with _client(shared) as c:
        sid = _create(c)
        _exec(c, sid, "echo secret > /root/s")
    home = shared.home
    sbx = os.path.join(home, "sandboxes", sid)
    for target in (home, sbx, os.path.join(sbx, "upper", "upper", "root")):
        p = subprocess.run([*NOBODY, "ls", target], capture_output=True, text=True)
        assert p.returncode != 0 and "Permission denied" in p.stderr, (target, p)
    for f in (os.path.join(sbx, "runtime.json"), os.path.join(sbx, "upper", "upper", "root", "s")):
        p = subprocess.run([*NOBODY, "cat", f], capture_output=True, text=True)
        assert p.returncode != 0 and "Permission denied" in p.stderr, (f, p)
    # Every directory atoll keeps its own state in is 0700, every file it wrote 0600.
    for d in (
        home,
        *(os.path.join(home, n) for n in ("sandboxes", "runsc", "builds")),
        sbx,
        TEMPLATE_CACHE,
    ):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for f in ("installation-id", "atoll.db", f"sandboxes/{sid}/runtime.json", f"sandboxes/{sid}/upper.img"):
        assert stat.S_IMODE(os.stat(os.path.join(home, f)).st_mode) == 0o600, f


def test_start_fixes_the_modes_and_mounts_an_older_version_left(local):
    local.start(timeout=600)
    with _client(local) as c:
        sid = _create(c)
    local.stop(reap=False)
    sbx = os.path.join(local.home, "sandboxes", sid)
    # what earlier versions left: 0755 dirs, 0644 files, mounts without nosuid,nodev
    for d in (local.home, os.path.join(local.home, "sandboxes"), os.path.join(local.home, "runsc"), sbx):
        os.chmod(d, 0o755)
    os.chmod(os.path.join(sbx, "runtime.json"), 0o644)
    for mp in ("upper", "rootfs"):
        subprocess.run(["mount", "-o", "remount,bind,suid,dev", os.path.join(sbx, mp)], check=True)
        assert "nosuid" not in _mount_options(os.path.join(sbx, mp))
    local.start(timeout=600)
    for d in (local.home, os.path.join(local.home, "sandboxes"), os.path.join(local.home, "runsc"), sbx):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert stat.S_IMODE(os.stat(os.path.join(sbx, "runtime.json")).st_mode) == 0o600
    for mp in ("upper", "rootfs"):
        assert {"nosuid", "nodev"} <= _mount_options(os.path.join(sbx, mp)), mp
    with _client(local) as c:
        assert _exec(c, sid, "echo alive")["stdout"] == "alive\n"


# ---- item 6: a deleted sandbox never keeps running; start-up removes orphans ----------------------


def test_delete_right_before_a_stop_leaves_nothing_running(local):
    local.start(timeout=600)
    with _client(local) as c:
        sid = _create(c)
    local.stop(reap=False)
    local.start(timeout=600)  # the sandbox is reattached
    with _client(local) as c:
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    time.sleep(0.015)
    local.stop(reap=False)  # SIGTERM to atoll's process group ~15 ms after the delete was answered
    local.start(timeout=600)
    assert _wait_gone(local, sid, timeout=10) == []
    with _client(local) as c:
        assert c.get(f"/v1/sandboxes/{sid}").status_code == 404


def test_delete_kills_the_sandbox_when_runsc_lost_track_of_it(shared):
    """`runsc delete` cannot stop a sandbox whose runsc state is gone: the delete finds the sentry
    and gofer by their command lines and kills them by pid."""
    with _client(shared) as c:
        sid = _create(c)
        name = f"atoll-{_install_id(shared)}-{sid[3:]}"
        for p in glob.glob(os.path.join(shared.home, "runsc", f"{name}-*")):
            os.unlink(p)
        assert [x for x in _leftovers(shared, sid) if x.startswith("process")]
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert _wait_gone(shared, sid) == []
    assert "runsc delete left" in shared.tail(200)


def test_start_removes_sandboxes_no_record_owns(local):
    local.start(timeout=600)
    with _client(local) as c:
        kept, no_record, no_dir = _create(c), _create(c), _create(c)
        _exec(c, kept, "echo kept > /root/f")
        _exec(c, no_dir, "sleep 1000 &")
    local.stop(reap=False)
    db = sqlite3.connect(os.path.join(local.home, "atoll.db"))
    with db:
        db.execute("DELETE FROM sandboxes WHERE id IN (?, ?)", (no_record, no_dir))
    db.close()
    # the incident: the record and the directory are gone, the sentry still runs
    no_dir_path = os.path.join(local.home, "sandboxes", no_dir)
    for mp in ("rootfs", "upper"):
        subprocess.run(["umount", "-l", os.path.join(no_dir_path, mp)], check=True)
    subprocess.run(["rm", "-rf", "--one-file-system", no_dir_path], check=True)
    assert _leftovers(local, no_record) and _leftovers(local, no_dir)
    local.start(timeout=600)
    assert _leftovers(local, no_record) == []
    assert _leftovers(local, no_dir) == []
    log = local.tail(400)
    assert "sweep" in log and no_dir in log
    with _client(local) as c:  # the live sandbox was left alone
        assert _exec(c, kept, "cat /root/f")["stdout"] == "kept\n"


# ---- item 11: no empty per-installation cgroups stay ------------------------------------------------


def test_stop_removes_the_installations_empty_parent_cgroups(local):
    local.start(timeout=600)
    with _client(local) as c:
        sid = _create(c)
        inst = _install_id(local)
        assert glob.glob(f"/sys/fs/cgroup/*/atoll-{inst}")
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert _wait_gone(local, sid) == []
    assert local.stop(reap=False) is not None
    assert glob.glob(f"/sys/fs/cgroup/*/atoll-{inst}") == []


def test_purge_removes_everything_of_the_installation(local):
    local.start(timeout=600)
    with _client(local) as c:
        sids = [_create(c), _create(c)]
        c.post(f"/v1/sandboxes/{sids[1]}/pause", json={"tier": "memory"})
    inst = _install_id(local)
    local.stop(reap=False)
    from atoll import testing

    testing.purge(local.home)
    for sid in sids:
        assert _leftovers(local, sid) == []
    assert glob.glob(f"/sys/fs/cgroup/*/atoll-{inst}") == []
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"atoll-{inst}-")]
