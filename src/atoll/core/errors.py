"""Stable machine-readable error codes and the domain exception tree.

    AtollError                      (code, message, status, retryable)
    ├── InvalidRequest              400 invalid_request / invalid_path / io_error
    ├── PermissionDenied            403 permission_denied / read_only_path (inside the sandbox)
    ├── NotFound                    404 sandbox_not_found / template_not_found / file_not_found / process_not_found
    ├── Conflict                    409 sandbox_busy / invalid_state / sandbox_failed
    ├── PayloadTooLarge             413 payload_too_large
    ├── InsufficientStorage         507 disk_full (the sandbox's disk_mb quota is used up)
    └── RuntimeFailure              500 runtime_error (a bug or a host failure; logged with its cause)

`message` is what the caller reads; `detail`, when set, is the internal cause, only logged.

Raised by the worker and the control plane; the control plane's HTTP layer turns them into
`{"error": {"code", "message", "request_id", "retryable"}}`.
"""

from __future__ import annotations


class AtollError(Exception):
    status = 500
    code = "internal_error"
    retryable = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retryable: bool | None = None,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        # The internal cause (runsc log lines, host paths, command lines): logged by the server,
        # never sent to the caller (CONVENTIONS 4).
        self.detail = detail
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable


class InvalidRequest(AtollError):
    status = 400
    code = "invalid_request"


class InvalidPath(InvalidRequest):
    code = "invalid_path"


class PermissionDenied(AtollError):
    """The sandbox's file system refused the call (permissions, or a read-only file system)."""

    status = 403
    code = "permission_denied"


class NotFound(AtollError):
    status = 404
    code = "not_found"


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class TemplateNotFound(NotFound):
    code = "template_not_found"


class FileNotFound(NotFound):
    code = "file_not_found"


class ProcessNotFound(NotFound):
    code = "process_not_found"


class Conflict(AtollError):
    status = 409
    code = "invalid_state"


class SandboxBusy(Conflict):
    code = "sandbox_busy"
    retryable = True


class FreezeTimeout(SandboxBusy):
    """The sandbox's cgroup could not be frozen in time; it was thawed and keeps running."""


class SandboxDied(Conflict):
    """The sandbox's runtime stopped underneath a call (e.g. the host OOM killer); it is now failed."""

    code = "sandbox_failed"


class PayloadTooLarge(AtollError):
    status = 413
    code = "payload_too_large"


class InsufficientStorage(AtollError):
    """The sandbox's writable layer is full; deleting files or a larger disk_mb helps, a retry does not."""

    status = 507
    code = "disk_full"


class RuntimeFailure(AtollError):
    status = 500
    code = "runtime_error"
    retryable = False  # the sandbox is usually marked failed by then: a retry would only get 409
