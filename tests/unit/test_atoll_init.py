"""atoll-init (guest/init/atoll-init.c) spoken to by the agent's InitClient, natively on the host.

The init is compiled the way the worker does it (agent_pack.build_init) and started by the agent's
own code (zygote.start through InitClient) inside a private mount namespace (`unshare --mount`), so
the proc it mounts over /proc stays there. Its pids cgroup is a directory of plain files
(ATOLL_INIT_CGROUP) instead of gVisor's cgroupfs: the init finds one there and mounts nothing; its
`cgroup.procs` files say which processes a command's cgroup holds. The real cgroups, floods and
timeouts are covered on gVisor by tests/security/test_agent_isolation.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from atoll.worker.host import agent_pack

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("gcc") is None,
    reason="needs root (a PID namespace), util-linux unshare and gcc",
)

_HELPER = r"""
import json, os, queue, signal, subprocess, sys, time
from atoll.guest.agent import initclient

FDS = "cd /proc/self/fd && echo *"

exits = queue.SimpleQueue()
client = initclient.InitClient(lambda pid, code, sig: exits.put((pid, code, sig)), lambda: None)
signals = {}
client._env = lambda: {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "ATOLL_INIT_CGROUP": os.environ["CG"]}
client.sandbox_id = "sb-aaaaaaaaaaaaaaaa"
client.start_first()
out = {"init_pid": client.pid}

def exit_of(pid):
    while True:
        p, code, sig = exits.get(timeout=10)
        if p == pid:
            signals[pid] = sig
            return code

def spawn(argv, **kw):
    kw.setdefault("cwd", "/")
    kw.setdefault("env", {"PATH": "/usr/bin:/bin"})
    return client.spawn(argv, user_kwargs={}, stdin=os.open(os.devnull, os.O_RDONLY),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)

s = spawn(["sh", "-c", "echo out $X; echo err >&2; exit 3"], env={"PATH": "/usr/bin:/bin", "X": "x\udcff"})
out["echo"] = [s.stdout.read().decode("utf-8", "surrogateescape"), s.stderr.read().decode(), exit_of(s.pid), s.pid]
s = spawn(["sh", "-c", "readlink /proc/1/fd/0 /proc/1/fd/1 /proc/1/fd/2"])  # PID 1: the init, as commands see it
out["init_stdio"] = s.stdout.read().decode().split()
exit_of(s.pid)
fds = spawn(["sh", "-c", FDS])
out["fds"] = fds.stdout.read().decode().split()
exit_of(fds.pid)
for name, argv, cwd in (("missing", ["no-such-program-x"], "/"), ("cwd", ["true"], "/no/such/dir"),
                        ("noexec", [os.environ["NOEXEC"]], "/")):
    try:
        spawn(argv, cwd=cwd)
        out[name] = None
    except OSError as e:
        out[name] = [e.errno, e.filename]
# the PATH search: a file that cannot run is passed over for a later one, and reported if none is found
s = spawn(["true"], env={"PATH": os.environ["PATHDIR"] + ":/no/such/dir:/usr/bin:/bin"})
out["path_later"] = exit_of(s.pid)
try:
    spawn(["true"], env={"PATH": "/no/such/dir:" + os.environ["PATHDIR"]})
    out["path_noexec"] = None
except OSError as e:
    out["path_noexec"] = [e.errno, e.filename]
