"""Stable machine-readable error codes (one registry) and the domain exception tree.

    AtollError                      (code, message, status, retryable)
    ├── InvalidRequest              400 invalid_request / invalid_path / io_error
    ├── Unauthorized                401 unauthorized
    ├── PermissionDenied            403 permission_denied / read_only_path (inside the sandbox)
    ├── NotFound                    404 not_found / sandbox_not_found / template_not_found /
    │                                   file_not_found / process_not_found / worker_not_found /
    │                                   pty_not_found
    ├── Conflict                    409 invalid_state / sandbox_failed / worker_conflict /
    │   │                               incompatible_protocol / worker_not_registered
    │   ├── SandboxChanged          409 sandbox_changed (retryable: another server wrote the record)
    │   ├── SandboxBusy             409 sandbox_busy (retryable)
    │   └── BuildUnavailable        409 build_unavailable (a template's build is on no ready worker
    │                                   and not in the object store: build the template again)
    ├── PayloadTooLarge             413 payload_too_large / answer_too_large
    ├── InsufficientStorage         507 disk_full (the sandbox's disk_mb quota is used up)
    ├── RuntimeFailure              500 runtime_error (a host step failed; logged with its cause)
    ├── ResumeFailed                503 resume_failed (retryable: the sandbox stays in standby, kept)
    └── Unavailable                 503 worker_unavailable / no_worker / database_unavailable (retryable)

`CODES` is the registry: every code the server may answer, with its status, whether a retry makes
sense, and what it means (docs/api.md lists the same; a test keeps the SDK mapping every code).
`message` is what the caller reads; `detail`, when set, is the internal cause, only logged.

Raised by the worker and the control plane; the control plane's HTTP layer turns them into
`{"error": {"code", "message", "request_id", "retryable"}}`, and the worker's HTTP layer into the
same envelope, which `from_code` turns back into the same class on the control plane's side.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    status: int
    retryable: bool
    meaning: str


CODES: dict[str, Code] = {
    "invalid_request": Code(400, False, "the request is malformed or fails validation"),
    "invalid_path": Code(400, False, "a file path is missing, relative, or otherwise unusable"),
    "io_error": Code(400, False, "a file call hit an input/output error inside the sandbox"),
    "unauthorized": Code(401, False, "missing or wrong bearer key or worker token"),
    "forbidden": Code(
        403, False, "the key's scope does not allow this route (tenant or worker key on an admin route)"
    ),
    "quota_exceeded": Code(
        403,
        False,
        "a tenant quota would be exceeded (the message names it, its limit and use); 429 with "
        "Retry-After for a rate (creates_per_minute)",
    ),
    "permission_denied": Code(403, False, "the sandbox's file system refused the call"),
    "read_only_path": Code(403, False, "the call would write to a read-only file system"),
    "not_found": Code(404, False, "no such route"),
    "tenant_not_found": Code(404, False, "no tenant of that id"),
    "key_not_found": Code(404, False, "no API key of that id"),
    "sandbox_not_found": Code(404, False, "no such sandbox, or it was deleted"),
    "template_not_found": Code(404, False, "no such template"),
    "file_not_found": Code(404, False, "no file or directory at the path"),
    "process_not_found": Code(404, False, "no process with that pid was started in the sandbox"),
    "process_exited": Code(409, False, "the process has exited: it takes no more input"),
    "stdin_closed": Code(409, False, "the process's stdin is closed (eof sent, or given at start)"),
    "process_running": Code(409, False, "a wait's timeout_s passed and the process still runs"),
    "worker_not_found": Code(404, False, "no such worker"),
    "pty_not_found": Code(404, False, "no terminal session with that id in the sandbox"),
    "secret_not_found": Code(404, False, "no secret of that name"),
    "volume_not_found": Code(404, False, "no volume of that name"),
    "drive_not_found": Code(404, False, "no drive of that name"),
    "snapshot_not_found": Code(
        404, False, "no snapshot of that id or name (or it belongs to another tenant)"
    ),
    "method_not_allowed": Code(405, False, "known route, wrong method"),
    "invalid_state": Code(409, False, "the sandbox's state does not allow the call"),
    "sandbox_busy": Code(409, True, "the sandbox is busy (calls in flight, or it could not be frozen)"),
    "sandbox_failed": Code(409, False, "the sandbox died underneath the call; it is now failed"),
    "worker_conflict": Code(409, False, "a worker of that name with another home is registered"),
    "secret_exists": Code(409, False, "a secret of that name exists (PUT replaces it)"),
    "template_exists": Code(409, False, "a template of that name is being built; wait for its build"),
    "template_in_use": Code(409, False, "the template has sandboxes or a pool; delete them first"),
    "build_unavailable": Code(
        409,
        False,
        "the template's build is on no ready worker and not in the object store; build the template again",
    ),
    "tenant_exists": Code(409, False, "a tenant of that name exists"),
    "tenant_in_use": Code(409, False, "the tenant still owns resources (the message lists them)"),
    "volume_exists": Code(409, False, "a volume of that name exists"),
    "drive_exists": Code(409, False, "a drive of that name exists"),
    "snapshot_exists": Code(409, False, "the tenant has a snapshot of that name already"),
    "snapshot_unavailable": Code(
        409,
        False,
        "the snapshot's worker is gone and it is not in a shared object store (or cannot be restored "
        "on the worker that fetched it)",
    ),
    "volume_in_use": Code(
        409, False, "the volume is attached to a sandbox (the error names it); delete that first"
    ),
    "drive_in_use": Code(
        409, False, "the drive is attached to sandboxes (the error names them); delete them first"
    ),
    "idempotency_key_reused": Code(
        409, False, "the Idempotency-Key named an earlier create with another body; use a new key"
    ),
    "idempotency_key_in_use": Code(
        409, True, "the first create with this Idempotency-Key is still running; retry to get its sandbox"
    ),
    "not_adoptable": Code(
        409,
        False,
        "an archived sandbox cannot move to this worker (another runsc or agent, layers not published, a volume)",
    ),
    "checkpoint_refused": Code(
        409,
        False,
        "the sandbox's state cannot be saved now (the checkpoint gate's reason); it runs on untouched",
    ),
    "sandbox_changed": Code(
        409,
        True,
        "another server wrote this sandbox's record at the same moment; retry (the call reads it again)",
    ),
    "incompatible_protocol": Code(409, False, "control plane and worker speak different protocol versions"),
    "worker_not_registered": Code(409, False, "the server does not know this registration: register again"),
    "payload_too_large": Code(413, False, "a request body is over its limit"),
    "answer_too_large": Code(413, False, "an answer atoll reads whole is over 64 MiB"),
    "disk_full": Code(507, False, "the sandbox's disk (disk_mb) is full"),
    "store_full": Code(
        507, False, "the volume or drive is full (its size_mb); free space or use a larger one"
    ),
    "runtime_error": Code(500, False, "a host step failed (runsc, mount, template build, the guest agent)"),
    "internal_error": Code(500, True, "a bug; the server log has the traceback"),
    "resume_failed": Code(
        503,
        True,
        "the sandbox could not be resumed from disk this time; it stays in standby with its files and "
        "image, and the next call tries again (after 3 failed tries it is failed, its files kept)",
    ),
    "worker_unavailable": Code(503, True, "the sandbox's worker cannot be reached right now"),
    "no_worker": Code(503, True, "no worker is ready to take a new sandbox"),
    "database_unavailable": Code(
        503, True, "the records database cannot be reached right now (restarting, network); retry"
    ),
}


MAX_MESSAGE_CHARS = 2000
"""The longest `message` an error carries: a longer one (a caller's 5,000-character id echoed in
it) keeps its start and its end (where the fix is said), the middle cut (`clip`)."""
SHOWN_CHARS = 80
"""How much of a caller's value a message quotes (`shown`)."""


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """A caller's value quoted for a message (its repr), cut to `limit` characters."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} characters)"


def clip(message: str) -> str:
    """`message` within MAX_MESSAGE_CHARS: its start and end kept, the middle cut and counted."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    head, tail = MAX_MESSAGE_CHARS * 2 // 3, MAX_MESSAGE_CHARS // 4
    return f"{message[:head]} …({len(message) - head - tail} characters cut)… {message[-tail:]}"


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
        message = clip(message)
        super().__init__(message)
        self.message = message
        # The internal cause (runsc log lines, host paths, command lines): logged by the server,
        # never sent to the caller (CONVENTIONS 4).
        self.detail = detail
        if code is not None:
            self.code = code
            known = CODES.get(code)
            if known is not None:
                self.status, self.retryable = known.status, known.retryable
        if retryable is not None:
            self.retryable = retryable


