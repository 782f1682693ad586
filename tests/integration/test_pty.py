"""Terminals in real gVisor sandboxes through the public WebSocket: a login shell on a pty, typed
into and read back, resized, reattached after a disconnect, kept across memory and disk standby,
opened on a sandbox in standby; and `atoll sandbox shell` driven under a real pseudo-terminal."""

from __future__ import annotations

import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.integration.conftest import run

pytestmark = [pytest.mark.integration, pytest.mark.seam]


def _open(api, sid, **body) -> str:
    r = api.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24, **body})
    assert r.status_code == 201, r.text
    return r.json()["pty_id"]


def _ws(server, sid, pty_id):
    url = server.url.replace("http://", "ws://") + f"/v1/sandboxes/{sid}/pty/{pty_id}/ws"
    return connect(url, additional_headers=server.headers(), open_timeout=60)


def _until(ws, needle: bytes, seen: bytearray, timeout: float = 30) -> bytearray:
    deadline = time.monotonic() + timeout
    while needle not in seen:
        try:
            msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise AssertionError(f"no {needle!r} within {timeout} s; output so far {bytes(seen)!r}") from None
        if isinstance(msg, str):
            raise AssertionError(f"text message {msg!r} before {needle!r}; output so far {bytes(seen)!r}")
        seen += msg
    return seen


