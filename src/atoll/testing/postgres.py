"""A private PostgreSQL cluster for tests and benchmarks: `initdb` into a temporary directory, a
postmaster on a free 127.0.0.1 port (and a unix socket in that directory), stopped by its PID and
removed afterwards.

    with atoll.testing.postgres.PostgresCluster() as pg:
        url = pg.create_database("t1")          # postgresql://atoll:…@127.0.0.1:PORT/t1
        # ATOLL_DATABASE_URL=url for `atoll server`, or FakeAtoll(tmp, database_url=url)

PostgreSQL refuses to run as root: as root the cluster's files belong to the `postgres` user (the
Debian packages make it) and initdb and the postmaster run as that user; as anyone else, as that
user. Only loopback and the socket listen; connections over TCP need the cluster's password
(scram-sha-256), over the socket (mode 0700) they are trusted. The cluster is tuned for tests,
not for keeping data: no fsync, no synchronous commit (a crash of the machine loses it; it is
removed at stop anyway).

`migrated_template()` makes a database brought to the newest Alembic revision once, so that each
test's `create_database(name, template=...)` is a file copy rather than fifteen migrations.
Used by tests/conftest.py (the `postgres` session fixture), tests/integration and
`python -m atoll.testing.postgres` (prints an ATOLL_DATABASE_URL and runs until Ctrl-C).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import typing

SUPERUSER = "atoll"
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


class PostgresMissing(RuntimeError):
    """The PostgreSQL server programs (initdb, postgres) are not installed."""


def bindir() -> str:
    """Where `initdb` and `postgres` are: $ATOLL_PG_BINDIR, else the newest
    /usr/lib/postgresql/*/bin (Debian's layout), else PATH."""
    found = os.environ.get("ATOLL_PG_BINDIR")
    if found:
        if not os.access(os.path.join(found, "initdb"), os.X_OK):
            raise PostgresMissing(f"ATOLL_PG_BINDIR={found!r} holds no executable initdb")
        return found
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
    )
    if versions:
        return os.path.dirname(versions[-1])
    initdb = shutil.which("initdb")
    if initdb and shutil.which("postgres"):
        return os.path.dirname(initdb)
    raise PostgresMissing(
        "PostgreSQL's server programs (initdb, postgres) are not installed: run `make install` "
        "(scripts/install-deps.sh installs the Debian package `postgresql`), or "
        "`apt-get install postgresql`, or point ATOLL_PG_BINDIR at their directory"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """One private cluster: `start()` (or `with`), `url(dbname)`, `create_database`, `stop()`."""

    def __init__(self, *, run_as: str | None = None, synchronous_commit: bool = False):
        """`synchronous_commit`: a commit is acknowledged once its WAL is written (PostgreSQL's
        default) — for tests that crash the postmaster (`down()`) and count what survived; off
        (faster) for the rest, where a commit acknowledged but lost in a crash never matters."""
        self.bindir = bindir()
        self.synchronous_commit = synchronous_commit
        if run_as is None and os.geteuid() == 0:
            run_as = "postgres"
        self.run_as = run_as
        self.password = secrets.token_hex(16)
        self.port = 0
        self.dir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self._admin: typing.Any = None  # psycopg.Connection (psycopg is imported when first used)

    # ---- paths and URLs ---------------------------------------------------------------------
    @property
    def data_dir(self) -> str:
        assert self.dir is not None, "the cluster is not started"
        return os.path.join(self.dir, "data")

    @property
    def socket_dir(self) -> str:
        assert self.dir is not None, "the cluster is not started"
        return os.path.join(self.dir, "sock")

    @property
    def log_path(self) -> str:
        assert self.dir is not None, "the cluster is not started"
        return os.path.join(self.dir, "postgres.log")

    def url(self, dbname: str = "postgres") -> str:
        """A `postgresql://` URL of database `dbname` over TCP on loopback (with the password)."""
        return f"postgresql://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{dbname}"

    def socket_url(self, dbname: str = "postgres") -> str:
        """The same database over the cluster's unix socket (trusted, no password)."""
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.socket_dir}&port={self.port}"

    # ---- start and stop ---------------------------------------------------------------------
    def _popen_user(self) -> dict:
        if self.run_as is None:
            return {}
        pw = pwd.getpwnam(self.run_as)
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}

    def _chown(self, path: str) -> None:
        if self.run_as is not None:
            pw = pwd.getpwnam(self.run_as)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def start(self, timeout: float = 60.0) -> PostgresCluster:
        if self.run_as is not None:
            try:
                pwd.getpwnam(self.run_as)
            except KeyError:
                raise PostgresMissing(
                    f"there is no user {self.run_as!r} to run PostgreSQL as (it refuses to run as root); "
                    "the Debian package `postgresql` makes it"
                ) from None
        # its own short path (a unix socket's path is at most 107 bytes), reachable by run_as
        self.dir = tempfile.mkdtemp(prefix="atoll-pg-")
        self._chown(self.dir)
        for sub in ("data", "sock"):
            os.mkdir(os.path.join(self.dir, sub), 0o700)
            self._chown(os.path.join(self.dir, sub))
        pwfile = os.path.join(self.dir, "pw")
        with open(pwfile, "w") as f:
            f.write(self.password + "\n")
        self._chown(pwfile)
        try:
            self._run(
                "initdb",
                "-D",
                self.data_dir,
                "-U",
                SUPERUSER,
                f"--pwfile={pwfile}",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            )
            os.unlink(pwfile)
            for attempt in range(3):
                self.port = _free_port()
                if self._spawn(timeout):
                    return self
                if "could not bind" not in self._log_tail() or attempt == 2:
                    break  # not a port taken meanwhile: say why
            raise RuntimeError(f"PostgreSQL did not start; its log ({self.log_path}):\n{self._log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _run(self, prog: str, *args: str) -> None:
        r = subprocess.run(
            [os.path.join(self.bindir, prog), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=self.dir,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C", "LC_ALL": "C"},
            **self._popen_user(),
        )
        if r.returncode != 0:
            raise RuntimeError(f"{prog} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")

    def _spawn(self, timeout: float) -> bool:
        """Start the postmaster and wait until it takes connections; False if it exited."""
        log = open(self.log_path, "ab")
        self._chown(self.log_path)
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": self.socket_dir,
            "unix_socket_permissions": "0700",
            "fsync": "off",
            "synchronous_commit": "on" if self.synchronous_commit else "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "shared_buffers": "32MB",
            "timezone": "UTC",
            "log_min_messages": "warning",
        }
        argv = [os.path.join(self.bindir, "postgres"), "-D", self.data_dir]
        for k, v in settings.items():
            argv += ["-c", f"{k}={v}"]
        with log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.dir,
                start_new_session=True,  # Ctrl-C of the test run reaches it through stop() only
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C", "LC_ALL": "C"},
                **self._popen_user(),
            )
        self.pid = self.proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = self.pid = None
                return False
            if self._ready():
                return True
            time.sleep(0.05)
        raise TimeoutError(f"PostgreSQL took over {timeout:.0f} s to start; its log ({self.log_path})")

    def _ready(self) -> bool:
        """The postmaster's pid file says `ready` (its last line), so connections are accepted."""
        try:
            with open(os.path.join(self.data_dir, "postmaster.pid")) as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        return len(lines) >= 8 and lines[7].strip() == "ready" and lines[0].strip() == str(self.pid)

    def _log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def down(self, immediate: bool = True, timeout: float = 15.0) -> None:
        """Stop the postmaster and keep the cluster (its data, port and password), for `up()`:
        `immediate` is PostgreSQL's crash-like immediate shutdown (SIGQUIT: connections cut, no
        checkpoint, recovery at the next start), else a fast one (SIGINT)."""
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None
        proc, self.proc, self.pid = self.proc, None, None
        if proc is not None:
            first = signal.SIGQUIT if immediate else signal.SIGINT
            for sig, wait in ((first, timeout), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def up(self, timeout: float = 60.0) -> None:
        """Start the postmaster again after `down()`, on the same port and data."""
        assert self.proc is None and self.dir is not None, "up() follows down()"
        if not self._spawn(timeout):
            raise RuntimeError(
                f"PostgreSQL did not start again; its log ({self.log_path}):\n{self._log_tail()}"
            )

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the postmaster this object started (fast shutdown: SIGINT to its PID; SIGQUIT and
        then SIGKILL if it does not exit) and remove the cluster's directory."""
        self.down(immediate=False, timeout=timeout)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> PostgresCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- databases --------------------------------------------------------------------------
    def execute(self, sql: str) -> None:
        """Run one statement outside a transaction (CREATE/DROP DATABASE) as the superuser, in
        database `postgres`, on a connection kept open for the next."""
        import psycopg

        if self._admin is None or self._admin.closed:
            self._admin = psycopg.connect(
                host=self.socket_dir, port=self.port, user=SUPERUSER, dbname="postgres", autocommit=True
            )
        self._admin.execute(sql)  # type: ignore[arg-type]  # identifiers checked by the callers

    def create_database(self, name: str, template: str | None = None) -> str:
        """CREATE DATABASE `name` (a copy of `template` when given); its URL."""
        for n in (name, template):
            if n is not None and not _NAME.fullmatch(n):
                raise ValueError(f"database name {n!r} is not [a-z_][a-z0-9_]* (at most 63 characters)")
        self.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"database name {name!r} is not [a-z_][a-z0-9_]*")
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def migrated_template(self, name: str = "atoll_template") -> str:
        """Make database `name` with atoll's records schema at the newest Alembic revision (no
        connection left open, so it can be copied); its name."""
        from atoll.controlplane import db as dbm

        self.create_database(name)
        database = dbm.open_database(self.url(name))
        database.engine.dispose()
        return name


def main() -> None:
    """`python -m atoll.testing.postgres`: start a cluster with one database `atoll`, print
    `ATOLL_DATABASE_URL=…` and keep it until Ctrl-C or SIGTERM."""
    with PostgresCluster() as pg:
        print(f"ATOLL_DATABASE_URL={pg.create_database('atoll')}", flush=True)
        stop = False

        def _stop(*_: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        while not stop:
            time.sleep(0.2)


if __name__ == "__main__":
    main()