class InvalidRequest(AtollError):
    status = 400
    code = "invalid_request"


class InvalidPath(InvalidRequest):
    code = "invalid_path"


class Unauthorized(AtollError):
    status = 401
    code = "unauthorized"


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


class PtyNotFound(NotFound):
    code = "pty_not_found"


class WorkerNotFound(NotFound):
    code = "worker_not_found"


class SecretNotFound(NotFound):
    code = "secret_not_found"


class Conflict(AtollError):
    status = 409
    code = "invalid_state"


class SandboxChanged(Conflict):
    """A write from a stale copy of a sandbox's record: another server wrote it since (db.save)."""

    code = "sandbox_changed"
    retryable = True


class SandboxBusy(Conflict):
    code = "sandbox_busy"
    retryable = True


class BuildUnavailable(Conflict):
    """A template's build can be had nowhere: no ready worker holds it and it is not (whole) in the
    object store. A rebuild makes a new one."""

    code = "build_unavailable"


class FreezeTimeout(SandboxBusy):
    """The sandbox's cgroup could not be frozen in time; it was thawed and keeps running."""


class SandboxDied(Conflict):
    """The sandbox's runtime stopped underneath a call (e.g. the host OOM killer); it is now failed."""

    code = "sandbox_failed"


class IncompatibleProtocol(Conflict):
    code = "incompatible_protocol"


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


