"""The guest agent's terminals on this host (the agent runs here as a plain process, spawning
directly): a real pty with the command as session leader and controlling terminal, TERM and size,
resize, scrollback replayed on reattach, the exit code, listing and killing, and bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from atoll.guest.agent import ptyframes, ptys

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


@pytest.fixture
def agent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "atoll.guest.agent", "--host", "127.0.0.1", "--port", str(port)],
        cwd=SRC,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield port
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # a loaded machine; the fixture still reaps what it started
        proc.kill()
        proc.wait(10)


def _call(port, method, path, body=None):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        data = json.dumps(body).encode() if body is not None else b""
        s.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
        )
        f = s.makefile("rb")
        status = int(f.readline().split()[1])
        length = 0
        while (line := f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        raw = f.read(length) if length else b""
        # the agent never closes first: we do
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        return status, json.loads(raw) if raw else None


class Attached:
    def __init__(self, port, pty_id):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(
            f"GET /pty/{pty_id}/attach HTTP/1.1\r\nHost: a\r\nUpgrade: atoll-pty\r\nConnection: Upgrade\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        self.decoder = ptyframes.Decoder()
        self.out = bytearray()
        self.exit_code = None
        self.errors = []

    def until(self, needle: bytes):
        while needle not in self.out and self.exit_code is None:
            self._pump()
        assert needle in self.out, bytes(self.out)

    def _pump(self):
        chunk = self.sock.recv(65536)
        assert chunk, "the agent closed the attach"
        for kind, payload in self.decoder.feed(chunk):
            if kind == ptyframes.DATA:
                self.out += payload
            elif kind == ptyframes.EXIT:
                self.exit_code = ptyframes.parse_exit(payload)
            elif kind == ptyframes.ERROR:
                self.errors.append(ptyframes.parse_error(payload))

    def wait_exit(self):
        while self.exit_code is None:
            self._pump()
        return self.exit_code

    def send(self, frame: bytes):
        self.sock.sendall(frame)

    def close(self):
        self.sock.close()


def test_terminal_session(agent):
    status, started = _call(
        agent, "POST", "/pty", {"cols": 91, "rows": 31, "term": "vt220", "cmd": ["/bin/sh"]}
    )
    assert status == 200, started
    a = Attached(agent, started["pty_id"])
    a.send(ptyframes.data(b"echo T=$TERM; stty size; tty\n"))
    a.until(b"T=vt220")
    a.until(b"31 91")
    a.until(b"/dev/pts/")
    # the shell is a session leader with this pty as its controlling terminal
    a.send(
        ptyframes.data(
            b"python3 -c 'import os; print(\"sl\", os.getsid(0) == os.getppid(), os.tcgetpgrp(0) == os.getpgrp())'\n"
        )
    )
    a.until(b"sl True True")
    a.send(ptyframes.resize(0, 5))
    while not a.errors:
        a._pump()
    assert a.errors[0]["code"] == "invalid_request" and "cols" in a.errors[0]["message"]
    a.send(ptyframes.resize(120, 40))
    a.send(ptyframes.data(b"stty size; echo marker-$((1+1))\n"))
    a.until(b"40 120")
    a.until(b"marker-2")
    a.close()  # detach: the session lives on
    b = Attached(agent, started["pty_id"])
    b.until(b"marker-2")  # the scrollback, replayed
    b.send(ptyframes.data(b"exit 6\n"))
    assert b.wait_exit() == 6
    b.close()
    status, listing = _call(agent, "GET", "/pty")
    [info] = [i for i in listing["items"] if i["pty_id"] == started["pty_id"]]
    assert info["running"] is False and info["exit_code"] == 6 and (info["cols"], info["rows"]) == (120, 40)
    late = Attached(agent, started["pty_id"])  # a late attach still gets the code
    assert late.wait_exit() == 6
    late.close()
    assert _call(agent, "DELETE", f"/pty/{started['pty_id']}")[0] == 204
    assert _call(agent, "GET", f"/pty/{started['pty_id']}")[1]["error"]["code"] == "pty_not_found"


def test_kill_and_bad_input(agent):
    status, started = _call(agent, "POST", "/pty", {"cols": 80, "rows": 24, "cmd": "sleep 1000"})
    assert status == 200
    pid = started["pid"]
    assert _call(agent, "DELETE", f"/pty/{started['pty_id']}")[0] == 204
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the terminal's program (pid {pid}) survived DELETE /pty/<id>")
    for body, needle in (
        ({"cols": 100000, "rows": 24}, "cols"),
        ({"cols": 80, "rows": 0}, "rows"),
        ({"term": "x y"}, "term"),
        ({"cmd": ["/no/such/program"]}, "/no/such/program"),
        ({"cwd": "/no/such/dir"}, "/no/such/dir"),
    ):
        status, err = _call(agent, "POST", "/pty", body)
        assert status == 400 and needle in err["error"]["message"], (body, err)
    assert _call(agent, "GET", "/pty/pty_000000000000/attach")[0] == 404


def test_foreground_group_and_login_shell(tmp_path):
    assert ptys.login_shell("no-such-user-here") == "/bin/sh"
    proc = tmp_path / "proc"
    for pid, pgrp, sess, start in (
        (10, 10, 10, 100),
        (11, 11, 10, 200),
        (12, 12, 10, 300),
        (13, 13, 13, 400),
    ):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(
            f"{pid} (x) S 1 {pgrp} {sess} 0 0 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0\n"
        )
    assert ptys.foreground_group(10, str(proc)) == 12  # the newest group of the session but the shell's
    assert ptys.foreground_group(13, str(proc)) == 13
    assert ptys.foreground_group(77, str(proc)) is None
