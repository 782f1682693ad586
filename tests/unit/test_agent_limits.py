"""The guest agent's per-command cgroups as the way to a command's whole tree (guest/agent/limits):
kill_command kills every process its cgroup lists, setsid'd ones too, and its deadline (the exec's
timeout_s) kills what it left running once it exited — but never a cgroup that serves another
command by then. A directory of plain files stands in for gVisor's cgroupfs; the processes are real."""

from __future__ import annotations

import os
import subprocess
import threading
import time

from atoll.guest.agent import limits


def _fake_cgroups(tmp_path) -> limits.UserLimits:
    user = tmp_path / "user"
    user.mkdir()
    ul = limits.UserLimits(str(tmp_path))
    ul.enabled = True
    for i in range(3):
        c = user / f"c{i}"
        c.mkdir()
        (c / "cgroup.procs").write_text("")
        (c / "pids.max").write_text("512")
        ul.ready.append(str(c))
    return ul


def _start(*argv: str, setsid: bool = False) -> subprocess.Popen:
    return subprocess.Popen(list(argv), start_new_session=setsid)


def _alive(p: subprocess.Popen) -> bool:
    return p.poll() is None


def test_kill_command_kills_everything_its_cgroup_lists(tmp_path):
    ul = _fake_cgroups(tmp_path)
    root = _start("sleep", "60", setsid=True)
    child = _start("sleep", "61")  # in root's tree by cgroup only
    daemon = _start("sleep", "62", setsid=True)  # left the session
    other = _start("sleep", "63", setsid=True)  # another command's
    try:
        ul.confine(root.pid)
        path = ul.in_use[root.pid]
        with open(f"{path}/cgroup.procs", "w") as f:
            f.write(f"{root.pid}\n{child.pid}\n{daemon.pid}\n")
        ul.confine(other.pid)

        def emptied():  # what the kernel does as they die
            while any(_alive(p) for p in (root, child, daemon)):
                time.sleep(0.01)
            with open(f"{path}/cgroup.procs", "w"):
                pass

        t = threading.Thread(target=emptied)
        t.start()
        sent = ul.kill_command(root.pid)
        t.join(5)
        for p in (root, child, daemon):
            assert p.wait(5) == -9
        assert sent >= 3 and _alive(other)
    finally:
        for p in (root, child, daemon, other):
            if _alive(p):
                p.kill()
                p.wait()


def test_an_exited_commands_cgroup_stays_known_until_it_is_empty(tmp_path):
    ul = _fake_cgroups(tmp_path)
    ul.confine(100)
    path = ul.in_use[100]
    with open(f"{path}/cgroup.procs", "w") as f:
        f.write("101\n")  # a leftover of command 100
    ul.release(100)
    assert ul.path_of(100) == path and ul.members(100) == [101]
    with open(f"{path}/cgroup.procs", "w"):
        pass
    ul.release(999)  # any later exit recycles the emptied cgroups
    assert ul.path_of(100) is None and path in ul.ready


def test_a_deadline_kills_the_leftovers_of_its_own_command_only(tmp_path):
    ul = _fake_cgroups(tmp_path)
    lock = threading.Lock()
    deadlines = limits.Deadlines(ul, lock)
    left = _start("sleep", "60", setsid=True)
    try:
        with lock:
            ul.confine(left.pid)
            deadlines.add(left.pid, 0.2)
        path = ul.in_use[left.pid]
        with open(f"{path}/cgroup.procs", "w") as f:
            f.write(f"{left.pid}\n")
        assert left.wait(5) == -9
        # a command whose cgroup went back to the pool and now serves another one: left alone
        other = _start("sleep", "60", setsid=True)
        with lock:
            ul.confine(4242)
            deadlines.add(4242, 0.2)
            cg = ul.in_use.pop(4242)
            ul.ready.append(cg)
            ul.confine(other.pid)
        with open(f"{ul.in_use[other.pid]}/cgroup.procs", "w") as f:
            f.write(f"{other.pid}\n")
        time.sleep(0.5)
        assert _alive(other)
        other.kill()
        other.wait()
    finally:
        if _alive(left):
            left.kill()
            left.wait()
    assert os.path.isdir(path)
