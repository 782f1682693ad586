"""Plain result objects of the SDK: views over the JSON the server returns. No I/O.

Built by the clients in `_async/` and `_sync/`; re-exported from `atoll`. Every object keeps
the full JSON it came from (`.data`, `.to_dict()`, `obj["field"]`), so fields the server adds
later stay reachable without an SDK release. `SandboxFields` is the attribute half of
`Sandbox` / `AsyncSandbox`; their I/O methods live in the generated/handwritten clients.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "AuditEntry",
    "ExecResult",
    "FileEntry",
    "OutputEvent",
    "Preview",
    "ProcessInfo",
    "Record",
    "SandboxFields",
    "SandboxMetrics",
    "Secret",
    "Template",
]


class Record:
    """A read-only view of one JSON object: known fields as attributes, every field by key."""

    __slots__ = ("data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data: dict[str, Any] = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the JSON object this record was built from."""
        return copy.deepcopy(self.data)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.data == other.data  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.data!r})"


class Template(Record):
    """One entry of `client.templates.list()`."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def status(self) -> str:
        return self.data.get("status", "")

    @property
    def build_id(self) -> str | None:
        return self.data.get("build_id")

    @property
    def error(self) -> str | None:
        return self.data.get("error")


class Secret(Record):
    """A stored secret as the server shows it: its name and hosts (never its value)."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def hosts(self) -> list[str]:
        return list(self.data.get("hosts", []))

    @property
    def allow_http(self) -> bool:
        """Whether plain-HTTP requests get the value too (else only HTTPS)."""
        return bool(self.data.get("allow_http", False))


class Snapshot(Record):
    """A named snapshot (`sandbox.snapshot()`, `client.snapshots`): a sandbox's state kept on its
    worker, from which `client.sandboxes.create(snapshot=...)` makes sandboxes."""

    __slots__ = ()

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def name(self) -> str | None:
        return self.data.get("name")

    @property
    def sandbox_id(self) -> str:
        return self.data["sandbox_id"]

    @property
    def memory(self) -> bool:
        """Whether it holds memory and processes (else files only: sandboxes made from it boot cold)."""
        return bool(self.data.get("memory"))

    @property
    def bytes(self) -> int:
        return int(self.data.get("bytes", 0))


class AuditEntry(Record):
    """One row of `client.audit()`: a mutation, who made it and what came of it."""

    __slots__ = ()

    @property
    def at(self) -> str:
        """When it was answered (ISO 8601, UTC)."""
        return self.data["at"]

    @property
    def key_id(self) -> str | None:
        """The key used ("admin" for the installation's ATOLL_API_KEY); None: no valid key."""
        return self.data.get("key_id")

    @property
    def tenant_id(self) -> str | None:
        return self.data.get("tenant_id")

    @property
    def action(self) -> str:
        """e.g. "sandbox.create", "secret.put", "key.create"."""
        return self.data["action"]

    @property
    def target(self) -> str | None:
        """The ids and names it acted on ("sb-…", "tn-…/ak-…")."""
        return self.data.get("target")

    @property
    def status(self) -> int:
        """The HTTP status of the answer."""
        return int(self.data.get("result", {}).get("status", 0))

    @property
    def error(self) -> str | None:
        """The error code of a failure (e.g. "forbidden"), else None."""
        return self.data.get("result", {}).get("error")

    @property
    def request_id(self) -> str | None:
        return self.data.get("request_id")

    @property
    def source(self) -> str | None:
        """The client's address."""
        return self.data.get("source")


class Preview(Record):
    """A sandbox port's preview: `url` (send `token` as the `Atoll-Access-Token` header), or
    `signed_url` (works without a header until `expires_at`); `headers` route to the port on any
    host name (for clients without wildcard DNS)."""

    __slots__ = ()

    @property
    def url(self) -> str:
        return self.data["url"]

    @property
    def token(self) -> str:
        return self.data["token"]

    @property
    def public(self) -> bool:
        return bool(self.data.get("public"))

    @property
    def port(self) -> int:
        return int(self.data["port"])

    @property
    def signed_url(self) -> str:
        return self.data["signed_url"]

    @property
    def expires_at(self) -> int:
        return int(self.data["expires_at"])

    @property
    def headers(self) -> dict[str, str]:
        """The routing headers and the token: everything a request to this port needs."""
        return {**self.data.get("headers", {}), "Atoll-Access-Token": self.token}


