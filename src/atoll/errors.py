"""The SDK's exception tree and the mapping from the server's error codes to it.

Raised by `atoll.Client` / `atoll.AsyncClient` (via `atoll._client._base.raise_for_status`)
and caught by the CLI (`atoll.cli.main`), which prints `error: <code>: <message>`.
Stdlib only: the server's own tree lives in `atoll.core.errors` and is never imported here.

    AtollError                  .code .message .status_code .request_id .retryable
    ├── APIConnectionError      connection_error: the server could not be reached (also a ConnectionError)
    │   ├── APITimeoutError     timeout: no answer within the client's timeout (also a TimeoutError)
    │   ├── CertificateError    certificate_error: the server's TLS certificate did not verify (trust
    │   │                           the installation CA, GET /v1/ca.crt, with ca_file= / ATOLL_CA_FILE)
    │   └── BadCAFile           bad_ca_file: the ca_file (ATOLL_CA_FILE) is missing, unreadable or not PEM
    ├── InvalidRequest          400/422 invalid_request, invalid_path, io_error
    ├── Unauthorized            401/403 unauthorized, forbidden (the key's scope does not allow the route)
    ├── QuotaExceeded           403/429 quota_exceeded: a tenant quota (the message names it, its
    │                               limit and the use); 429 for creates_per_minute (retryable, Retry-After)
    ├── PermissionDenied        403 permission_denied, read_only_path: the sandbox's file system refused
    ├── NotFound                404
    │   ├── SandboxNotFound         sandbox_not_found
    │   ├── TemplateNotFound        template_not_found
    │   ├── FileNotFound            file_not_found
    │   ├── ProcessNotFound         process_not_found
    │   ├── PtyNotFound             pty_not_found
    │   ├── SecretNotFound          secret_not_found
    │   └── (NotFound)              volume_not_found, drive_not_found, tenant_not_found, key_not_found,
    │                               snapshot_not_found
    ├── Conflict                409
    │   ├── SandboxBusy             sandbox_busy (retryable)
    │   ├── InvalidState            invalid_state
    │   ├── SandboxFailed           sandbox_failed: the sandbox died under the call (e.g. out of memory)
    │   ├── ProcessExited           process_exited: stdin to a process that has exited
    │   ├── StdinClosed             stdin_closed: stdin after eof (or after stdin given at start)
    │   ├── ProcessRunning          process_running: a wait's timeout passed, the process still runs
    │   └── (Conflict)              worker_conflict, incompatible_protocol, worker_not_registered,
    │                               secret_exists, template_exists, template_in_use, build_unavailable
    │                               (no worker holds the template's build, nor the store: build it again),
    │                               tenant_exists, tenant_in_use,
    │                               volume_exists, drive_exists, volume_in_use, drive_in_use,
    │                               checkpoint_refused (fork, snapshot: the sandbox's state cannot be saved now),
    │                               snapshot_exists, snapshot_unavailable (its worker is gone, not stored),
    │                               not_adoptable (worker protocol only),
    │                               idempotency_key_reused, idempotency_key_in_use (retryable),
    │                               sandbox_changed (retryable: another server wrote it at once)
    ├── PayloadTooLarge         413 payload_too_large
    ├── DiskFull                507 disk_full: the sandbox's disk (disk_mb) is full; store_full: a
    │                               volume's or drive's size_mb is used up
    ├── CommandFailed           command_failed: `exec(..., check=True)` exited non-zero (.exit_code,
    │                               .stdout, .stderr); raised by the SDK itself, not an HTTP answer
    └── ServerError             5xx runtime_error, internal_error, and any other 5xx
        ├── Unavailable         503 worker_unavailable, no_worker, database_unavailable
        │                           (retryable): the sandbox's worker, any worker, or the records
        │                           database cannot take the call right now (a POST cut off
        │                           after it was sent has an unknown outcome: not retryable)
        └── ResumeFailed        503 resume_failed (retryable): the sandbox could not be resumed from
                                    disk this time; it stays in standby, files kept; call again

A response whose body is not the server's JSON error envelope (a proxy's HTML page, say) still
raises: the code is `http_<status>` and the message is the start of the body text.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AtollError",
    "BuildFailed",
    "APIConnectionError",
    "APITimeoutError",
    "CertificateError",
    "BadCAFile",
    "InvalidRequest",
    "Unauthorized",
    "PermissionDenied",
    "NotFound",
    "SandboxNotFound",
    "TemplateNotFound",
    "FileNotFound",
    "ProcessNotFound",
    "PtyNotFound",
    "ProcessExited",
    "StdinClosed",
    "ProcessRunning",
    "CommandFailed",
    "Conflict",
    "SandboxBusy",
    "InvalidState",
    "SandboxFailed",
    "PayloadTooLarge",
    "DiskFull",
    "ServerError",
    "Unavailable",
    "ResumeFailed",
    "SecretNotFound",
    "WorkerNotFound",
    "error_from_payload",
]


class AtollError(Exception):
    """Base of every error the SDK raises. `str(err)` is `"<code>: <message>"`."""

    default_code = "error"
    default_retryable = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status_code: int | None = None,
        request_id: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.status_code = status_code
        self.request_id = request_id
        self.retryable = self.default_retryable if retryable is None else retryable

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, "
            f"status_code={self.status_code!r}, request_id={self.request_id!r})"
        )


class APIConnectionError(AtollError, ConnectionError):
    """The server could not be reached (refused, DNS failure, dropped connection)."""

    default_code = "connection_error"
    default_retryable = True


class APITimeoutError(APIConnectionError, TimeoutError):
    """The server did not answer within the client's timeout."""

    default_code = "timeout"


