"""Start a real local atoll (`atoll up` in a subprocess) for your own tests, and stop it cleanly.

    with atoll.testing.LocalAtoll(home=tmp_path / "atoll") as local:
        client = atoll.Client(base_url=local.url, api_key=local.api_key)

The server runs in its own process group; `stop()` sends SIGTERM to that group only and waits. With
`reap=True` (default) every sandbox still alive is deleted first, so nothing started is left behind.
Needs root and the host packages `make run` installs. Used by atoll's own integration tests.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def purge(home: str | os.PathLike) -> list[str]:
    """Remove every sandbox of the installation at `home` from this host (no server needed)."""
    import asyncio

    from atoll.worker import service

    return asyncio.run(service.purge_installation(os.fspath(home)))


class LocalAtoll:
    def __init__(
        self,
        home: str | os.PathLike,
        port: int | None = None,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        reap: bool = True,
        log_path: str | os.PathLike | None = None,
    ):
        self.home = os.fspath(home)
        self.port = port or free_port()
        self.api_key = api_key or "test_" + secrets.token_hex(12)
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env or {}
        self.reap = reap
        self.log_path = os.fspath(log_path) if log_path else os.path.join(self.home, "atoll-server.log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600) -> LocalAtoll:
        os.makedirs(self.home, exist_ok=True)
        env = {
            **os.environ,
            "ATOLL_HOME": self.home,
            "ATOLL_PORT": str(self.port),
            "ATOLL_API_KEY": self.api_key,
            **self.env,
        }
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atoll", "up"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"atoll up exited with {self.proc.returncode}; see {self.log_path}:\n{self.tail()}"
                )
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop(reap=False)
        raise RuntimeError(f"atoll up did not become healthy within {timeout}s; see {self.log_path}")

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except FileNotFoundError:
            return ""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def reap_sandboxes(self) -> None:
        try:
            with httpx.Client(base_url=self.url, headers=self.headers(), timeout=120) as c:
                for sb in c.get("/v1/sandboxes").json().get("items", []):
                    c.delete(f"/v1/sandboxes/{sb['id']}")
        except httpx.HTTPError:
            pass
        # Deletion finishes in the background (runsc delete takes 1-2 s): wait for it.
        sbx = os.path.join(self.home, "sandboxes")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and os.path.isdir(sbx) and os.listdir(sbx):
            time.sleep(0.2)

    def stop(self, reap: bool | None = None, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        if (self.reap if reap is None else reap) and self.proc.poll() is None:
            self.reap_sandboxes()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        if self.reap if reap is None else reap:
            purge(self.home)  # whatever the API could not delete (e.g. after a failed test)
        return rc

    def kill(self) -> None:
        """SIGKILL the server (not its sandboxes): for crash tests."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> LocalAtoll:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
