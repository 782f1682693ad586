"""`AtollSandboxSession`: one atoll sandbox as an Agents SDK session (`BaseSandboxSession`), and
`AtollSandboxSessionState`, what the SDK serializes to resume it.

Implements the SDK's abstract session methods on atoll's async SDK (`atoll.AsyncSandbox`):
`_exec_internal` (exec with exit code, stdout, stderr; `sudo -u NAME --` becomes exec's `user`),
`read` / `write` (the files API), `running` (the sandbox's state), `persist_workspace` /
`hydrate_workspace` (a tar of the workspace root, or with `workspace_persistence="fork"` an atoll
fork parked in standby), the PTY calls (`_pty`), `_resolve_exposed_port` (atoll preview URLs) and
`_shutdown_backend` (delete, or with `pause_on_exit` standby). Paths are checked inside the
sandbox with the SDK's own helper (`_validate_remote_path_access`), as its hosted providers do.
Created by `_client.AtollSandboxClient`.
"""

from __future__ import annotations

import io
import logging
import shlex
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    ExposedPortUnavailableError,
    PtySessionNotFoundError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
    WorkspaceStartError,
    WorkspaceWriteTypeError,
)
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.pty_types import PtyExecUpdate
from agents.sandbox.session.runtime_helpers import RESOLVE_WORKSPACE_PATH_HELPER, RuntimeHelperScript
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.session.tar_workspace import shell_tar_exclude_args
from agents.sandbox.types import ExecResult, ExposedPortEndpoint, User
from agents.sandbox.util.tar_utils import UnsafeTarMemberError, validate_tar_bytes
from agents.sandbox.workspace_paths import posix_path_for_error, sandbox_path_str
from pydantic import Field

from atoll import errors

from .. import _openai_agents_mapping as _mapping
from ._pty import PtyEntry, PtyProcesses

logger = logging.getLogger(__name__)


class AtollSandboxSessionState(SandboxSessionState):
    """What `client.serialize_session_state` keeps of an atoll session: the sandbox id, and the
    create arguments a replacement is made from when that sandbox is gone."""

    type: Literal["atoll"] = "atoll"
    sandbox_id: str
    create_options: dict[str, Any] = Field(default_factory=dict)
    base_env: dict[str, str] = Field(default_factory=dict)
    pause_on_exit: bool = False
    pause_tier: str = "disk"
    workspace_persistence: str = "tar"


