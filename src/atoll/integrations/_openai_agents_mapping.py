"""The framework-free half of the OpenAI Agents SDK adapter: what an `AtollSandboxClientOptions` and
a manifest's environment become in `client.sandboxes.create(...)`, how a command the Agents SDK
prepared becomes an atoll exec, how atoll errors are classified, and the bytes that stand for a
fork snapshot in the SDK's snapshot store.

Imported by `openai_agents._session` and `._client` (which hold the `agents` classes) and by the
unit tests, which run without `openai-agents` installed: this module imports neither `agents` nor
pydantic, and sits outside the `openai_agents` package, whose import needs the extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from atoll import errors

INSTALL_HINT = "pip install 'atoll[openai-agents]'"

BACKEND_ID = "atoll"

# Options that go to `sandboxes.create` unchanged when set (None = the server's default).
CREATE_FIELDS = (
    "template",
    "metadata",
    "memory_mb",
    "cpus",
    "disk_mb",
    "user",
    "network",
    "secrets",
    "timeout_s",
    "on_timeout",
    "idle_timeout_s",
    "standby",
    "volumes",
    "drives",
    "shell",
)

# A fork snapshot is not a tar: the SDK's snapshot store keeps these bytes, and hydrating from
# them forks the sandbox they name. The prefix cannot begin a tar (a tar starts with a file name
# followed by NULs, never with this line).
SNAPSHOT_MAGIC = b"ATOLL_SANDBOX_SNAPSHOT_V1\n"


def create_kwargs(options: Mapping[str, Any], manifest_env: Mapping[str, str]) -> dict[str, Any]:
    """Keyword arguments of `client.sandboxes.create` for these options (a dict of the options
    model's fields) and the manifest's resolved environment, which wins over `options["env"]` as
    it does for the SDK's own providers. Only what is set is passed: the server fills its defaults.
    """
    kwargs: dict[str, Any] = {name: options[name] for name in CREATE_FIELDS if options.get(name) is not None}
    env = {**dict(options.get("env") or {}), **dict(manifest_env)}
    if env:
        kwargs["env"] = env
    return kwargs


EXEC_TIMEOUT_MAX_S = 86400.0  # the server's bound of an exec's timeout_s


def exec_timeout_s(timeout: float | None) -> float | None:
    """An Agents SDK exec timeout as atoll's `timeout_s` (0 < timeout_s <= 86400; None: no limit).
    The SDK allows 0 or less (fail at once) and more than a day, which the server would refuse."""
    if timeout is None:
        return None
    return min(max(float(timeout), 0.001), EXEC_TIMEOUT_MAX_S)


def split_user(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """The Agents SDK runs a command as another user by prefixing `sudo -u NAME --`; atoll's exec
    takes the user as a field (no sudo needed in the template). Returns (argv, user)."""
    argv = [str(part) for part in argv]
    if len(argv) >= 4 and argv[0] == "sudo" and argv[1] == "-u" and argv[3] == "--":
        return argv[4:], argv[2]
    return argv, None


def encode_snapshot_ref(sandbox_id: str) -> bytes:
    return SNAPSHOT_MAGIC + sandbox_id.encode("ascii")


def decode_snapshot_ref(raw: bytes) -> str | None:
    """The sandbox id a fork snapshot names, or None when `raw` is something else (a tar)."""
    if not raw.startswith(SNAPSHOT_MAGIC):
        return None
    sandbox_id = raw[len(SNAPSHOT_MAGIC) :].decode("ascii", errors="replace").strip()
    return sandbox_id or None


def error_kind(error: BaseException) -> str:
    """How the adapter reports an atoll error in the Agents SDK's terms: "not_found" (a missing
    file or directory: WorkspaceReadNotFoundError), "timeout" (the HTTP call timed out:
    ExecTimeoutError for exec), "gone" (the sandbox is no longer there), or "transport" (every
    other API error: ExecTransportError / WorkspaceArchive*Error, carrying atoll's code and
    message and its retryable flag)."""
    if isinstance(error, errors.FileNotFound):
        return "not_found"
    if isinstance(error, errors.APITimeoutError):
        return "timeout"
    if isinstance(error, errors.SandboxNotFound):
        return "gone"
    return "transport"


def error_context(error: BaseException) -> dict[str, object]:
    """What the Agents SDK's error `context` carries about an atoll error."""
    if isinstance(error, errors.AtollError):
        context: dict[str, object] = {"backend": BACKEND_ID, "code": error.code, "detail": error.message}
        if error.request_id:
            context["request_id"] = error.request_id
        return context
    return {"backend": BACKEND_ID, "detail": f"{type(error).__name__}: {error}"}


def retryable(error: BaseException) -> bool | None:
    return error.retryable if isinstance(error, errors.AtollError) else None
