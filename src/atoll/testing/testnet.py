"""A test host: a network namespace joined to the root namespace by a veth pair, running servers.

`TestHost(script, args)` makes `atoll-test-<tag>` with the addresses 10.250.<n>.2 and .3 (the root
side has .1, and .4 for ATOLL_EGRESS_SOURCE), runs `script` (Python) inside it with `args`
(`{a}`, `{b}`, `{dir}` are filled in) and waits for it to print `ready`; `hosts_file(lines)`
writes an ATOLL_EXTRA_HOSTS file. Traffic goes only to addresses of this namespace; closing kills
the script (by its PID) and removes the link and the namespace. Needs root. Used by the
integration tests and the benchmarks.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import subprocess
import sys
import tempfile

_LOCKS = "/run/atoll-testnet"


def claim_subnet() -> tuple[int, int]:
    """A free n for 10.250.<n>.0/29 (200..249) and the descriptor whose lock holds it.

    Test processes run side by side (pytest-xdist): a lock file per n, held until `release_subnet`
    (or the process's exit), keeps two test hosts from taking the same addresses."""
    os.makedirs(_LOCKS, exist_ok=True)
    start = secrets.randbelow(50)
    for i in range(50):
        n = 200 + (start + i) % 50
        fd = os.open(os.path.join(_LOCKS, str(n)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _in_use(n):  # a test host of a killed test run left its interface behind: not this one
            os.close(fd)
            continue
        return n, fd
    raise RuntimeError("all 50 test subnets 10.250.200-249.0/29 are in use")


def _in_use(n: int) -> bool:
    """Whether an address of 10.250.<n>.0/29 is on an interface of this namespace already (the
    lock is free, so whoever put it there is gone; its route would take this host's traffic)."""
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False
    ).stdout
    return f" 10.250.{n}." in out


def release_subnet(fd: int) -> None:
    os.close(fd)


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


class TestHost:
    __test__ = False  # not a pytest class

    def __init__(self, script: str, args: list[str] = ()):  # type: ignore[assignment]
        self.script, self.args = script, list(args)
        self.n, self._lock = claim_subnet()
        self.tag = secrets.token_hex(3)
        self.ns, self.root_if = f"atoll-test-{self.tag}", f"at{self.tag}"
        self.net = f"10.250.{self.n}"
        self.a, self.b, self.source = f"{self.net}.2", f"{self.net}.3", f"{self.net}.4"
        self.dir = tempfile.mkdtemp(prefix="atoll-testhost-")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> TestHost:
        _sh("ip", "netns", "add", self.ns)
        try:
            _sh("ip", "link", "add", self.root_if, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
            _sh("ip", "addr", "add", f"{self.net}.1/29", "dev", self.root_if)
            _sh("ip", "addr", "add", f"{self.source}/29", "dev", self.root_if)
            _sh("ip", "link", "set", self.root_if, "up")
            _sh("ip", "-n", self.ns, "addr", "add", f"{self.a}/29", "dev", "eth0")
            _sh("ip", "-n", self.ns, "addr", "add", f"{self.b}/29", "dev", "eth0")
            _sh("ip", "-n", self.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            args = [x.format(a=self.a, b=self.b, dir=self.dir) for x in self.args]
            # nsenter --net, not `ip netns exec`: that one also makes a mount namespace, a copy of
            # the host's mounts — sandboxes' upper images included — which pins them while this
            # host lives (an archive then cannot detach a checkpointed sandbox's image)
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.ns}", sys.executable, "-c", self.script, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline().strip()
            if line != b"ready":
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"test host script did not start: {line!r} {err[-2000:]}")
        except BaseException:
            self.close()
            raise
        return self

    def hosts_file(self, lines: list[str]) -> str:
        path = os.path.join(self.dir, "hosts")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        if self._lock >= 0:
            release_subnet(self._lock)
            self._lock = -1

    def __exit__(self, *exc) -> None:
        self.close()
