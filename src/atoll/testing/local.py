"""Start a real local atoll for your own tests, and stop it cleanly: `atoll up` (`LocalAtoll`), or
`atoll server` with separate `atoll worker` processes (`LocalCluster`, built from `LocalServer` and
`LocalWorker`).

    with atoll.testing.LocalAtoll(home=tmp_path / "atoll") as local:
        client = atoll.Client(base_url=local.url, api_key=local.api_key)

    with atoll.testing.LocalCluster(tmp_path / "cluster", workers=2) as cluster:
        client = atoll.Client(base_url=cluster.url, api_key=cluster.api_key)

Installations started here keep no warm pool of `base` (ATOLL_DEFAULT_POOL=0, so that tests
that count sandboxes or memory see only their own); pass `env={"ATOLL_DEFAULT_POOL": "2"}` (or
set it in the environment) to keep one as `atoll up` does by default. Nor do they build the
built-in `code-interpreter-v1` template (ATOLL_E2B_CODE_INTERPRETER=0: its Debian layer is a
~9-minute, 1.4 GB first build); set it to 1 in `env` or the environment for tests that use it.

Each process runs in its own process group; `stop()` sends SIGTERM to that group only and waits.
With `reap=True` (default) every sandbox still alive is deleted first, and whatever the API could
not delete is purged from the host, so nothing started is left behind. Needs root and the host
packages `make run` installs. Used by atoll's own integration tests.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import typing

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 3
"""How often LocalAtoll.start picks its own ports again when one was taken before atoll bound it."""


def _e2b_port(env: dict[str, str] | None) -> int:
    raw = (env or {}).get("ATOLL_E2B_PORT")
    if raw is None:
        return free_port()
    return 0 if raw.lower() == "off" else int(raw)


def purge(home: str | os.PathLike) -> list[str]:
    """Remove every sandbox of the installation at `home` from this host (no server needed)."""
    import asyncio

    from atoll.worker.service import node

    return asyncio.run(node.purge_installation(os.fspath(home)))


class _Process:
    """One atoll process (its own session), its log, and how to stop or kill it."""

    argv: list[str]

    def __init__(
        self,
        home: str | os.PathLike,
        env: dict[str, str] | None,
        log_path: str | os.PathLike | None,
        log_name: str,
    ):
        self.home = os.fspath(home)
        self.env = env or {}
        self.log_path = os.fspath(log_path) if log_path else os.path.join(self.home, log_name)
        self.proc: subprocess.Popen | None = None

    def _environment(self) -> dict[str, str]:
        return {
            "ATOLL_DEFAULT_POOL": "0",
            "ATOLL_E2B_CODE_INTERPRETER": "0",
            **os.environ,
            "ATOLL_HOME": self.home,
            **self.env,
        }

    def spawn(self) -> None:
        os.makedirs(self.home, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atoll", *self.argv],
            env=self._environment(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except FileNotFoundError:
            return ""

    def terminate(self, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> None:
        """SIGKILL the process (not its sandboxes: they run in sessions of their own)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None