s = spawn(["sleep", "60"])
client.signal(s.pid, signal.SIGTERM)
out["signal"] = [exit_of(s.pid), signals[s.pid]]
s = spawn(["sh", "-c", "sleep 61 & setsid sleep 62 & echo $!; wait"])
leftover = int(s.stdout.readline())
time.sleep(0.2)
client.kill_tree(s.pid)
out["kill"] = [exit_of(s.pid), signals[s.pid]]
s = spawn(["sh", "-c", "exit 137"])  # the same code as a KILL, by itself: no signal
out["exit137"] = [exit_of(s.pid), signals[s.pid]]
time.sleep(0.5)
out["leftover_alive"] = os.path.exists(f"/proc/{leftover}") and open(f"/proc/{leftover}/stat").read().split(")")[1].split()[0] not in "ZX"
client.set_identity("sb-bbbbbbbbbbbbbbbb", cpus=1)
time.sleep(0.2)
out["environ"] = [e for e in open("/proc/1/environ", "rb").read().split(b"\0") if e.startswith(b"ATOLL_SANDBOX_ID=")][0].decode()
out["cmdline"] = open("/proc/1/cmdline", "rb").read().rstrip(b"\0").decode()
out["comm"] = open("/proc/1/comm").read().strip()
print(json.dumps(out))
client.kill_all()
"""


@pytest.fixture(scope="module")
def result():
    # a short path: the init keeps cgroup paths in 128 bytes
    tmp = tempfile.mkdtemp(prefix="atoll-init-", dir="/tmp")
    try:
        init = agent_pack.build_init(tmp)
        cg = os.path.join(tmp, "cg")
        os.makedirs(os.path.join(cg, "user"))
        for f in ("cgroup.procs", "user/cgroup.procs", "user/pids.max"):
            open(os.path.join(cg, f), "w").close()
        for i in range(8):  # ready command cgroups: plain files stand in for cgroupfs's own
            os.makedirs(os.path.join(cg, "user", f"c{i}"))
            for f in ("cgroup.procs", "pids.max"):
                open(os.path.join(cg, "user", f"c{i}", f), "w").close()
        src = os.path.dirname(os.path.dirname(os.path.dirname(agent_pack.__file__)))
        noexec = os.path.join(tmp, "not-executable")
        with open(noexec, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(noexec, 0o644)
        pathdir = os.path.join(tmp, "pathdir")
        os.makedirs(pathdir)
        with open(os.path.join(pathdir, "true"), "w") as f:
            f.write("#!/bin/sh\nexit 9\n")
        os.chmod(os.path.join(pathdir, "true"), 0o644)
        env = {
            **os.environ,
            "ATOLL_INIT": init,
            "CG": cg,
            "NOEXEC": noexec,
            "PATHDIR": pathdir,
            "PYTHONPATH": os.path.dirname(src),
        }
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _HELPER],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, cg, noexec
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_command_runs_with_its_pipes_environment_and_exit_code(result):
    out, *_ = result
    text, err, code, pid = out["echo"]
    assert (text, err, code) == ("out x\udcff\n", "err\n", 3)
    assert pid > 1 and out["init_pid"] > 1  # the init is PID 1 of its namespace, the command's pid is in it
    # nothing of the init's or the agent's is inherited: the same as a process started with only 0-2
    alone = subprocess.run(
        ["sh", "-c", "cd /proc/self/fd && echo *"], capture_output=True, text=True, close_fds=True, check=True
    )
    assert out["fds"] == alone.stdout.split()


def test_failed_starts_are_what_subprocess_would_raise(result):
    out, _, _, noexec = result
    assert out["missing"] == [2, "no-such-program-x"]  # -> 127 "command not found" in the agent
    assert out["cwd"] == [2, "/no/such/dir"]  # -> 400 about cwd
    assert out["noexec"] == [13, noexec]  # -> 126 Permission denied
    # execvp's search: a file without x is passed over, then reported if no later entry has one
    assert out["path_later"] == 0
    assert out["path_noexec"] == [13, "true"]


def test_the_inits_own_stdio_is_dev_null(result):
    # commands can write to /proc/1/fd/1 and 2: those must not be the agent's (the host's log file,
    # outside the sandbox's disk quota); the init's log lines go to the agent on its socket
    out, *_ = result
    assert out["init_stdio"] == ["/dev/null"] * 3


def test_signal_and_kill_reach_the_command_and_its_session(result):
    out, *_ = result
    assert out["signal"] == [128 + 15, 15]  # the signal is reported beside its 128+N
    assert out["kill"] == [128 + 9, 9]
    assert out["exit137"] == [137, None]
    assert out["leftover_alive"] is False  # setsid'd away from the group, found by its parent


def test_identity_names_and_cgroups(result):
    out, stderr, cg, _ = result
    assert out["environ"] == "ATOLL_SANDBOX_ID=sb-bbbbbbbbbbbbbbbb"
    assert out["comm"] == "atoll-init" and out["cmdline"] == "atoll-init"
    with open(os.path.join(cg, "user", "pids.max")) as f:
        assert f.read() == "1024"
    assert "no process limits" not in stderr and "cannot limit" not in stderr, stderr