class CertificateError(APIConnectionError):
    """The server's TLS certificate did not verify against the CAs the client trusts (the system's,
    or its `ca_file`): trust the installation CA (GET /v1/ca.crt) with `ca_file=` / ATOLL_CA_FILE.
    Raised by the SDK itself, never retried."""

    default_code = "certificate_error"
    default_retryable = False


class BadCAFile(APIConnectionError):
    """The client's `ca_file` (or ATOLL_CA_FILE) is missing, unreadable or holds no PEM
    certificate; raised when the client is made, before anything is sent."""

    default_code = "bad_ca_file"
    default_retryable = False


class InvalidRequest(AtollError):
    default_code = "invalid_request"


class Unauthorized(AtollError):
    default_code = "unauthorized"


class PermissionDenied(AtollError):
    """The sandbox refused a file operation: permissions, or a read-only file system."""

    default_code = "permission_denied"


class NotFound(AtollError):
    default_code = "not_found"


class SandboxNotFound(NotFound):
    default_code = "sandbox_not_found"


class TemplateNotFound(NotFound):
    default_code = "template_not_found"


class FileNotFound(NotFound):
    default_code = "file_not_found"


class ProcessNotFound(NotFound):
    default_code = "process_not_found"


class PtyNotFound(NotFound):
    default_code = "pty_not_found"


class WorkerNotFound(NotFound):
    default_code = "worker_not_found"


class SecretNotFound(NotFound):
    default_code = "secret_not_found"


class Conflict(AtollError):
    default_code = "conflict"


class SandboxBusy(Conflict):
    default_code = "sandbox_busy"
    default_retryable = True


class InvalidState(Conflict):
    default_code = "invalid_state"


class SandboxFailed(Conflict):
    default_code = "sandbox_failed"


class ProcessExited(Conflict):
    default_code = "process_exited"


class StdinClosed(Conflict):
    default_code = "stdin_closed"


class ProcessRunning(Conflict):
    """A wait's timeout passed and the process still runs: wait again, or signal or kill it."""

    default_code = "process_running"


class CommandFailed(AtollError):
    """`sandbox.exec(..., check=True)` ran a command that exited non-zero (or timed out).

    `.exit_code`, `.stdout` and `.stderr` are the command's; `.result` is the whole ExecResult."""

    default_code = "command_failed"

    def __init__(self, result: Any, cmd: Any = None) -> None:
        self.result = result
        self.cmd = cmd
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr
        what = " (timed out)" if getattr(result, "timed_out", False) else ""
        tail = (self.stderr or "").strip().splitlines()[-1:] or [""]
        super().__init__(
            f"command {cmd!r} exited with code {self.exit_code}{what}"
            + (f": {tail[0][:300]}" if tail[0] else "")
        )


class PayloadTooLarge(AtollError):
    default_code = "payload_too_large"


class QuotaExceeded(AtollError):
    """A tenant quota would be exceeded: the message names the quota, its limit and the use."""

    default_code = "quota_exceeded"


class DiskFull(AtollError):
    """The sandbox's writable layer is full: delete files, or use a larger `disk_mb`."""

    default_code = "disk_full"


class BuildFailed(AtollError):
    """A template build ended failed (`templates.build(..., wait=True)`); `message` has its error,
    the build's log has the rest."""

    def __init__(self, message: str, *, build_id: str | None = None) -> None:
        super().__init__(message, code="build_failed")
        self.build_id = build_id


class ServerError(AtollError):
    default_code = "internal_error"