class _Api:
    """What a running atoll offers a test: its URL, key and a way to delete every sandbox."""

    url: str
    api_key: str
    tls_ca: str | None = None
    """The CA file the server's certificate is checked with when it serves https (its own)."""

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """httpx's `verify=` for this server."""
        return ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_healthy(self, timeout: float, alive: typing.Callable[[], str | None]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            why = alive()
            if why:
                raise RuntimeError(why)
            try:
                if httpx.get(self.url + "/healthz", timeout=1, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} did not become healthy within {timeout}s")

    def delete_all(self) -> list[str]:
        """Delete every listed sandbox; returns their ids. (A pool's sandboxes are not listed:
        stopping with `reap` purges them from the host.)"""
        deleted = []
        try:
            with httpx.Client(
                base_url=self.url, headers=self.headers(), timeout=120, verify=self.verify
            ) as c:
                for sb in c.get("/v1/sandboxes").json().get("items", []):
                    c.delete(f"/v1/sandboxes/{sb['id']}")
                    deleted.append(sb["id"])
        except httpx.HTTPError:
            pass
        return deleted

    @staticmethod
    def wait_no_sandboxes(home: str, timeout: float = 60, ids: typing.Collection[str] | None = None) -> None:
        """Deletion finishes in the background (runsc delete takes 1-2 s): wait for it, for the
        sandboxes `ids` (default: every sandbox on the host under `home`)."""
        sbx = os.path.join(home, "sandboxes")
        deadline = time.monotonic() + timeout

        def left() -> list[str]:
            names = os.listdir(sbx) if os.path.isdir(sbx) else []
            return names if ids is None else [n for n in names if n in ids]

        while time.monotonic() < deadline and left():
            time.sleep(0.2)


class LocalAtoll(_Process, _Api):
    """`atoll up` in a subprocess: the control plane and its local worker in one process."""

    def __init__(
        self,
        home: str | os.PathLike,
        port: int | None = None,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        reap: bool = True,
        log_path: str | os.PathLike | None = None,
    ):
        _Process.__init__(self, home, env, log_path, "atoll-server.log")
        self._chosen = {
            "port": port is None,
            "ingress": not (env or {}).get("ATOLL_INGRESS_PORT"),
            "e2b": (env or {}).get("ATOLL_E2B_PORT") is None,
        }
        """Which ports this object picked itself (free_port): those it may pick again."""
        self._started = False
        self.port = port or free_port()
        self.api_key = api_key or "test_" + secrets.token_hex(12)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ingress_port = int((env or {}).get("ATOLL_INGRESS_PORT") or free_port())
        """The ingress router's port (preview URLs): a free one, not the API's + 1, which may be taken."""
        self.e2b_port = _e2b_port(env)
        """E2B's API port (0: off): a free one, not the API's + 2, which may be taken."""
        self.e2b_url = f"http://127.0.0.1:{self.e2b_port}"
        """E2B_API_URL and E2B_SANDBOX_URL of the `e2b` SDKs."""
        self.reap = reap
        self.argv = ["up"]

    def _environment(self) -> dict[str, str]:
        return {
            **super()._environment(),
            "ATOLL_PORT": str(self.port),
            "ATOLL_API_KEY": self.api_key,
            "ATOLL_INGRESS_PORT": str(self.ingress_port),
            "ATOLL_E2B_PORT": str(self.e2b_port),
        }

    def start(self, timeout: float = 600) -> LocalAtoll:
        for attempt in range(PORT_ATTEMPTS):
            self.spawn()

            def alive() -> str | None:
                rc = self.exited()
                return (
                    None if rc is None else f"atoll up exited with {rc}; see {self.log_path}:\n{self.tail()}"
                )

            try:
                self.wait_healthy(timeout, alive)
            except RuntimeError as e:
                self.stop(reap=False)
                # a port free_port picked was taken by another process before atoll bound it (the
                # ports are chosen apart from their use): at the first start, pick those again
                if self._started or "already in use" not in str(e).lower() or attempt == PORT_ATTEMPTS - 1:
                    raise
                self._pick_ports_again()
                continue
            self._started = True
            return self
        raise AssertionError("unreachable")

    def _pick_ports_again(self) -> None:
        if self._chosen["port"]:
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
        if self._chosen["ingress"]:
            self.ingress_port = free_port()
        if self._chosen["e2b"]:
            self.e2b_port = free_port()
            self.e2b_url = f"http://127.0.0.1:{self.e2b_port}"

    def reap_sandboxes(self) -> None:
        self.wait_no_sandboxes(self.home, ids=self.delete_all())

    def stop(self, reap: bool | None = None, timeout: float = 30) -> int | None:
        reap = self.reap if reap is None else reap
        if self.proc is None:
            return None
        if reap and self.proc.poll() is None:
            self.reap_sandboxes()
        rc = self.terminate(timeout)
        if reap:
            purge(self.home)  # whatever the API could not delete (e.g. after a failed test)
        return rc

    def __enter__(self) -> LocalAtoll:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalServer(_Process, _Api):
    """`atoll server` in a subprocess (no worker of its own)."""

    def __init__(
        self,
        home: str | os.PathLike,
        port: int | None = None,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
    ):
        _Process.__init__(self, home, env, log_path, "atoll-server.log")
        self.port = port or free_port()
        self.api_key = api_key or "test_" + secrets.token_hex(12)
        tls = bool((env or {}).get("ATOLL_TLS_NAMES"))
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        if tls:  # (ATOLL_TLS_NAMES must then name 127.0.0.1)
            self.tls_ca = self.ca_file
        self.ingress_port = int((env or {}).get("ATOLL_INGRESS_PORT") or free_port())
        self.e2b_port = _e2b_port(env)
        self.argv = ["server"]

    @property
    def ca_file(self) -> str:
        """The installation CA (made at the first start): what a worker's --ca-file names."""
        return os.path.join(self.home, "ca", "root.crt")

    def _environment(self) -> dict[str, str]:
        return {
            **super()._environment(),
            "ATOLL_PORT": str(self.port),
            "ATOLL_API_KEY": self.api_key,
            "ATOLL_INGRESS_PORT": str(self.ingress_port),
            "ATOLL_E2B_PORT": str(self.e2b_port),
        }

    def start(self, timeout: float = 60) -> LocalServer:
        """Start and wait until it answers (healthy needs a worker: see LocalCluster)."""
        self.spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.exited()
            if rc is not None:
                raise RuntimeError(f"atoll server exited with {rc}; see {self.log_path}:\n{self.tail()}")
            try:
                if not (self.url.startswith("https://") and not os.path.exists(self.ca_file)):
                    httpx.get(self.url + "/healthz", timeout=1, verify=self.verify)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"atoll server did not answer within {timeout}s; see {self.log_path}")