class FileEntry(Record):
    """One entry of `sandbox.files.list(dir)`; `type` is e.g. "file", "dir" or "symlink"."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def path(self) -> str:
        return self.data["path"]

    @property
    def raw_path(self) -> bytes:
        """The path's exact bytes (from `path_b64`): pass it to read/remove/list when `path` is lossy,
        as it is for names that are not UTF-8."""
        encoded = self.data.get("path_b64")
        if encoded is None:
            return str(self.data["path"]).encode("utf-8", "surrogateescape")
        return base64.b64decode(encoded)

    @property
    def type(self) -> str:
        return self.data.get("type", "file")

    @property
    def size(self) -> int | None:
        return self.data.get("size")

    @property
    def is_dir(self) -> bool:
        return self.type in ("dir", "directory")


class ProcessInfo(Record):
    """One entry of `sandbox.processes()`: a background process started with `exec(background=True)`."""

    __slots__ = ()

    @property
    def pid(self) -> int:
        return int(self.data["pid"])

    @property
    def cmd(self) -> str | list[str] | None:
        return self.data.get("cmd")

    @property
    def running(self) -> bool:
        return bool(self.data.get("running", False))

    @property
    def exit_code(self) -> int | None:
        return self.data.get("exit_code")

    @property
    def signal(self) -> int | None:
        """The signal that ended it, whoever sent it (`exit_code` is then 128 + it); None when it
        exited by itself or still runs."""
        return self.data.get("signal")

    @property
    def stdin_open(self) -> bool:
        """Its stdin pipe takes input (`process.send_stdin`)."""
        return bool(self.data.get("stdin_open", False))

    @property
    def output_bytes(self) -> int:
        """The offset after the newest byte of its output (stdout and stderr counted together)."""
        return int(self.data.get("output_bytes", 0))


@dataclass(frozen=True)
class OutputEvent:
    """One line of a background process's output (`process.output()`): a piece of `stdout` or
    `stderr` (`text`), `dropped` (output before `offset` is no longer kept: `dropped` bytes were
    skipped), `exit` (the last one: `exit_code`, `timed_out`, `duration_ms`, and `signal` when a
    signal ended it, whoever sent it) or `ended` (the last one when the sandbox was paused by a
    pause that ends streams, `text` "paused": the process runs on after a resume). `offset` is the
    byte offset after the event: pass it to `output(offset=...)` to resume there."""

    kind: str
    offset: int
    text: str = ""
    dropped: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    duration_ms: int | None = None
    signal: int | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> OutputEvent:
        offset = int(obj.get("offset", 0))
        for kind in ("stdout", "stderr"):
            if isinstance(obj.get(kind), str):
                return cls(kind, offset, text=obj[kind])
        if "dropped" in obj:
            return cls("dropped", offset, dropped=int(obj["dropped"]))
        if isinstance(obj.get("ended"), str):
            return cls("ended", offset, text=obj["ended"])
        return cls(
            "exit",
            offset,
            exit_code=obj.get("exit_code"),
            timed_out=bool(obj.get("timed_out", False)),
            duration_ms=obj.get("duration_ms"),
            signal=obj.get("signal"),
        )


class SandboxMetrics(Record):
    """`sandbox.metrics()`: resource figures now. A sandbox in standby is not woken for them:
    `cpu_percent` is 0 and `processes` None."""

    __slots__ = ()

    @property
    def cpu_percent(self) -> float:
        """Share of one CPU used over about the last 2 s, in percent."""
        return float(self.data.get("cpu_percent") or 0.0)

    @property
    def memory_used_mb(self) -> float:
        return float(self.data.get("memory_used_mb") or 0.0)

    @property
    def memory_limit_mb(self) -> int:
        return int(self.data.get("memory_limit_mb") or 0)

    @property
    def disk_used_mb(self) -> float:
        return float(self.data.get("disk_used_mb") or 0.0)

    @property
    def disk_limit_mb(self) -> int:
        return int(self.data.get("disk_limit_mb") or 0)

    @property
    def processes(self) -> int | None:
        return self.data.get("processes")

    @property
    def state(self) -> str:
        return self.data.get("state", "")


@dataclass(frozen=True)
class ExecResult:
    """The outcome of a foreground `sandbox.exec(...)`."""

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    duration_ms: int | None = None
    stdout_truncated_bytes: int = 0
    """Bytes of stdout the server left out (a marker in `stdout` shows where); 0 when complete."""
    stderr_truncated_bytes: int = 0

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def truncated(self) -> bool:
        """True when part of the output was left out (see `max_output_bytes` of `exec`)."""
        return bool(self.stdout_truncated_bytes or self.stderr_truncated_bytes)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExecResult:
        return cls(
            exit_code=data.get("exit_code"),
            stdout=data.get("stdout") or "",
            stderr=data.get("stderr") or "",
            timed_out=bool(data.get("timed_out", False)),
            duration_ms=data.get("duration_ms"),
            stdout_truncated_bytes=int(data.get("stdout_truncated_bytes") or 0),
            stderr_truncated_bytes=int(data.get("stderr_truncated_bytes") or 0),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SandboxFields:
    """Attribute access to a sandbox's JSON; mixed into `Sandbox` and `AsyncSandbox`.

    `created_at` / `updated_at` are the server's ISO-8601 strings. Methods of the sandbox
    classes that get a sandbox object back call `_update` so the instance stays current.
    """

    data: dict[str, Any]

    def _update(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the latest sandbox object the server returned."""
        return copy.deepcopy(self.data)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def state(self) -> str:
        """One of creating, running, standby, deleted, failed."""
        return self.data.get("state", "")

    @property
    def standby_tier(self) -> str | None:
        """None while running; "memory", "disk" or "archive" while in standby."""
        return self.data.get("standby_tier")

    @property
    def standby_reason(self) -> str | None:
        return self.data.get("standby_reason")

    @property
    def template(self) -> str | None:
        return self.data.get("template")

    @property
    def metadata(self) -> dict[str, str]:
        return self.data.get("metadata") or {}

    @property
    def env(self) -> dict[str, str]:
        return self.data.get("env") or {}

    @property
    def created_at(self) -> str | None:
        return self.data.get("created_at")

    @property
    def updated_at(self) -> str | None:
        return self.data.get("updated_at")

    @property
    def idle_timeout_s(self) -> float | None:
        return self.data.get("idle_timeout_s")

    @property
    def disk_after_s(self) -> float | None:
        return self.data.get("disk_after_s")

    @property
    def memory_mb(self) -> int | None:
        return self.data.get("memory_mb")

    @property
    def cpus(self) -> float | None:
        return self.data.get("cpus")

    @property
    def disk_mb(self) -> int | None:
        return self.data.get("disk_mb")

    @property
    def user(self) -> str | None:
        """Default user of exec calls (None: the template's default, root)."""
        return self.data.get("user")

    @property
    def shell(self) -> str | None:
        """Shell of string commands: "bash" (`bash -l -c`), "sh"; None: bash when the sandbox has it."""
        return self.data.get("shell")

    @property
    def network(self) -> dict[str, list[str]]:
        """Egress policy: {"allow_out": [...], "deny_out": [...]} (both empty: no way out)."""
        return self.data.get("network") or {"allow_out": [], "deny_out": []}

    @property
    def failure_reason(self) -> str | None:
        return self.data.get("failure_reason")

    @property
    def resume_error(self) -> str | None:
        """Why the last resume from the disk tier failed (the sandbox stays in standby and the next
        call tries again); None once a resume succeeds."""
        return self.data.get("resume_error")

    @property
    def expires_at(self) -> str | None:
        """End of its lifetime (ISO 8601, UTC; `timeout_s` at create, `update(timeout_s=)`); None: none."""
        return self.data.get("expires_at")

    @property
    def on_timeout(self) -> str:
        """What the end of its lifetime does: "pause" (to the disk tier) or "delete"."""
        return self.data.get("on_timeout") or "pause"

    @property
    def on_worker_lost(self) -> str:
        """What happens to it once its worker has been lost for the server's ATOLL_WORKER_GONE_S:
        "fail" or "restore" (back on another worker from its last archive)."""
        return self.data.get("on_worker_lost") or "fail"

    @property
    def worker_state(self) -> str | None:
        """The state of the worker that holds it, as last seen: "ready", "draining", "joining" or
        "lost" (calls answer worker_unavailable until it is back); None: unknown."""
        return self.data.get("worker_state")

    def __repr__(self) -> str:
        tier = f", standby_tier={self.standby_tier!r}" if self.standby_tier else ""
        return f"{type(self).__name__}(id={self.data.get('id')!r}, state={self.state!r}{tier})"