class ResumeFailed(AtollError):
    """A resume from the disk tier did not complete: the worker threw the half-restored runtime away
    and the sandbox is back in standby with its image and writable layer. Another try may work (a
    transient host failure); the control plane fails the sandbox after a few."""

    status = 503
    code = "resume_failed"
    retryable = True


class Unavailable(AtollError):
    """Nothing is wrong with the sandbox; the worker that holds it (or any worker) cannot take the
    call right now. The record is left as it was; retrying later makes sense, except after a call
    that changes something and was cut off once sent: its outcome is unknown, the message says so
    and, for a POST (which may do it twice), `retryable` is False."""

    status = 503
    code = "worker_unavailable"
    retryable = True


class DatabaseUnavailable(Unavailable):
    """The records database cannot be reached now. `made`: the sandbox a create started on its
    worker before the database went away (its start is recorded once it is back)."""

    code = "database_unavailable"
    retryable = True
    retry_after = 1.0

    def __init__(self, message: str, *, made: str | None = None):
        super().__init__(message)
        self.made = made


# The class a code is raised as (codes not listed are raised as the class of their status).
_CLASS_OF_CODE: dict[str, type[AtollError]] = {
    "invalid_path": InvalidPath,
    "sandbox_not_found": SandboxNotFound,
    "template_not_found": TemplateNotFound,
    "file_not_found": FileNotFound,
    "process_not_found": ProcessNotFound,
    "pty_not_found": PtyNotFound,
    "worker_not_found": WorkerNotFound,
    "secret_not_found": SecretNotFound,
    "sandbox_busy": SandboxBusy,
    "sandbox_failed": SandboxDied,
    "resume_failed": ResumeFailed,
    "incompatible_protocol": IncompatibleProtocol,
}
_CLASS_OF_STATUS: dict[int, type[AtollError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: PermissionDenied,
    404: NotFound,
    405: InvalidRequest,
    409: Conflict,
    413: PayloadTooLarge,
    507: InsufficientStorage,
    500: RuntimeFailure,
    503: Unavailable,
}


def from_code(code: str, message: str, *, status: int | None = None) -> AtollError:
    """Rebuild the domain error a peer (a worker, a guest agent) answered with: the class of its
    code, else of its status. An unknown code keeps its text but counts as a runtime error."""
    known = CODES.get(code)
    cls = _CLASS_OF_CODE.get(code) or _CLASS_OF_STATUS.get(
        known.status if known else (status or 500), RuntimeFailure
    )
    if known is None:  # not ours (an untrusted guest agent's, say): the status class's own code
        return cls(message)
    return cls(message, code=code)
