"""GENERATED FILE - do not edit. The synchronous atoll client: `Client`, `Sandbox`, its files and processes.

Generated from `_async.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach it as `atoll.Client`; the CLI
(`atoll.cli.main`) uses it too.
"""

from __future__ import annotations

import json
import json as _json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any, Literal, overload

import httpx
from websockets import exceptions as ws_errors
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from atoll import errors
from atoll._client import _base, _tar
from atoll._client._models import (
    ExecResult,
    FileEntry,
    FileEvent,
    FileStat,
    OutputEvent,
    Preview,
    ProcessInfo,
    SandboxFields,
    SandboxMetrics,
    Secret,
    Template,
)

__all__ = [
    "Client",
    "Files",
    "Process",
    "Processes",
    "Sandbox",
    "Sandboxes",
    "Secrets",
    "Templates",
    "Watch",
    "Terminal",
    "Workers",
]


class Client:
    """Connection to an atoll server.

    `base_url` defaults to `$ATOLL_URL` or http://127.0.0.1:7080, `api_key` to
    `$ATOLL_API_KEY`. `request_timeout` (seconds) is the HTTP timeout of ordinary calls;
    `create_timeout` that of sandbox creation, connect, pause and resume, which may build a
    template or move memory to disk. (`timeout=` is the old name of `request_timeout` and still
    accepted here, with a DeprecationWarning; a sandbox's lifetime is `sandboxes.create(timeout_s=...)`,
    where `timeout=` is refused.) Idempotent calls (GET, PUT, DELETE, PATCH)
    are retried up to `retries` times on connection failures and 429/502/503/504 answers, with
    exponential backoff or the server's Retry-After; POSTs (exec, create) never are.
    `transport` replaces the HTTP transport (tests pass an `httpx.MockTransport`).
    Use it as a context manager, or close it when done.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        request_timeout: float = _base.DEFAULT_TIMEOUT,
        create_timeout: float = _base.DEFAULT_CREATE_TIMEOUT,
        retries: int = _base.DEFAULT_RETRIES,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        timeout: float | None = None,
    ) -> None:
        request_timeout = _base.deprecated_timeout(type(self).__name__ + "()", timeout, request_timeout)
        self._config = _base.resolve_config(base_url, api_key, request_timeout, create_timeout)
        self._retries = int(retries)
        self._http = httpx.Client(
            base_url=self._config.base_url,
            headers=self._config.headers(headers),
            timeout=request_timeout,
            transport=transport,
        )
        self.sandboxes = Sandboxes(self)
        self.templates = Templates(self)
        self.workers = Workers(self)
        self.secrets = Secrets(self)

    @property
    def base_url(self) -> str:
        return self._config.base_url

    @property
    def request_timeout(self) -> float:
        return self._config.timeout

    @property
    def timeout(self) -> float:
        """The same as `request_timeout` (read-only; kept for code that reads it)."""
        return self._config.timeout

    @property
    def retries(self) -> int:
        return self._retries

    @property
    def create_timeout(self) -> float:
        return self._config.create_timeout

    def health(self) -> dict[str, Any]:
        """The server's `/healthz` document, e.g. `{"status": "ok", ...}`."""
        response = self._request("GET", "/healthz")
        return _base.json_body(response)

    def ca_certificate(self) -> str:
        """The installation's root CA (PEM): trust it for preview URLs, e.g.
        `ssl.create_default_context(cadata=client.ca_certificate())`."""
        response = self._request("GET", "/v1/ca.crt")
        return response.text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one request; raise the mapped `AtollError` for any non-2xx answer. Idempotent
        methods are retried (see the class docstring; tenacity does the waiting)."""
        try:
            for attempt in _base.retrying(self._retries, method, content):
                with attempt:
                    response = self._http.request(
                        method,
                        path,
                        json=json,
                        params=params,
                        content=content,
                        headers=headers,
                        timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                    )
                    if response.status_code in _base.RETRY_STATUSES:
                        raise _base.RetryableStatus(response)
        except _base.RetryableStatus as exc:
            response = exc.response
        except httpx.TransportError as exc:
            raise _base.connection_error(exc, self.base_url) from exc
        _base.raise_for_status(response)
        return response

    @contextmanager
    def _stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> Iterator[httpx.Response]:
        """Send one request and yield the response unread, after checking its status. Opening an
        idempotent one is retried like `_request`; a stream that breaks later is not."""
        request = self._http.build_request(
            method,
            path,
            json=json,
            params=params,
            headers=headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
        try:
            for attempt in _base.retrying(self._retries, method):
                with attempt:
                    response = self._http.send(request, stream=True)
                    if response.status_code in _base.RETRY_STATUSES:
                        response.read()
                        response.close()
                        raise _base.RetryableStatus(response)
        except _base.RetryableStatus as exc:
            raise _base.error_from_response(exc.response) from None
        except httpx.TransportError as exc:
            raise _base.connection_error(exc, self.base_url) from exc
        try:
            if not response.is_success:
                response.read()
                raise _base.error_from_response(response)
            yield response
        except httpx.TransportError as exc:
            raise _base.connection_error(exc, self.base_url) from exc
        finally:
            response.close()


class Sandboxes:
    """`client.sandboxes`: create, look up, list and delete sandboxes."""

    def __init__(self, client: Client) -> None:
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
        """
        _base.refuse_timeout("sandboxes.create()", timeout)
        body = _base.without_none(
            template=template,
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
        )
        response = self._client._request(
            "POST",
            "/v1/sandboxes",
            json=body,
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

    def list(self, state: str | None = None, metadata: Mapping[str, str] | None = None) -> list[Sandbox]:
        """Sandboxes, optionally only those in `state` whose metadata has all the given pairs."""
        response = self._client._request("GET", "/v1/sandboxes", params=_base.list_params(state, metadata))
        return [Sandbox(self._client, item) for item in _base.items(response)]

    def delete(self, sandbox_id: str) -> None:
        self._client._request("DELETE", _base.sandbox_path(sandbox_id))


class Templates:
    """`client.templates`: build, inspect and delete templates, and size their warm pools."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> list[Template]:
        response = self._client._request("GET", "/v1/templates")
        return [Template(item) for item in _base.items(response)]

    def get(self, name: str) -> Template:
        response = self._client._request("GET", _base.template_path(name))
        return Template(_base.json_body(response))

    def delete(self, name: str) -> None:
        """Delete a template (its builds and pool); `Conflict` (template_in_use) while sandboxes use it."""
        self._client._request("DELETE", _base.template_path(name))

    def build(
        self,
        name: str,
        from_: str = "base",
        apt: Sequence[str] | None = None,
        pip: Sequence[str] | None = None,
        run: Sequence[str] | None = None,
        files: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        start: str | None = None,
        ready: Mapping[str, Any] | None = None,
        on_log: _base.TextCallback | None = None,
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> Template:
        """Build a template: `from_` ("base", another template, or "oci-archive:/path/on/the/worker"),
        then `apt` packages, `pip` packages, `files` ({path: text}), `run` commands, in that
        order; `env`, `workdir`, `user` for its sandboxes; `start` a long-running command kept
        running in its snapshot, `ready` ({"port": N} or {"cmd": "..."}) when it is ready. With
        `wait` (default) this returns once the build ends, calling `on_log` with each log line,
        and raises `BuildFailed` if it failed."""
        body = _base.without_none(
            name=name,
            **{"from": from_},
            apt=list(apt) if apt is not None else None,
            pip=list(pip) if pip is not None else None,
            run=list(run) if run is not None else None,
            files=dict(files) if files is not None else None,
            env=dict(env) if env is not None else None,
            workdir=workdir,
            user=user,
            start=start,
            ready=dict(ready) if ready is not None else None,
        )
        response = self._client._request("POST", "/v1/templates", json=body)
        started = _base.json_body(response)
        if not wait:
            return self.get(name)
        return self.wait(name, started["build_id"], on_log=on_log, timeout=timeout)

    def build_dockerfile(
        self,
        name: str,
        path_or_text: str,
        on_log: _base.TextCallback | None = None,
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> Template:
        """Build a template from a Dockerfile: a path to a Dockerfile (its directory is the build
        context for COPY/ADD), a path to a context directory holding one, or the text itself."""
        content, kind = _base.dockerfile_body(path_or_text)
        response = self._client._request(
            "POST", "/v1/templates", params={"name": name}, content=content, headers={"Content-Type": kind}
        )
        started = _base.json_body(response)
        if not wait:
            return self.get(name)
        return self.wait(name, started["build_id"], on_log=on_log, timeout=timeout)

    def wait(
        self,
        name: str,
        build_id: str,
        on_log: _base.TextCallback | None = None,
        timeout: float | None = None,
    ) -> Template:
        """Follow a build's log until it ends; the template, or `BuildFailed` with its error."""
        with self._client._stream(
            "GET", _base.template_path(name, "builds", build_id, "logs"), timeout=timeout or 3600.0
        ) as response:
            for line in response.iter_lines():
                if on_log is not None:
                    _base.call_callback(on_log, line)
        for _ in range(100):  # the record follows the worker's event within moments
            template = self.get(name)
            if template.build_id != build_id or template.status != "building":
                break
            _base.sleep(0.1)
        if template.status == "failed":
            raise errors.BuildFailed(
                f"build {build_id} of template {name!r} failed: {template.error}", build_id=build_id
            )
        return template

    def set_pool(
        self,
        name: str,
        min: int = 0,  # noqa: A002 - the API's own name
        max: int | None = None,  # noqa: A002
        schedule: Sequence[Mapping[str, Any]] | None = None,
        memory_mb: int | None = None,
    ) -> dict[str, Any]:
        """Keep `min`–`max` sandboxes of the template ready (frozen until a create claims one);
        `schedule` raises the floor in UTC windows: [{"from": "08:00", "to": "20:00", "min": 5}]."""
        body = _base.without_none(
            min=min,
            max=max,
            schedule=[dict(w) for w in schedule] if schedule is not None else None,
            memory_mb=memory_mb,
        )
        response = self._client._request("PUT", _base.template_path(name, "pool"), json=body)
        return _base.json_body(response)

    def get_pool(self, name: str) -> dict[str, Any]:
        response = self._client._request("GET", _base.template_path(name, "pool"))
        return _base.json_body(response)


class Secrets:
    """`client.secrets`: values sealed on the server, sent only by the egress gateway to their hosts."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, name: str, value: str, hosts: Sequence[str], *, allow_http: bool = False) -> Secret:
        """Store a secret bound to `hosts` (names such as "api.example.com" or "*.example.com");
        the value is never returned by the server. The gateway puts it only in HTTPS requests to
        those hosts, unless `allow_http` (then plain HTTP too: clear text on the wire)."""
        response = self._client._request(
            "POST",
            "/v1/secrets",
            json={"name": name, "value": value, "hosts": list(hosts), "allow_http": allow_http},
        )
        return Secret(_base.json_body(response))

    def replace(self, name: str, value: str, hosts: Sequence[str], *, allow_http: bool = False) -> Secret:
        """New value, hosts and allow_http (rotation); live sandboxes bound to it use them at once."""
        response = self._client._request(
            "PUT",
            _base.secret_path(name),
            json={"value": value, "hosts": list(hosts), "allow_http": allow_http},
        )
        return Secret(_base.json_body(response))

    def get(self, name: str) -> Secret:
        response = self._client._request("GET", _base.secret_path(name))
        return Secret(_base.json_body(response))

    def list(self) -> list[Secret]:
        response = self._client._request("GET", "/v1/secrets")
        return [Secret(item) for item in _base.items(response)]

    def delete(self, name: str) -> None:
        self._client._request("DELETE", _base.secret_path(name))


class Workers:
    """`client.workers`: the workers of the server (name, state, capacity, what they hold)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> list[dict[str, Any]]:
        response = self._client._request("GET", "/v1/workers")
        return _base.items(response)

    def get(self, worker_id: str) -> dict[str, Any]:
        response = self._client._request("GET", f"/v1/workers/{worker_id}")
        return _base.json_body(response)


class Sandbox(SandboxFields):
    """One sandbox. Attributes mirror the server's sandbox object (see `SandboxFields`);
    methods that get a sandbox object back (`refresh`, `pause`, `resume`) update it in place.
    Used as a context manager, the sandbox is deleted on exit.
    """

    def __init__(self, client: Client, data: Mapping[str, Any]) -> None:
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
        """Put the sandbox in standby: "memory" (fast resume) or "disk" (frees the memory)."""
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
        timeout_s: float | None = _base.UNSET,
        on_timeout: Literal["pause", "delete"] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Sandbox:
        """Change settings live (PATCH), in any state, without resuming it; only the arguments
        given change. `timeout_s` sets the lifetime to that many seconds from now (extend it);
        `timeout_s=None` removes it. `metadata` replaces the labels."""
        body = _base.without_none(
            idle_timeout_s=idle_timeout_s,
            disk_after_s=disk_after_s,
            on_timeout=on_timeout,
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
                for chunk in response.iter_bytes():
                    for name, text in decoder.feed_bytes(chunk):
                        callback = callbacks[name]
                        if callback is not None:
                            _base.call_callback(callback, text)
                for name, text in decoder.feed_bytes(b"", final=True):
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
        url = _base.ws_url(self._client.base_url, self._path("pty", pty_id, "ws"))
        try:
            ws = ws_connect(
                url,
                additional_headers=self._client._config.headers(),
                open_timeout=self._client.create_timeout,
                compression=None,
                max_size=None,
            )
        except ws_errors.InvalidStatus as exc:
            raise _base.ws_refused(exc.response.status_code, exc.response.body, url) from exc
        except (OSError, TimeoutError, ws_errors.InvalidHandshake) as exc:
            raise errors.APIConnectionError(
                f"cannot open the terminal WebSocket {url}: {type(exc).__name__}: {exc}"
            ) from exc
        ws.__enter__()  # the connection is ours to close (AsyncTerminal.close)
        terminal = Terminal(self, pty_id, ws)
        terminal._check_first()
        return terminal

    def ptys(self) -> list[dict[str, Any]]:
        """The sandbox's terminal sessions (running, and finished ones for a while)."""
        response = self._client._request("GET", self._path("pty"))
        return _base.items(response)

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


class Processes:
    """`sandbox.processes`: call it for the list (`await sandbox.processes()`), or `get(pid)` for a
    handle on one background process (also after the caller that started it went away)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def __call__(self) -> list[ProcessInfo]:
        return self.list()

    def list(self) -> list[ProcessInfo]:
        """The background processes started in this sandbox, running or finished."""
        response = self.sandbox._client._request("GET", self.sandbox._path("processes"))
        return [ProcessInfo(item) for item in _base.items(response)]

    def get(self, pid: int) -> Process:
        """A handle on process `pid` (`ProcessNotFound` if the sandbox has no such process)."""
        process = Process(self.sandbox, int(pid))
        process.info()
        return process


class Process:
    """Handle on a background process, returned by `sandbox.exec(..., background=True)` and
    `sandbox.processes.get(pid)`: its record (`info()`), `wait()`, `output()` from any offset,
    `send_stdin()` / `close_stdin()`, `signal()` and `kill()`. `data` is its last known record."""

    def __init__(self, sandbox: Sandbox, pid: int, data: Mapping[str, Any] | None = None) -> None:
        self.sandbox = sandbox
        self.pid = pid
        self.data = dict(data or {"pid": pid})
        self.offset = 0
        """The offset after the last output event `output()` yielded: where a reattach resumes."""

    def _path(self, *rest: str) -> str:
        return self.sandbox._path("processes", str(self.pid), *rest)

    @property
    def running(self) -> bool | None:
        """As of the last `info()`, `wait()` or `signal()` (None before any)."""
        return self.data.get("running")

    @property
    def exit_code(self) -> int | None:
        return self.data.get("exit_code")

    def kill(self) -> None:
        """SIGKILL its process group and forget it (its record and output are gone after)."""
        self.sandbox.kill_process(self.pid)

    def info(self) -> ProcessInfo:
        """Its record (`running`, `exit_code`, `stdin_open`, `output_bytes`, ...)."""
        response = self.sandbox._client._request("GET", self._path())
        self.data = _base.json_body(response)
        return ProcessInfo(self.data)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until it exits and return its exit code; `ProcessRunning` if it still runs after
        `timeout` seconds (None: no limit). The wait counts as activity: the sandbox stays up."""
        client = self.sandbox._client
        step = 60.0  # each call waits at most this long, so no HTTP timeout cuts a long wait
        left = timeout
        while True:
            this = step if left is None else min(step, left)
            try:
                response = client._request(
                    "POST", self._path("wait"), json={"timeout_s": this}, timeout=this + client.timeout
                )
            except errors.ProcessRunning:
                if left is not None:
                    left -= this
                    if left <= 0:
                        raise
                continue
            self.data = _base.json_body(response)
            return self.data.get("exit_code")

    def output(self, follow: bool = True, offset: int | None = None) -> Iterator[OutputEvent]:
        """Its output from byte `offset` (default: where the last `output()` of this handle
        stopped, else 0) as `OutputEvent`s: stdout/stderr pieces, then an `exit` event once it has
        exited. With `follow` it waits for more until the exit; without, it ends at the output so
        far. Leaving the loop early leaves the process running; `output(offset=e.offset)` with
        the last event's offset resumes with nothing lost or repeated."""
        start = self.offset if offset is None else int(offset)
        params = {"offset": str(start), "follow": "1" if follow else "0"}
        client = self.sandbox._client
        timeout = httpx.Timeout(client.timeout, read=None) if follow else client.timeout
        pending = b""
        with client._stream("GET", self._path("output"), params=params, timeout=timeout) as response:
            for chunk in response.iter_bytes():
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line.strip():
                        event = self._event(line)
                        self.offset = event.offset
                        yield event
            if pending.strip():
                event = self._event(pending)
                self.offset = event.offset
                yield event

    def _event(self, line: bytes) -> OutputEvent:
        obj = _base.json_line(line)
        if "error" in obj:
            raise _base.stream_error(obj)
        return OutputEvent.from_json(obj)

    def send_stdin(self, data: str | bytes, eof: bool = False) -> int:
        """Write `data` (text is sent as UTF-8) to its stdin; close it after with `eof`. Returns
        the bytes written. `StdinClosed` after an eof, `ProcessExited` once it exited."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        response = self.sandbox._client._request(
            "POST",
            self._path("stdin"),
            params={"eof": "1"} if eof else None,
            content=raw,
            headers={"Content-Type": "application/octet-stream"},
        )
        return int(_base.json_body(response).get("written", 0))

    def close_stdin(self) -> None:
        """Close its stdin (the program reads EOF)."""
        self.send_stdin(b"", eof=True)

    def signal(self, name: str | int = "TERM") -> ProcessInfo:
        """Send a signal (TERM, SIGTERM, 15, INT, ...) to its process group; its record after."""
        response = self.sandbox._client._request("POST", self._path("signal"), json={"signal": name})
        self.data = _base.json_body(response)
        return ProcessInfo(self.data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pid={self.pid}, sandbox={self.sandbox.id!r})"


class Terminal:
    """An attached terminal (`sandbox.pty()` / `sandbox.pty_attach(id)`): `send` keystrokes,
    `read` or iterate over output bytes, `resize`, `wait` for the exit code. `close` (or leaving
    the context) detaches; the session lives on in the sandbox."""

    def __init__(self, sandbox: Sandbox, pty_id: str, ws: ClientConnection) -> None:
        self.sandbox = sandbox
        self.pty_id = pty_id
        self._ws = ws
        self._pending: list[bytes] = []
        self.exit_code: int | None = None
        """The program's exit code, once it ended (set by `read`/`wait`)."""

    def _check_first(self) -> None:
        """An attach the server refused ends with one error message: raise it now."""
        try:
            msg = _base.recv(self._ws, 0.05)
        except TimeoutError:
            return
        except ws_errors.ConnectionClosed as exc:
            raise _base.terminal_closed(exc.rcvd.code if exc.rcvd else None, "", self.pty_id) from None
        kind, value = _base.terminal_message(msg)
        if kind == "error":
            self._ws.close()
            raise value
        if kind == "exit":
            self.exit_code = value
        else:
            self._pending.append(value)

    def send(self, data: bytes | str) -> None:
        """Type `data` (str is sent as UTF-8), in messages of at most 1 MiB (the server's limit)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        for i in range(0, len(raw), _base.TERMINAL_MESSAGE_MAX):
            self._send(raw[i : i + _base.TERMINAL_MESSAGE_MAX])

    def resize(self, cols: int, rows: int) -> None:
        problem = _base.terminal_size_problem(cols, rows)
        if problem:
            raise errors.InvalidRequest(problem, code="invalid_request")
        self._send(json.dumps({"resize": [cols, rows]}))

    def _send(self, message: bytes | str) -> None:
        if self.exit_code is not None:
            raise errors.Conflict(
                f"the program of terminal {self.pty_id} has ended (exit code {self.exit_code}); open "
                "a new one with sandbox.pty()",
                code="invalid_state",
            )
        try:
            self._ws.send(message)
        except ws_errors.ConnectionClosed as exc:
            raise _base.terminal_closed(
                exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else "", self.pty_id
            ) from exc

    def read(self, timeout: float | None = None) -> bytes:
        """The next piece of output; b"" once the program ended (`exit_code` is then set).
        TimeoutError if nothing arrives within `timeout` seconds."""
        if self._pending:
            return self._pending.pop(0)
        if self.exit_code is not None:
            return b""
        while True:
            try:
                msg = _base.recv(self._ws, timeout)
            except ws_errors.ConnectionClosed as exc:
                raise _base.terminal_closed(
                    exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else "", self.pty_id
                ) from None
            kind, value = _base.terminal_message(msg)
            if kind == "data":
                return value
            if kind == "exit":
                self.exit_code = value
                return b""
            raise value

    def wait(self, timeout: float | None = None) -> int:
        """Read (and drop) output until the program ends; its exit code."""
        while self.read(timeout):
            pass
        assert self.exit_code is not None
        return self.exit_code

    def close(self) -> None:
        """Detach (the session lives on)."""
        self._ws.close()

    def __iter__(self) -> Terminal:
        return self

    def __next__(self) -> bytes:
        data = self.read()
        if not data:
            raise StopIteration
        return data

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pty_id={self.pty_id!r}, sandbox={self.sandbox.id!r})"


class Files:
    """`sandbox.files`: read and write files inside the sandbox by absolute path.

    A path is a `str`, or `bytes` for names that are not UTF-8 (`FileEntry.raw_path` of a listing
    gives them; they are sent as `path_b64`).
    """

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    @property
    def _client(self) -> Client:
        return self._sandbox._client

    def write(self, path: str | bytes, data: _base.UploadData) -> None:
        """Create or replace the file at `path`.

        `data` may be bytes, str (UTF-8), an open file or an iterable of chunks; files and
        iterables are streamed to the server in chunks rather than loaded whole.
        """
        self._client._request(
            "PUT",
            self._sandbox._path("files"),
            params=_base.path_params(path),
            content=_base.request_body(data),
            headers=_base.upload_headers(data),
        )

    def read(self, path: str | bytes) -> bytes:
        """The whole content of the file at `path`."""
        response = self._client._request("GET", self._sandbox._path("files"), params=_base.path_params(path))
        return response.content

    def stream(self, path: str | bytes, chunk_size: int = _base.CHUNK_SIZE) -> Iterator[bytes]:
        """Iterate over the content of the file at `path` without holding it all in memory."""
        with self._client._stream(
            "GET", self._sandbox._path("files"), params=_base.path_params(path)
        ) as response:
            for chunk in response.iter_bytes(chunk_size):  # noqa: UP028 - async has no `yield from`
                yield chunk

    def read_to(self, path: str | bytes, fileobj: IO[bytes]) -> int:
        """Copy the file at `path` into an open binary file; returns the number of bytes."""
        total = 0
        for chunk in self.stream(path):
            fileobj.write(chunk)
            total += len(chunk)
        return total

    def list(self, path: str | bytes = "/") -> list[FileEntry]:
        """The entries of the directory at `path`."""
        response = self._client._request(
            "GET", self._sandbox._path("files", "list"), params=_base.path_params(path)
        )
        return [FileEntry(item) for item in _base.items(response)]

    def remove(self, path: str | bytes) -> None:
        self._client._request("DELETE", self._sandbox._path("files"), params=_base.path_params(path))

    # ---- issue 9: stat, exists, mkdir, move, chmod, watch, directories as tar streams ------------
    def stat(self, path: str | bytes) -> FileStat:
        """The path's type ("file", "dir", "symlink", "other"), size, mode, mtime and symlink target
        (lstat: a symlink is not followed). Raises `atoll.errors.FileNotFound` when it is missing."""
        response = self._client._request(
            "GET", self._sandbox._path("files", "stat"), params=_base.path_params(path)
        )
        return FileStat(_base.json_body(response))

    def exists(self, path: str | bytes) -> bool:
        """Whether anything (a file, directory or symlink, even a dangling one) is at `path`."""
        try:
            self.stat(path)
        except errors.FileNotFound:
            return False
        return True

    def mkdir(self, path: str | bytes) -> bool:
        """Create the directory and its parents (mkdir -p); False when it existed already."""
        response = self._client._request(
            "POST", self._sandbox._path("files", "mkdir"), params=_base.path_params(path)
        )
        return bool(_base.json_body(response).get("created"))

    def move(self, src: str, dst: str) -> FileStat:
        """Rename or move `src` to `dst` (parents of `dst` are created; a file replaces a file)."""
        response = self._client._request(
            "POST", self._sandbox._path("files", "move"), json={"from": src, "to": dst}
        )
        return FileStat(_base.json_body(response))

    def chmod(self, path: str, mode: int | str) -> FileStat:
        """Set the permission bits: an int such as 0o755, or octal text such as "755"."""
        response = self._client._request(
            "POST", self._sandbox._path("files", "chmod"), json={"path": path, "mode": mode}
        )
        return FileStat(_base.json_body(response))

    def watch(self, path: str | bytes, recursive: bool = True) -> Watch:
        """Watch a directory: returns once the watch is in place (so nothing written after is
        missed); iterate it for `FileEvent`s, and close it (or use it as a context manager)."""
        params = {**_base.path_params(path), "recursive": "true" if recursive else "false"}
        watch = Watch(self._client._stream("GET", self._sandbox._path("files", "watch"), params=params))
        watch._open()
        return watch

    def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str | bytes) -> dict[str, Any]:
        """Upload a local directory tree into `remote_dir` (created) as one tar stream: files, empty
        directories, symlinks and hard links. Returns the counts written: files, dirs, links, bytes."""
        if not os.path.isdir(local_dir):  # said before anything is sent
            raise NotADirectoryError(f"upload_dir: {os.fspath(local_dir)!r} is not a local directory")
        chunks = _tar.tar_chunks(local_dir)
        response = self._client._request(
            "PUT",
            self._sandbox._path("files", "tar"),
            params=_base.path_params(remote_dir),
            content=_base.request_body(chunks),
            headers={"Content-Type": "application/x-tar"},
        )
        return _base.json_body(response)

    def download_dir(self, remote_dir: str | bytes, local_dir: str | os.PathLike[str]) -> int:
        """Download the tree under `remote_dir` into `local_dir` (created), extracted safely
        (tarfile's "data" filter: nothing lands outside `local_dir`). Returns the member count."""
        with tempfile.TemporaryFile() as spool:
            with self._client._stream(
                "GET", self._sandbox._path("files", "tar"), params=_base.path_params(remote_dir)
            ) as response:
                for chunk in response.iter_bytes(_base.CHUNK_SIZE):
                    spool.write(chunk)
            spool.seek(0)
            return _tar.extract(spool, local_dir)


class Watch:
    """An open `sandbox.files.watch(dir)`: iterate it for `FileEvent`s; `aclose()` ends it (the
    watch inside the sandbox ends too). A broken stream raises the mapped `AtollError`."""

    def __init__(self, stream: Any) -> None:
        self._cm = stream
        self._lines: Any = None
        self.closed = False

    def _open(self) -> None:
        response = self._cm.__enter__()
        self._lines = response.iter_lines()
        try:
            first = self._next_event()
        except BaseException:
            self.close()
            raise
        if first.type != "ready":
            self.close()
            raise errors.AtollError(f"the watch stream began with {first.data!r}, not its ready line")

    def _next_event(self) -> FileEvent:
        while True:
            line = self._lines.__next__()
            if not line.strip():
                continue  # keep-alive
            obj = _json.loads(line)
            if "error" in obj:
                raise errors.error_from_payload(obj, status_code=None, text=line)
            return FileEvent(obj)

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> FileEvent:
        if self.closed:
            raise StopIteration
        try:
            event = self._next_event()
        except StopIteration:
            self.close()
            raise
        if event.type == "overflow":
            self.close()
        return event

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._cm.__exit__(None, None, None)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