class LocalWorker(_Process):
    """`atoll worker --server URL --name NAME` in a subprocess, with a home of its own.

    It registers with `api_key`, or, with `worker_key=True` (LocalCluster's workers), with a
    `worker`-scope key it makes through the API at its first start (`POST /v1/keys`, under the
    admin `api_key`, at the first of its servers): as a real deployment does. `api_key` stays what
    it reads the server's worker list with."""

    def __init__(
        self,
        home: str | os.PathLike,
        server_url: str,
        api_key: str,
        name: str,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        listen: str | None = None,
        ca_file: str | None = None,
        worker_key: bool = False,
    ):
        _Process.__init__(self, home, env, log_path, "atoll-worker.log")
        self.server_url = server_url
        self.api_key = api_key
        self.name = name
        self.ca_file = ca_file
        self.mint_key = worker_key
        self.worker_key: str | None = None
        """The worker-scope key it registers with (`worker_key=True`), made at its first start."""
        self.argv = [
            "worker",
            "--server",
            server_url,
            "--name",
            name,
            *(["--listen", listen] if listen else []),
            *(["--ca-file", ca_file] if ca_file else []),
        ]

    def _environment(self) -> dict[str, str]:
        env = {**super()._environment(), "ATOLL_API_KEY": self.worker_key or self.api_key}
        env.pop("ATOLL_PORT", None)
        return env

    def start(self) -> LocalWorker:
        if self.mint_key and self.worker_key is None:
            self.worker_key = self._make_worker_key()
        self.spawn()
        return self

    def _make_worker_key(self) -> str:
        url = self.server_url.split(",")[0].strip()
        r = httpx.post(
            url + "/v1/keys",
            json={"scope": "worker"},
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=30,
            verify=self.verify,
        )
        if r.status_code != 201:
            raise RuntimeError(
                f"making a worker key for {self.name} at {url} failed: {r.status_code} {r.text}"
            )
        return r.json()["key"]

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """httpx's `verify=` for its server (the --ca-file, read when it is asked)."""
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else True

    def worker_state(self) -> str | None:
        """This worker's state at the server (None if the server does not list it)."""
        try:
            r = httpx.get(
                self.server_url + "/v1/workers",
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=5,
                verify=self.verify,
            )
            for w in r.json().get("items", []):
                if w["name"] == self.name:
                    return w["state"]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        return None

    def wait_state(self, state: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.exited()
            if rc is not None:
                raise RuntimeError(
                    f"atoll worker {self.name} exited with {rc}; see {self.log_path}:\n{self.tail()}"
                )
            if self.worker_state() == state:
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"worker {self.name} did not become {state} within {timeout}s; see {self.log_path}"
        )