class AtollSandboxSession(BaseSandboxSession):
    """An Agents SDK session on one atoll sandbox (`sandbox`, an `atoll.AsyncSandbox`)."""

    state: AtollSandboxSessionState

    def __init__(self, *, state: AtollSandboxSessionState, sandbox: Any, client: Any) -> None:
        self.state = state
        self._sandbox = sandbox
        self._client = client  # atoll.AsyncClient: forks and replacements
        self._pty = PtyProcesses()
        self._backend_closed = False

    @property
    def sandbox_id(self) -> str:
        return self.state.sandbox_id

    @property
    def sandbox(self) -> Any:
        """The `atoll.AsyncSandbox` under this session, for what the Agents SDK has no call for
        (metrics, network policy, `pause`)."""
        return self._sandbox

    def _adopt(self, sandbox: Any) -> None:
        self._sandbox = sandbox
        self.state.sandbox_id = sandbox.id
        self._backend_closed = False

    # ---- paths and environment -----------------------------------------------------------------
    async def _validate_path_access(self, path: Path | str, *, for_write: bool = False) -> Path:
        return await self._validate_remote_path_access(path, for_write=for_write)

    def _runtime_helpers(self) -> tuple[RuntimeHelperScript, ...]:
        return (RESOLVE_WORKSPACE_PATH_HELPER,)

    def _current_runtime_helper_cache_key(self) -> object | None:
        return self.state.sandbox_id

    async def _env(self) -> dict[str, str]:
        manifest_env = await self.state.manifest.environment.resolve()
        return {**self.state.base_env, **manifest_env}

    def _cwd(self) -> str | None:
        return self.state.manifest.root if self.state.workspace_root_ready else None

    async def _prepare_backend_workspace(self) -> None:
        root = self._workspace_root_path()
        try:
            result = await self._sandbox.exec(["mkdir", "-p", "--", root.as_posix()], cwd="/")
        except errors.AtollError as exc:
            raise WorkspaceStartError(path=root, context=_mapping.error_context(exc), cause=exc) from exc
        if not result.ok:
            raise WorkspaceStartError(
                path=root,
                context={
                    "reason": "workspace_root_nonzero_exit",
                    "exit_code": result.exit_code,
                    "stderr": result.stderr,
                },
            )
        self.state.workspace_root_ready = True

    # ---- exec ------------------------------------------------------------------------------------
    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        argv, user = _mapping.split_user([str(c) for c in command])
        timeout_s = _mapping.exec_timeout_s(timeout)
        try:
            result = await self._sandbox.exec(
                argv, timeout_s=timeout_s, cwd=self._cwd(), env=await self._env(), user=user
            )
        except errors.AtollError as exc:
            raise _exec_error(exc, command, timeout) from exc
        if result.timed_out:
            raise ExecTimeoutError(
                command=command, timeout_s=timeout, context={"backend": _mapping.BACKEND_ID}
            )
        return ExecResult(
            stdout=result.stdout.encode("utf-8"),
            stderr=result.stderr.encode("utf-8"),
            exit_code=result.exit_code if result.exit_code is not None else -1,
        )

    # ---- PTY -------------------------------------------------------------------------------------
    def supports_pty(self) -> bool:
        return True

    async def pty_exec_start(
        self,
        *command: str | Path,
        timeout: float | None = None,
        shell: bool | list[str] = True,
        user: str | User | None = None,
        tty: bool = False,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        argv, run_as = _mapping.split_user(self._prepare_exec_command(*command, shell=shell, user=user))
        env = await self._env()
        entry = PtyEntry(tty=tty)
        try:
            if tty:
                if run_as is not None:
                    raise ExecTransportError(
                        command=command,
                        message=f"an atoll terminal runs as the sandbox's default user, not {run_as!r}: "
                        "start it without user=, or with tty=False",
                        context={"backend": _mapping.BACKEND_ID, "user": run_as},
                    )
                entry.terminal = await self._sandbox.pty(cmd=argv, cwd=self._cwd(), env=env)
            else:
                timeout_s = _mapping.exec_timeout_s(timeout)
                entry.process = await self._sandbox.exec(
                    argv, background=True, timeout_s=timeout_s, cwd=self._cwd(), env=env, user=run_as
                )
        except errors.AtollError as exc:
            raise _exec_error(exc, command, timeout) from exc
        process_id = await self._pty.register(entry)
        yield_ms = 10_000 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._pty.update(
            process_id, entry, yield_ms=yield_ms, max_output_tokens=max_output_tokens, first=True
        )

    async def pty_write_stdin(
        self,
        *,
        session_id: int,
        chars: str,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        entry = await self._pty.get(session_id)
        if entry is None:
            raise PtySessionNotFoundError(session_id=session_id)
        if chars:
            if not entry.tty:
                raise RuntimeError("stdin is not available for this process (start it with tty=True)")
            try:
                await entry.terminal.send(chars)
            except errors.AtollError as exc:
                raise _exec_error(exc, ("pty_write_stdin",), None) from exc
        yield_ms = 250 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._pty.update(
            session_id,
            entry,
            yield_ms=yield_ms,
            max_output_tokens=max_output_tokens,
            first=False,
            input_empty=chars == "",
        )

    async def pty_terminate_all(self) -> None:
        await self._pty.terminate_all()

    # ---- files -----------------------------------------------------------------------------------
    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        if user is not None:
            await self._check_read_with_exec(path, user=user)
        workspace_path = await self._validate_path_access(path)
        try:
            data = await self._sandbox.files.read(sandbox_path_str(workspace_path))
        except errors.AtollError as exc:
            if _mapping.error_kind(exc) == "not_found":
                raise WorkspaceReadNotFoundError(
                    path=path, context=_mapping.error_context(exc), cause=exc
                ) from exc
            raise WorkspaceArchiveReadError(
                path=path, context=_mapping.error_context(exc), cause=exc, retryable=_mapping.retryable(exc)
            ) from exc
        return io.BytesIO(data)

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        if user is not None:
            await self._check_write_with_exec(path, user=user)
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        if not isinstance(payload, bytes | bytearray):
            raise WorkspaceWriteTypeError(path=path, actual_type=type(payload).__name__)
        workspace_path = await self._validate_path_access(path, for_write=True)
        try:
            await self._sandbox.files.write(sandbox_path_str(workspace_path), bytes(payload))
        except errors.AtollError as exc:
            raise WorkspaceArchiveWriteError(
                path=workspace_path,
                context=_mapping.error_context(exc),
                cause=exc,
                retryable=_mapping.retryable(exc),
            ) from exc

    async def running(self) -> bool:
        if self._backend_closed:
            return False
        try:
            await self._sandbox.refresh()
        except errors.AtollError:
            return False
        return self._sandbox.state == "running"

    # ---- ports -----------------------------------------------------------------------------------
    async def _resolve_exposed_port(self, port: int) -> ExposedPortEndpoint:
        try:
            preview = await self._sandbox.preview(port)
        except errors.AtollError as exc:
            raise ExposedPortUnavailableError(
                port=port,
                exposed_ports=self.state.exposed_ports,
                reason="backend_unavailable",
                context=_mapping.error_context(exc),
                cause=exc,
            ) from exc
        url = urlsplit(preview.signed_url or preview.url)
        tls = url.scheme == "https"
        return ExposedPortEndpoint(
            host=url.hostname or "", port=url.port or (443 if tls else 80), tls=tls, query=url.query
        )

    # ---- snapshots -------------------------------------------------------------------------------
    async def persist_workspace(self) -> io.IOBase:
        if self.state.workspace_persistence == "fork":
            return await self._persist_by_fork()
        return await self._persist_by_tar()

    async def _persist_by_fork(self) -> io.IOBase:
        """Fork the sandbox and park the copy in standby: the snapshot is that copy's id."""
        root = posix_path_for_error(self._workspace_root_path())
        try:
            (copy,) = await self._sandbox.fork(1)
            await copy.pause(tier=self.state.pause_tier)
        except errors.AtollError as exc:
            raise WorkspaceArchiveReadError(
                path=root,
                context={"reason": "fork_failed", **_mapping.error_context(exc)},
                cause=exc,
                retryable=_mapping.retryable(exc),
            ) from exc
        return io.BytesIO(_mapping.encode_snapshot_ref(copy.id))

    async def _persist_by_tar(self) -> io.IOBase:
        root = self._workspace_root_path()
        tar_path = f"/tmp/atoll-agents-persist-{self.state.session_id.hex}.tar"
        excludes = " ".join(shell_tar_exclude_args(self._persist_workspace_skip_relpaths()))
        script = f"tar -C {shlex.quote(root.as_posix())} {excludes} -cf {shlex.quote(tar_path)} ."
        try:
            result = await self._sandbox.exec(["sh", "-c", script], cwd="/")
            if not result.ok:
                raise WorkspaceArchiveReadError(
                    path=posix_path_for_error(root),
                    context={
                        "reason": "tar_nonzero_exit",
                        "exit_code": result.exit_code,
                        "stderr": result.stderr,
                    },
                )
            raw = await self._sandbox.files.read(tar_path)
        except errors.AtollError as exc:
            raise WorkspaceArchiveReadError(
                path=posix_path_for_error(root),
                context=_mapping.error_context(exc),
                cause=exc,
                retryable=_mapping.retryable(exc),
            ) from exc
        finally:
            await self._remove_quietly(tar_path)
        return io.BytesIO(raw)

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        raw = data.read()
        if isinstance(raw, str):
            raw = raw.encode("utf-8")
        if not isinstance(raw, bytes | bytearray):
            raise WorkspaceWriteTypeError(path=Path("<snapshot>"), actual_type=type(raw).__name__)
        raw = bytes(raw)
        snapshot_id = _mapping.decode_snapshot_ref(raw)
        if snapshot_id is not None:
            await self._hydrate_from_fork(snapshot_id)
        else:
            await self._hydrate_from_tar(raw)

    async def _hydrate_from_fork(self, snapshot_id: str) -> None:
        """Replace this session's sandbox with a fork of the snapshot sandbox, which goes back to
        standby so that it can be restored again."""
        root = posix_path_for_error(self._workspace_root_path())
        try:
            snapshot = await self._client.sandboxes.get(snapshot_id)
            (copy,) = await snapshot.fork(1)
        except errors.AtollError as exc:
            raise WorkspaceArchiveWriteError(
                path=root,
                context={
                    "reason": "fork_restore_failed",
                    "snapshot_sandbox_id": snapshot_id,
                    **_mapping.error_context(exc),
                },
                cause=exc,
                retryable=_mapping.retryable(exc),
            ) from exc
        try:
            await snapshot.pause(tier=self.state.pause_tier)
        except errors.AtollError as exc:
            logger.warning("could not put snapshot sandbox %s back in standby: %s", snapshot_id, exc)
        await self._pty.terminate_all()
        old = self._sandbox
        self._adopt(copy)
        self.state.workspace_root_ready = True
        try:
            await old.delete()
        except errors.AtollError as exc:
            logger.warning(
                "could not delete sandbox %s replaced by a fork of %s: %s", old.id, snapshot_id, exc
            )

    async def _hydrate_from_tar(self, raw: bytes) -> None:
        root = self._workspace_root_path()
        error_root = posix_path_for_error(root)
        try:
            validate_tar_bytes(raw, allow_external_symlink_targets=False)
        except UnsafeTarMemberError as exc:
            raise WorkspaceArchiveWriteError(
                path=error_root,
                context={"reason": "unsafe_or_invalid_tar", "member": exc.member, "detail": str(exc)},
                cause=exc,
            ) from exc
        tar_path = f"/tmp/atoll-agents-hydrate-{self.state.session_id.hex}.tar"
        try:
            await self._sandbox.files.write(tar_path, raw)
            quoted_root = shlex.quote(root.as_posix())
            script = f"mkdir -p -- {quoted_root} && tar -C {quoted_root} -xf {shlex.quote(tar_path)}"
            result = await self._sandbox.exec(["sh", "-c", script], cwd="/")
        except errors.AtollError as exc:
            raise WorkspaceArchiveWriteError(
                path=error_root,
                context=_mapping.error_context(exc),
                cause=exc,
                retryable=_mapping.retryable(exc),
            ) from exc
        finally:
            await self._remove_quietly(tar_path)
        if not result.ok:
            raise WorkspaceArchiveWriteError(
                path=error_root,
                context={
                    "reason": "hydrate_nonzero_exit",
                    "exit_code": result.exit_code,
                    "stderr": result.stderr,
                },
            )
        self.state.workspace_root_ready = True

    async def _remove_quietly(self, path: str) -> None:
        try:
            await self._sandbox.files.remove(path)
        except errors.AtollError:
            pass

    # ---- end -------------------------------------------------------------------------------------
    async def _shutdown_backend(self) -> None:
        """Delete the sandbox, or with `pause_on_exit` put it in standby (resume it by id later).
        Runs once: a second call (the client's `delete` after `aclose`) does nothing."""
        if self._backend_closed:
            return
        self._backend_closed = True
        if self.state.pause_on_exit:
            try:
                await self._sandbox.pause(tier=self.state.pause_tier)
                return
            except errors.SandboxNotFound:
                return
            except errors.AtollError as exc:
                logger.warning(
                    "could not pause sandbox %s on shutdown (%s); deleting it", self.state.sandbox_id, exc
                )
        try:
            await self._sandbox.delete()
        except errors.SandboxNotFound:
            pass
        except errors.AtollError as exc:
            logger.warning("could not delete sandbox %s on shutdown: %s", self.state.sandbox_id, exc)


def _exec_error(exc: errors.AtollError, command: Any, timeout: float | None) -> Exception:
    """The Agents SDK's error for an atoll error raised by an exec call."""
    context = _mapping.error_context(exc)
    if _mapping.error_kind(exc) == "timeout":
        return ExecTimeoutError(command=tuple(command), timeout_s=timeout, context=context, cause=exc)
    return ExecTransportError(
        command=tuple(command),
        message=f"atoll exec failed: {exc}",
        context=context,
        cause=exc,
        retryable=_mapping.retryable(exc),
    )
