"""worker.cgroups against the host's real cgroup v1 freezer (root only)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

from atoll.worker.host import cgroups

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/freezer"),
    reason="needs root and a cgroup v1 freezer hierarchy",
)


@pytest.fixture
def cgroup():
    path = f"/atoll-test-{uuid.uuid4().hex[:8]}"
    for ctrl in ("freezer",):
        os.makedirs(os.path.join("/sys/fs/cgroup", ctrl, path.lstrip("/")))
    procs: list[subprocess.Popen] = []
    yield path, procs
    cgroups.thaw(path)
    for p in procs:
        p.kill()
        p.wait()
    # a /bin/true forked just before the kill may still be in the cgroup: wait until it is empty
    directory = os.path.join("/sys/fs/cgroup/freezer", path.lstrip("/"))
    deadline = time.monotonic() + 10
    while True:
        try:
            os.rmdir(directory)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _start_in(path: str, cmd: str) -> subprocess.Popen:
    procs_file = os.path.join("/sys/fs/cgroup/freezer", path.lstrip("/"), "cgroup.procs")
    return subprocess.Popen(
        ["/bin/sh", "-c", f"echo $$ > {procs_file} && exec /bin/sh -c '{cmd}'"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _settles(path: str, state: str, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while cgroups.freezer_state(path) != state:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_freeze_a_cgroup_whose_processes_keep_forking(cgroup):
    path, procs = cgroup
    # two shells that start a new process as fast as they can: new tasks keep arriving while freezing
    procs += [_start_in(path, "while :; do /bin/true; done") for _ in range(2)]
    # a single write of FROZEN got stuck in FREEZING for >1 s in ~3% of tries here
    for _ in range(150):
        cgroups.freeze(path, timeout=3.0)
        # a fork under way at the moment of freezing can turn the state back to FREEZING briefly
        # (its child is marked to freeze and does within milliseconds): it must settle at FROZEN
        assert _settles(path, "FROZEN"), cgroups.freezer_state(path)
        cgroups.thaw(path)
        assert cgroups.freezer_state(path) == "THAWED"
    assert all(p.poll() is None for p in procs)


def test_freeze_of_a_missing_cgroup_is_a_runtime_error():
    from atoll.core import errors

    with pytest.raises(errors.RuntimeFailure, match="missing"):
        cgroups.freeze("/atoll-test-does-not-exist")


def test_installation_cgroups_are_removed_in_every_hierarchy_only_when_empty():
    inst = f"test{uuid.uuid4().hex[:6]}"
    parent = cgroups.installation_parent(inst)
    leaves = ("sb-0123456789abcdef-0", "sb-0123456789abcdef-1")
    for h in ("freezer", "systemd"):  # runsc makes the leaf in name=systemd too
        for leaf in leaves:
            os.makedirs(os.path.join("/sys/fs/cgroup", h, parent.lstrip("/"), leaf), exist_ok=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"/sys/fs/cgroup/freezer{parent}/{leaves[1]}/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        assert set(cgroups.installation_leaves(inst)) == set(leaves)
        assert cgroups.remove_empty_parents(inst) == []  # children left: nothing removed
        cgroups.remove(f"{parent}/{leaves[0]}")
        cgroups.remove(f"{parent}/{leaves[1]}")  # busy in freezer: kept there, gone elsewhere
        assert cgroups.installation_leaves(inst) == {leaves[1]: ["freezer"]}
        removed = cgroups.remove_empty_parents(inst)
        assert removed == [f"/sys/fs/cgroup/systemd{parent}/"]
    finally:
        sleeper.kill()
        sleeper.wait()
    cgroups.remove(f"{parent}/{leaves[1]}")
    assert cgroups.remove_empty_parents(inst) == [f"/sys/fs/cgroup/freezer{parent}/"]
    assert not [h for h in cgroups.hierarchies() if os.path.exists(f"/sys/fs/cgroup/{h}{parent}")]


def test_death_cause_names_the_host_pids_limit(tmp_path, monkeypatch):
    """Issue 5 item 4: a sandbox killed by its host pids cgroup used to fail with 'stopped unexpectedly'."""
    from atoll.worker.host import cgroups

    monkeypatch.setattr(cgroups, "ROOT", str(tmp_path))
    d = tmp_path / "pids" / "inst" / "sb-1"
    d.mkdir(parents=True)
    (d / "pids.events").write_text("max 3\n")
    (d / "pids.max").write_text("9216\n")
    assert cgroups.pids_limit_hits("inst/sb-1") == (3, 9216)
    assert cgroups.pids_limit_hits("inst/none") == (0, None)


def test_a_runtime_found_without_its_sentry_fails_with_the_limit_that_killed_it(tmp_path, monkeypatch):
    """Under load the reconciler saw an OOM-killed sentry gone before the liveness watch did, and
    the sandbox failed with "its gVisor sentry is not running" instead of the memory_mb cause."""
    from atoll.worker.host import cgroups
    from atoll.worker.runtimes import liveness, recovery

    monkeypatch.setattr(cgroups, "ROOT", str(tmp_path))

    class Rt:
        sandbox_id, memory_mb = "sb-1", 128

        def cgroup(self, install_id: str) -> str:
            return f"{install_id}/sb-1"

    live = liveness.Liveness.__new__(liveness.Liveness)
    live.install_id = "inst"
    rec = recovery.Recovery.__new__(recovery.Recovery)
    rec.liveness = live
    mem = tmp_path / "memory" / "inst" / "sb-1"
    mem.mkdir(parents=True)
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    gone = rec._vanished_cause(Rt(), recovery.SENTRY_GONE)
    assert "vanished" in gone and recovery.SENTRY_GONE in gone
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    cause = rec._vanished_cause(Rt(), recovery.SENTRY_GONE)
    assert "OOM killer" in cause and "memory_mb=128" in cause, cause
    # another thing missing is that thing, whatever the cgroup says
    other = rec._vanished_cause(Rt(), "its root filesystem is not mounted")
    assert "root filesystem is not mounted" in other and "OOM" not in other