class LocalEdge(_Process):
    """`atoll edge --server URL` in a subprocess: the data path straight to the workers."""

    def __init__(
        self,
        home: str | os.PathLike,
        server_url: str,
        port: int | None = None,
        ca_file: str | None = None,
        env: dict[str, str] | None = None,
    ):
        _Process.__init__(self, home, env, None, "atoll-edge.log")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = ["edge", "--server", server_url, "--port", str(self.port)]
        if ca_file:
            self.argv += ["--ca-file", ca_file]

    def start(self, timeout: float = 60) -> LocalEdge:
        """Start and wait until it answers /healthz."""
        self.spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.exited()
            if rc is not None:
                raise RuntimeError(f"atoll edge exited with {rc}; see {self.log_path}:\n{self.tail()}")
            try:
                httpx.get(self.url + "/healthz", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"atoll edge did not answer within {timeout}s; see {self.log_path}")


class LocalCluster(_Api):
    """`atoll server` plus `workers` separate `atoll worker` processes, each with its own home
    under `root` (`root/server`, `root/worker-<i>`).

    `home`, `log_path` and `proc` mirror LocalAtoll's for tests that look at the host: the first
    worker's home (where sandboxes, snapshots and template images live) and log, and the server's
    process."""

    def __init__(
        self,
        root: str | os.PathLike,
        workers: int = 1,
        env: dict[str, str] | None = None,
        reap: bool = True,
        api_key: str | None = None,
        tls: bool = False,
    ):
        """`tls`: the server serves https with a certificate from its CA for 127.0.0.1, and each
        worker joins it with `--ca-file` (and serves its own API over TLS)."""
        self.root = os.fspath(root)
        self.env = env or {}
        self.reap = reap
        server_env = {**self.env, "ATOLL_TLS_NAMES": "127.0.0.1,localhost"} if tls else self.env
        self.server = LocalServer(os.path.join(self.root, "server"), api_key=api_key, env=server_env)
        self.url, self.api_key, self.tls_ca = self.server.url, self.server.api_key, self.server.tls_ca
        ca = self.server.ca_file if tls else None
        self.workers = [
            LocalWorker(
                os.path.join(self.root, f"worker-{i}"),
                self.url,
                self.api_key,
                f"w{i}",
                env=self.env,
                ca_file=ca,
                worker_key=True,
            )
            for i in range(workers)
        ]

    @property
    def home(self) -> str:
        return self.workers[0].home if self.workers else self.server.home

    @property
    def log_path(self) -> str:
        return self.workers[0].log_path if self.workers else self.server.log_path

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.proc

    def tail(self, n: int = 40) -> str:
        return "".join(p.tail(n) for p in (self.server, *self.workers))

    def start(self, timeout: float = 600) -> LocalCluster:
        self.server.start()
        for w in self.workers:
            w.start()

        def alive() -> str | None:
            for p in (self.server, *self.workers):
                rc = p.exited()
                if rc is not None:
                    return f"{' '.join(p.argv[:1])} exited with {rc}; see {p.log_path}:\n{p.tail()}"
            return None

        try:
            self.wait_healthy(timeout, alive)
            for w in self.workers:
                w.wait_state("ready", timeout)
        except RuntimeError:
            self.stop(reap=False)
            raise
        return self

    def stop(self, reap: bool | None = None, timeout: float = 30) -> None:
        reap = self.reap if reap is None else reap
        if reap and self.server.proc is not None:
            deleted = self.delete_all()
            for w in self.workers:
                if w.proc is not None:
                    self.wait_no_sandboxes(w.home, ids=deleted)
        for w in self.workers:
            w.terminate(timeout)
        self.server.terminate(timeout)
        if reap:
            for w in self.workers:
                purge(w.home)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