def _exit_code(ws, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while True:
        msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(msg, str):
            return json.loads(msg)["exit_code"]


def _pause(api, sid, tier):
    """Pause; a terminal socket just closed is released by the server a moment later (until then
    the pause is refused as sandbox_busy, which is retryable)."""
    deadline = time.monotonic() + 10
    while True:
        r = api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": tier})
        if r.status_code != 409 or r.json()["error"]["code"] != "sandbox_busy" or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_shell_echo_term_resize_exit(api, atoll_server, sandbox):
    sid = sandbox["id"]
    pty_id = _open(api, sid)
    with _ws(atoll_server, sid, pty_id) as ws:
        seen = bytearray()
        ws.send(b"echo TERM=$TERM; tty; echo cols=$(tput cols)\r")
        _until(ws, b"TERM=xterm-256color\r\n", seen)
        _until(ws, b"cols=80\r\n", seen)
        assert b"/dev/pts/" in seen  # a real terminal, and the shell's own
        ws.send(json.dumps({"resize": [123, 45]}))
        ws.send(b"echo size=$(stty size)/$(tput cols)\r")
        _until(ws, b"size=45 123/123", seen)
        ws.send(json.dumps({"resize": [100000, 45]}))  # refused in-band; the session goes on
        msg = ws.recv(timeout=30)
        while isinstance(msg, bytes):
            msg = ws.recv(timeout=30)
        assert json.loads(msg)["error"]["code"] == "invalid_request"
        ws.send(b"sleep 1000\r")
        time.sleep(1)
        ws.send(b"\x03")  # interrupts the foreground job, not the shell
        ws.send(b"echo rc=$?\r")
        _until(ws, b"rc=130\r\n", seen)
        ws.send(b"exit 3\r")
        assert _exit_code(ws) == 3
    [item] = [i for i in api.get(f"/v1/sandboxes/{sid}/pty").json()["items"] if i["pty_id"] == pty_id]
    assert item["running"] is False and item["exit_code"] == 3
    # the exit was collected like any command's: nothing of the shell is left running
    assert "bash" not in run(api, sid, ["ps", "-eo", "comm"])["stdout"]


def test_reattach_sees_scrollback_and_continues(api, atoll_server, sandbox):
    sid = sandbox["id"]
    pty_id = _open(api, sid, cmd="/bin/bash --norc -i", term="vt100")
    with _ws(atoll_server, sid, pty_id) as ws:
        ws.send(b"echo first-$((6*7)); MARK=kept\r")
        _until(ws, b"first-42\r\n", bytearray())
    with _ws(atoll_server, sid, pty_id) as ws:
        seen = _until(ws, b"first-42\r\n", bytearray())  # replayed from the scrollback
        ws.send(b"echo again-$MARK-$TERM\r")
        _until(ws, b"again-kept-vt100\r\n", seen)
    r = api.delete(f"/v1/sandboxes/{sid}/pty/{pty_id}")
    assert r.status_code == 204
    assert api.delete(f"/v1/sandboxes/{sid}/pty/{pty_id}").json()["error"]["code"] == "pty_not_found"


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_detached_session_survives_standby(api, atoll_server, sandbox, tier):
    sid = sandbox["id"]
    pty_id = _open(api, sid)
    with _ws(atoll_server, sid, pty_id) as ws:
        ws.send(b"KEEP=still-$((40+2))\r")
        ws.send(b"echo set-$KEEP\r")
        _until(ws, b"set-still-42\r\n", bytearray())
    r = _pause(api, sid, tier)
    assert r.status_code == 200, r.text
    sb = r.json()
    assert sb["state"] == "standby" and sb["standby_tier"] == tier, sb
    with _ws(atoll_server, sid, pty_id) as ws:  # resumes the sandbox
        ws.send(b"echo after-$KEEP\r")
        _until(ws, b"after-still-42\r\n", bytearray())
        ws.send(b"exit 5\r")
        assert _exit_code(ws) == 5


def test_pty_on_a_sandbox_in_standby_resumes_it(api, atoll_server, sandbox):
    sid = sandbox["id"]
    assert _pause(api, sid, "memory").json()["state"] == "standby"
    pty_id = _open(api, sid, cmd=["cat"])
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    with _ws(atoll_server, sid, pty_id) as ws:
        ws.send(b"typed into cat\r")
        seen = _until(ws, b"typed into cat\r\n", bytearray())
        _until(ws, b"typed into cat\r\ntyped into cat\r\n", seen)  # the echo, then cat's copy
        # ^C: SIGINT to the foreground group (the agent does what this gVisor's line discipline
        # does not); cat dies of it: 128 + 2
        ws.send(b"\x03")
        assert _exit_code(ws) == 130


def test_bad_input(api, sandbox):
    sid = sandbox["id"]
    for body in ({"cols": 0, "rows": 24}, {"cols": 100000, "rows": 24}, {"cols": 80, "rows": 0}):
        r = api.post(f"/v1/sandboxes/{sid}/pty", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    r = api.post(f"/v1/sandboxes/{sid}/pty", json={"cmd": ["/no/such/program"]})
    assert r.status_code == 400 and "/no/such/program" in r.json()["error"]["message"], r.text
    r = api.post(f"/v1/sandboxes/{sid}/pty", json={"cwd": "/no/such/dir"})
    assert r.status_code == 400 and "/no/such/dir" in r.json()["error"]["message"], r.text


def _cli(server, sid):
    env = {**os.environ, "ATOLL_URL": server.url, "ATOLL_API_KEY": server.api_key, "TERM": "xterm"}
    return [sys.executable, "-m", "atoll", "sandbox", "shell", sid], env


def _read_until(fd: int, needle: bytes, seen: bytearray, timeout: float = 60) -> bytearray:
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} did not appear; the terminal showed {bytes(seen)[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # EIO: the CLI exited
                raise AssertionError(
                    f"the CLI ended before {needle!r}; it showed {bytes(seen)[-2000:]!r}"
                ) from None
    return seen


def test_cli_shell_under_a_real_pty(atoll_server, sandbox):
    argv, env = _cli(atoll_server, sandbox["id"])
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    cooked = termios.tcgetattr(slave)
    proc = subprocess.Popen(
        argv,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # SIGWINCH reaches it on a resize
    )
    try:
        seen = _read_until(master, b"# ", bytearray())  # the login shell's prompt
        os.write(master, b"echo hi-$((1+1)) $TERM $(tput cols)\r")
        _read_until(master, b"hi-2 xterm 100", seen)
        lflag = termios.tcgetattr(slave)[3]
        assert not lflag & (termios.ICANON | termios.ECHO), "the CLI puts the local terminal in raw mode"
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))  # SIGWINCH
        for _attempt in range(20):  # the SIGWINCH, the CLI's resize message, the agent's ioctl
            os.write(master, b"echo cols=$(tput cols)\r")
            try:
                _read_until(master, b"cols=111", seen, timeout=1.5)
                break
            except AssertionError:
                continue
        assert b"cols=111" in seen, bytes(seen)[-500:]
        os.write(master, b"sleep 1000\r")
        time.sleep(1)
        os.write(master, b"\x03")  # ^C goes through to the sandbox, not to the CLI
        os.write(master, b"echo rc=$?\r")
        _read_until(master, b"rc=130", seen)
        os.write(master, b"exit 3\r")
        assert proc.wait(60) == 3
        assert termios.tcgetattr(slave)[3] == cooked[3], "raw mode is undone on exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


def test_cli_shell_without_a_tty(atoll_server, sandbox):
    argv, env = _cli(atoll_server, sandbox["id"])
    done = subprocess.run(
        argv, input=b"echo piped-$((2+2))\nexit 4\n", capture_output=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 4, done
    assert b"piped-4" in done.stdout
    bad = subprocess.run(
        [*argv[:-1], "sb-aaaaaaaaaaaaaaaa"],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert bad.returncode == 1 and b"sandbox_not_found" in bad.stderr, bad


def test_an_oversized_message_closes_the_socket_and_the_session_lives_on(api, atoll_server, sandbox):
    """A binary message past 1 MiB (8 MiB here) ends that WebSocket with 1009 (message too big);
    the terminal session behind it keeps running and a new attach gets an answering shell."""
    sid = sandbox["id"]
    pty_id = _open(api, sid, cmd="/bin/bash --norc -i")
    with _ws(atoll_server, sid, pty_id) as ws:
        ws.send(b"MARK=alive-$((6*7))\r")
        _until(ws, b"\r\n", bytearray())
        ws.send(b"x" * (8 << 20))
        with pytest.raises(ConnectionClosed) as ei:
            while True:
                ws.recv(timeout=30)
        assert ei.value.rcvd is not None and ei.value.rcvd.code == 1009, ei.value
    [item] = [i for i in api.get(f"/v1/sandboxes/{sid}/pty").json()["items"] if i["pty_id"] == pty_id]
    assert item["running"] is True, item
    with _ws(atoll_server, sid, pty_id) as ws:
        ws.send(b"echo still-$MARK\r")
        _until(ws, b"still-alive-42\r\n", bytearray())
    # A message at the limit reaches the program whole (read raw, so that no line discipline or
    # shell editor sits between; an interactive bash takes minutes over a 1 MiB paste by itself).
    size = 1 << 20
    reader = f"import sys; d = sys.stdin.buffer.read({size}); print('got', len(d), set(d) == {{121}})"
    raw_id = _open(api, sid, cmd=["sh", "-c", f'stty raw -echo; echo RAW; python3 -c "{reader}"; sleep 1000'])
    with _ws(atoll_server, sid, raw_id) as ws:
        seen = _until(ws, b"RAW", bytearray())
        ws.send(b"y" * size)
        _until(ws, f"got {size} True".encode(), seen, timeout=60)
