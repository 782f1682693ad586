"""GENERATED FILE - do not edit. `client.sandboxes` (create, get, list, connect, fork) and `Sandbox`: one sandbox's calls.

Generated from `_async/sandboxes.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from atoll import errors
from atoll.shared import ndjson

from .. import _base
from .._models import (
    ExecResult,
    Preview,
    SandboxFields,
    SandboxMetrics,
    Snapshot,
)
from ._parents import ClientLike
from .files import Files
from .processes import Process, Processes
from .terminal import Terminal


class Sandboxes:
    """`client.sandboxes`: create, look up, list and delete sandboxes."""

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    def create(
        self,
        template: str = "base",
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        idle_timeout_s: float | None = None,
        disk_after_s: float | None = None,
        memory_mb: int | None = None,
        cpus: float | None = None,
        user: str | None = None,
        disk_mb: int | None = None,
        network: Mapping[str, Sequence[str]] | None = None,
        secrets: Mapping[str, str] | None = None,
        *,
        timeout_s: float | None = None,
        on_timeout: Literal["pause", "delete"] | None = None,
        request_timeout: float | None = None,
        timeout: None = None,
        shell: str | None = None,
        volumes: Sequence[Mapping[str, Any]] | None = None,
        drives: Sequence[Mapping[str, Any]] | None = None,
        standby: Mapping[str, float] | None = None,
        idempotency_key: str | None = None,
        on_worker_lost: Literal["fail", "restore"] | None = None,
        snapshot: str | None = None,
    ) -> Sandbox:
        """Create a sandbox and return it once running.

        Only the arguments given are sent; the server fills in its defaults. The first
        sandbox of a template may take a minute (the template is built), hence the long
        default `timeout` (the client's `create_timeout`). `network` is its egress policy,
        `{"allow_out": ["pypi.org", "*.github.com:443", "10.0.0.0/8"], "deny_out": [...]}`;
        without it the sandbox has no way out. `secrets` maps environment variables to stored
        secrets, `{"OPENAI_API_KEY": "openai"}`: the sandbox sees a placeholder, which its egress
        gateway replaces with the value in requests to the secret's hosts.

        `timeout_s` is the sandbox's lifetime in seconds (none by default; extend it with
        `sandbox.update(timeout_s=...)`); at its end `on_timeout` happens: "pause" (to the disk
        tier, the default) or "delete". `request_timeout` is this call's HTTP timeout (default
        the client's `create_timeout`). `timeout=` is refused with a TypeError. `shell` runs its
        string commands: "bash" (`bash -l -c`) or "sh" (default: bash when the template has it).
        `volumes` and `drives` mount stores, `[{"name": "data", "path": "/data", "read_only": False}]`
        (a volume has one holder at a time; the sandbox then boots cold).
        `standby` is its standby policy, `{"memory_s": 15, "disk_s": 300, "archive_after_s":
        86400}`: seconds idle before the memory tier, then in memory before disk, then in standby
        before the archive tier (0 = never; memory_s and disk_s are idle_timeout_s and disk_after_s).
        `idempotency_key` (1-255 printable ASCII characters, e.g. a UUID) makes a retry safe: the
        same key with the same arguments within 24 h returns the sandbox the first call made.
        `on_worker_lost` is what happens to it, running or in the memory/disk tier, once its
        worker has been lost for the server's ATOLL_WORKER_GONE_S: "fail" (the default) or
        "restore" (back on another worker from its last archive; what changed since is lost).
        `snapshot` (an id or name, `sandbox.snapshot()`) starts it from that snapshot instead of a
        template: its files, and for a memory snapshot its memory and processes; it takes the
        snapshot's template (`template` is not sent unless changed from "base"), and a memory
        snapshot's memory_mb.
        """
        _base.refuse_timeout("sandboxes.create()", timeout)
        body = _base.without_none(
            template=None if snapshot is not None and template == "base" else template,
            snapshot=snapshot,
            env=dict(env) if env is not None else None,
            metadata=dict(metadata) if metadata is not None else None,
            idle_timeout_s=idle_timeout_s,
            disk_after_s=disk_after_s,
            memory_mb=memory_mb,
            cpus=cpus,
            user=user,
            disk_mb=disk_mb,
            network={k: list(v) for k, v in network.items()} if network is not None else None,
            secrets=dict(secrets) if secrets is not None else None,
            timeout_s=timeout_s,
            on_timeout=on_timeout,
            shell=shell,
            volumes=[dict(v) for v in volumes] if volumes is not None else None,
            drives=[dict(d) for d in drives] if drives is not None else None,
            standby=dict(standby) if standby is not None else None,
            on_worker_lost=on_worker_lost,
        )
        response = self._client._request(
            "POST",
            "/v1/sandboxes",
            json=body,
            headers={"Idempotency-Key": idempotency_key} if idempotency_key is not None else None,
            timeout=request_timeout if request_timeout is not None else self._client.create_timeout,
        )
        return Sandbox(self._client, _base.json_body(response))

    def connect(self, sandbox_id: str) -> Sandbox:
        """The sandbox `sandbox_id`, resumed (state running) if it was in standby."""
        response = self._client._request(
            "POST", _base.sandbox_path(sandbox_id, "resume"), timeout=self._client.create_timeout
        )
        return Sandbox(self._client, _base.json_body(response))

    def get(self, sandbox_id: str) -> Sandbox:
        response = self._client._request("GET", _base.sandbox_path(sandbox_id))
        return Sandbox(self._client, _base.json_body(response))

    def list(
        self,
        state: str | Sequence[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        *,
        order: str | None = None,
        created_after: str | datetime.datetime | None = None,
        created_before: str | datetime.datetime | None = None,
    ) -> list[Sandbox]:
        """Sandboxes, optionally only those in `state` (one, or a list: any of them) whose
        metadata has all the given pairs, created in a window; oldest first, or newest first
        with `order="desc"`."""
        params = _base.list_params(
            state, metadata, order=order, created_after=created_after, created_before=created_before
        )
        items = self._client._items("/v1/sandboxes", params)
        return [Sandbox(self._client, item) for item in items]

    def delete(self, sandbox_id: str) -> None:
        self._client._request("DELETE", _base.sandbox_path(sandbox_id))


class Sandbox(SandboxFields):
    """One sandbox. Attributes mirror the server's sandbox object (see `SandboxFields`);
    methods that get a sandbox object back (`refresh`, `pause`, `resume`) update it in place.
    Used as a context manager, the sandbox is deleted on exit.
    """

    def __init__(self, client: ClientLike, data: Mapping[str, Any]) -> None:
        self._client = client
        self.data = dict(data)
        self.files = Files(self)
        self.processes = Processes(self)

    def _path(self, *rest: str) -> str:
        return _base.sandbox_path(self.id, *rest)

    def refresh(self) -> Sandbox:
        """Re-read the sandbox from the server."""
        response = self._client._request("GET", self._path())
        self._update(_base.json_body(response))
        return self

    def pause(self, tier: str = "memory") -> Sandbox:
        """Put the sandbox in standby: "memory" (fast resume), "disk" (frees the memory) or
        "archive" (frees the worker's disk too: the sandbox goes to the object store; the slowest
        resume). `standby_reason` says why it stayed in a warmer tier."""
        response = self._client._request(
            "POST", self._path("pause"), json={"tier": tier}, timeout=self._client.create_timeout
        )
        self._update(_base.json_body(response))
        return self

    def set_network(
        self, allow_out: Sequence[str] = (), deny_out: Sequence[str] = ()
    ) -> dict[str, list[str]]:
        """Replace the egress policy, live (new connections follow it at once); returns it as
        the server normalized it."""
        response = self._client._request(
            "PUT", self._path("network"), json={"allow_out": list(allow_out), "deny_out": list(deny_out)}
        )
        policy = _base.json_body(response)
        self.data["network"] = policy
        return policy

    def preview(self, port: int, expires_in_s: float | None = None) -> Preview:
        """The preview URL of `port` (served by the ingress router, over TLS) with the sandbox's
        access token and a signed URL (valid `expires_in_s`, default an hour). A request to it
        resumes the sandbox from standby."""
        params = {"expires_in_s": str(expires_in_s)} if expires_in_s is not None else None
        response = self._client._request("GET", self._path("preview", str(int(port))), params=params)
        return Preview(_base.json_body(response))

    def set_preview(self, port: int, public: bool) -> Preview:
        """Make `port` public (no token needed) or private again."""
        response = self._client._request(
            "PUT", self._path("preview", str(int(port))), json={"public": bool(public)}
        )
        return Preview(_base.json_body(response))

    def fork(self, count: int = 1) -> list[Sandbox]:
        """`count` copies (1-50) of this running sandbox from one checkpoint; it keeps running.
        Each copy has its own id, hostname and generation; user-space state (a seeded `random`,
        open files, processes) is duplicated — programs notice a restore through
        /run/atoll/identity.json (see `atoll.guest.on_restore`)."""
        response = self._client._request(
            "POST",
            self._path("fork"),
            json={"count": count},
            timeout=self._client.create_timeout,
        )
        return [Sandbox(self._client, item) for item in _base.items(response)]

    def snapshot(self, name: str | None = None, *, memory: bool = True, replace: bool = False) -> Snapshot:
        """Keep this sandbox's state as a named snapshot on its worker (it is checkpointed once and
        runs on, as for a fork): its files, and unless `memory` is False its memory and running
        processes. `client.sandboxes.create(snapshot=...)` makes sandboxes from it (by id or name).
        A `name` in use is `Conflict`, unless `replace`: then the name moves to this snapshot and
        the one that had it is deleted."""
        response = self._client._request(
            "POST",
            self._path("snapshots"),
            json=_base.without_none(name=name, memory=memory, replace=replace or None),
            timeout=self._client.create_timeout,
        )
        return Snapshot(_base.json_body(response))

    def resume(self) -> Sandbox:
        """Bring the sandbox back from standby with its memory and processes intact."""
        response = self._client._request("POST", self._path("resume"), timeout=self._client.create_timeout)
        self._update(_base.json_body(response))
        return self

    def delete(self) -> None:
        self._client._request("DELETE", self._path())
        self.data["state"] = "deleted"

    def update(
        self,
        *,
        idle_timeout_s: float | None = None,
        disk_after_s: float | None = None,
        archive_after_s: float | None = None,
        timeout_s: float | None = _base.UNSET,
        on_timeout: Literal["pause", "delete"] | None = None,
        metadata: Mapping[str, str] | None = None,
        on_worker_lost: Literal["fail", "restore"] | None = None,
    ) -> Sandbox:
        """Change settings live (PATCH), in any state, without resuming it; only the arguments
        given change. `timeout_s` sets the lifetime to that many seconds from now (extend it);
        `timeout_s=None` removes it. `metadata` replaces the labels. `on_worker_lost`: see
        `sandboxes.create`."""
        body = _base.without_none(
            idle_timeout_s=idle_timeout_s,
            disk_after_s=disk_after_s,
            archive_after_s=archive_after_s,
            on_timeout=on_timeout,
            on_worker_lost=on_worker_lost,
            metadata=dict(metadata) if metadata is not None else None,
        )
        if timeout_s is not _base.UNSET:
            body["timeout_s"] = timeout_s
        response = self._client._request("PATCH", self._path(), json=body)
        self._update(_base.json_body(response))
        return self

    def metrics(self) -> SandboxMetrics:
        """CPU, memory, disk and process figures now; a sandbox in standby is not woken."""
        response = self._client._request("GET", self._path("metrics"))
        return SandboxMetrics(_base.json_body(response))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.delete()
        except errors.SandboxNotFound:
            pass

    @overload
    def exec(
        self,
        cmd: str | Sequence[str],
        background: Literal[False] = False,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: _base.TextCallback | None = None,
        on_stderr: _base.TextCallback | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
        stdin: str | None = None,
        check: bool = False,
        shell: str | None = None,
    ) -> ExecResult: ...

    @overload
    def exec(
        self,
        cmd: str | Sequence[str],
        background: Literal[True],
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: None = None,
        on_stderr: None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
        stdin: str | None = None,
        check: bool = False,
        shell: str | None = None,
    ) -> Process: ...

    @overload
    def exec(
        self,
        cmd: str | Sequence[str],
        background: bool = False,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: _base.TextCallback | None = None,
        on_stderr: _base.TextCallback | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
        stdin: str | None = None,
        check: bool = False,
        shell: str | None = None,
    ) -> ExecResult | Process: ...

    def exec(
        self,
        cmd: str | Sequence[str],
        background: bool = False,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: _base.TextCallback | None = None,
        on_stderr: _base.TextCallback | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
        stdin: str | None = None,
        check: bool = False,
        shell: str | None = None,
    ) -> ExecResult | Process:
        """Run a command: a string goes through the shell, a list is an argv.

        A string runs with `bash -l -c` when the sandbox has bash, else `sh -c`; `shell` ("bash"
        or "sh") picks one for this call (default: the sandbox's `shell`). `stdin` is text fed to
        the command, then its stdin is closed (default: /dev/null; a background process started
        without it keeps a stdin pipe for `process.send_stdin`). With `check=True` a command that
        exits non-zero (or times out) raises `atoll.errors.CommandFailed` (`.exit_code`,
        `.stdout`, `.stderr`).

        Returns an `ExecResult`. With `on_stdout` / `on_stderr` the output is streamed and
        each chunk of text is passed to the callback as it arrives (the result still holds
        the whole output). With `background=True` returns at once with a process handle.
        A sandbox in standby is resumed by the server first.

        Without callbacks the server keeps at most `max_output_bytes` of each stream (default and
        upper bound: its ATOLL_MAX_EXEC_OUTPUT_KB, 1 MiB unless configured): the first and the last
        half, with a marker between; `ExecResult.stdout_truncated_bytes` / `stderr_truncated_bytes`
        say how much was left out. Streamed output (callbacks) is never cut.
        """
        body = _base.exec_body(
            cmd,
            background=background,
            timeout_s=timeout_s,
            cwd=cwd,
            env=env,
            user=user,
            max_output_bytes=max_output_bytes,
            stdin=stdin,
            shell=shell,
        )
        if background:
            if on_stdout is not None or on_stderr is not None:
                raise ValueError("on_stdout/on_stderr cannot be used with background=True")
            if check:
                raise ValueError("check=True needs the exit code: use process.wait() with background=True")
            response = self._client._request("POST", self._path("exec"), json=body)
            data = _base.json_body(response)
            return Process(self, int(data["pid"]), data)
        http_timeout = _base.exec_timeout(timeout_s, self._client.timeout)
        if on_stdout is None and on_stderr is None:
            response = self._client._request("POST", self._path("exec"), json=body, timeout=http_timeout)
            return _checked(ExecResult.from_json(_base.json_body(response)), cmd, check)
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        decoder = _base.ExecStream()
        with self._client._stream(
            "POST", self._path("exec"), json=body, headers={"Accept": _base.NDJSON}, timeout=http_timeout
        ) as response:
            if _base.is_ndjson(response):
                for line in ndjson.lines(response.iter_bytes()):
                    for name, text in decoder.feed(line):
                        callback = callbacks[name]
                        if callback is not None:
                            _base.call_callback(callback, text)
            else:
                # A server that ignores Accept answers with the whole result at once.
                response.read()
                for name, text in decoder.feed_object(_base.json_body(response)):
                    callback = callbacks[name]
                    if callback is not None:
                        _base.call_callback(callback, text)
        return _checked(decoder.result(), cmd, check)

    # ---- terminals ----------------------------------------------------------------------------
    def pty(
        self,
        cols: int = 80,
        rows: int = 24,
        *,
        term: str | None = None,
        cmd: str | Sequence[str] | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Terminal:
        """Open a terminal session (default: the user's login shell; a string `cmd` runs with that
        shell's -c) and attach to it. Closing the terminal detaches; the session lives on until its
        program ends or `kill_pty`, and `pty_attach(terminal.pty_id)` attaches again."""
        body = _base.pty_body(cols, rows, term, cmd, cwd, env)
        response = self._client._request(
            "POST", self._path("pty"), json=body, timeout=self._client.create_timeout
        )
        return self.pty_attach(str(_base.json_body(response)["pty_id"]))

    def pty_attach(self, pty_id: str) -> Terminal:
        """Attach to a terminal session: its recent output (64 KiB) is replayed first."""
        # websockets is imported here, not at the top: it costs a CLI start ~100 ms (its version
        # module reads importlib.metadata) and only terminals use it.
        from websockets import exceptions as ws_errors
        from websockets.sync.client import connect as ws_connect

        base_url, verify = self._client._ws_base(self._path("pty", pty_id, "ws"))
        url = _base.ws_url(base_url, self._path("pty", pty_id, "ws"))
        config = self._client._config
        try:
            ws = ws_connect(
                url,
                additional_headers=config.headers(),
                open_timeout=self._client.create_timeout,
                compression=None,
                max_size=None,
                ssl=_base.ws_ssl_sync(url, verify),
            )
        except ws_errors.InvalidStatus as exc:
            raise _base.ws_refused(exc.response.status_code, exc.response.body, url) from exc
        except (OSError, TimeoutError, ws_errors.InvalidHandshake) as exc:
            failure = _base.certificate_failure(exc)
            if failure is not None:
                raise _base.certificate_error(failure, url, config.ca_file, config.ca_origin) from exc
            via = (
                f" (the atoll edge named by edge_url= or ${_base.ENV_EDGE_URL}: is it running?)"
                if base_url == self._client.edge_url
                else ""
            )
            raise errors.APIConnectionError(
                f"cannot open the terminal WebSocket {url}{via}: {type(exc).__name__}: {exc}"
            ) from exc
        ws.__enter__()  # the connection is ours to close (AsyncTerminal.close)
        terminal = Terminal(self, pty_id, ws)
        terminal._check_first()
        return terminal

    def ptys(self) -> list[dict[str, Any]]:
        """The sandbox's terminal sessions (running, and finished ones for a while)."""
        return self._client._items(self._path("pty"))

    def kill_pty(self, pty_id: str) -> None:
        """Kill a terminal session's programs and forget it."""
        self._client._request("DELETE", self._path("pty", pty_id))

    def kill_process(self, pid: int) -> None:
        """Kill a background process (and its process group)."""
        self._client._request("DELETE", self._path("processes", str(int(pid))))


def _checked(result: ExecResult, cmd: Any, check: bool) -> ExecResult:
    if check and not result.ok:
        raise errors.CommandFailed(result, cmd)
    return result