class Unavailable(ServerError):
    """The sandbox's worker (or any worker, for a create) cannot take the call now; retry later. When
    the worker was lost after a call that changes something was sent (an exec, a file write, a
    signal), the message says its outcome is unknown, and `retryable` is False for a POST."""

    default_code = "worker_unavailable"
    default_retryable = True


class ResumeFailed(ServerError):
    """The sandbox could not be resumed from its disk standby this time. It stays in standby with
    its files and memory image (its `resume_error` says why) and the next call tries again; after
    3 failed tries it is failed, its files kept until it is deleted."""

    default_code = "resume_failed"
    default_retryable = True


_BY_CODE: dict[str, type[AtollError]] = {
    "invalid_request": InvalidRequest,
    "invalid_path": InvalidRequest,
    "io_error": InvalidRequest,
    "permission_denied": PermissionDenied,
    "read_only_path": PermissionDenied,
    "disk_full": DiskFull,
    "store_full": DiskFull,
    "unauthorized": Unauthorized,
    "forbidden": Unauthorized,
    "quota_exceeded": QuotaExceeded,
    "not_found": NotFound,
    "tenant_not_found": NotFound,
    "key_not_found": NotFound,
    "sandbox_not_found": SandboxNotFound,
    "template_not_found": TemplateNotFound,
    "file_not_found": FileNotFound,
    "process_not_found": ProcessNotFound,
    "pty_not_found": PtyNotFound,
    "worker_not_found": WorkerNotFound,
    "secret_not_found": SecretNotFound,
    "volume_not_found": NotFound,
    "drive_not_found": NotFound,
    "snapshot_not_found": NotFound,
    "conflict": Conflict,
    "sandbox_busy": SandboxBusy,
    "invalid_state": InvalidState,
    "sandbox_failed": SandboxFailed,
    "process_exited": ProcessExited,
    "stdin_closed": StdinClosed,
    "process_running": ProcessRunning,
    "worker_conflict": Conflict,
    "incompatible_protocol": Conflict,
    "worker_not_registered": Conflict,
    "secret_exists": Conflict,
    "template_exists": Conflict,
    "template_in_use": Conflict,
    "build_unavailable": Conflict,
    "tenant_exists": Conflict,
    "tenant_in_use": Conflict,
    "volume_exists": Conflict,
    "drive_exists": Conflict,
    "snapshot_exists": Conflict,
    "snapshot_unavailable": Conflict,
    "volume_in_use": Conflict,
    "drive_in_use": Conflict,
    "checkpoint_refused": Conflict,
    "not_adoptable": Conflict,
    "idempotency_key_reused": Conflict,
    "idempotency_key_in_use": Conflict,
    "sandbox_changed": Conflict,
    "method_not_allowed": InvalidRequest,
    "payload_too_large": PayloadTooLarge,
    "answer_too_large": PayloadTooLarge,
    "runtime_error": ServerError,
    "internal_error": ServerError,
    "worker_unavailable": Unavailable,
    "no_worker": Unavailable,
    "database_unavailable": Unavailable,
    "resume_failed": ResumeFailed,
    # raised by the SDK itself (a server never answers them)
    "certificate_error": CertificateError,
    "bad_ca_file": BadCAFile,
}

_BY_STATUS: dict[int, type[AtollError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: InvalidRequest,
    503: Unavailable,
    507: DiskFull,
}


def error_class(code: str, status_code: int | None) -> type[AtollError]:
    """The most specific class for a server error code, falling back on the HTTP status."""
    if code in _BY_CODE:
        return _BY_CODE[code]
    if status_code is not None:
        if status_code in _BY_STATUS:
            return _BY_STATUS[status_code]
        if status_code >= 500:
            return ServerError
    return AtollError


def error_from_payload(
    payload: Any, *, status_code: int | None, text: str = "", request_id: str | None = None
) -> AtollError:
    """Build the exception for an error response.

    `payload` is the decoded JSON body (or None when the body was not JSON); `text` is the raw
    body, used when the payload is not the `{"error": {"code", "message", ...}}` envelope;
    `request_id` (the X-Request-Id header) is used when the envelope carries none.
    """
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        code = err["code"]
        message = str(err.get("message") or code)
        request_id = err.get("request_id") or request_id
        retryable = err.get("retryable")
        return error_class(code, status_code)(
            message,
            code=code,
            status_code=status_code,
            request_id=str(request_id) if request_id is not None else None,
            retryable=bool(retryable) if retryable is not None else None,
        )
    code = f"http_{status_code}" if status_code is not None else "bad_response"
    body = text.strip()
    message = body[:500] if body else f"HTTP {status_code} with an empty body"
    retryable = status_code in (502, 503, 504)
    return error_class(code, status_code)(
        message, code=code, status_code=status_code, request_id=request_id, retryable=retryable
    )