class FileStat(Record):
    """`sandbox.files.stat(path)`: one path's lstat (a symlink is reported as itself)."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def path(self) -> str:
        return self.data["path"]

    @property
    def raw_path(self) -> bytes:
        """The path's exact bytes (from `path_b64`)."""
        encoded = self.data.get("path_b64")
        if encoded is None:
            return str(self.data["path"]).encode("utf-8", "surrogateescape")
        return base64.b64decode(encoded)

    @property
    def type(self) -> str:
        """ "file", "dir", "symlink" or "other"."""
        return self.data["type"]

    @property
    def size(self) -> int:
        return self.data["size"]

    @property
    def mode(self) -> int:
        """The permission bits, e.g. 0o644."""
        return self.data["mode"]

    @property
    def mtime(self) -> float:
        return self.data["mtime"]

    @property
    def target(self) -> str | None:
        """A symlink's target as stored, else None."""
        return self.data.get("target")

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @property
    def is_file(self) -> bool:
        return self.type == "file"

    @property
    def is_symlink(self) -> bool:
        return self.type == "symlink"


class FileEvent(Record):
    """One change seen by `sandbox.files.watch(dir)`: `type` is "create", "modify", "delete",
    "rename" (`from_path` is the old path), "chmod" or "overflow" (events were lost; the watch ends)."""

    __slots__ = ()

    @property
    def type(self) -> str:
        return self.data["type"]

    @property
    def path(self) -> str:
        return self.data["path"]

    @property
    def is_dir(self) -> bool:
        return bool(self.data.get("is_dir"))

    @property
    def from_path(self) -> str | None:
        return self.data.get("from")
