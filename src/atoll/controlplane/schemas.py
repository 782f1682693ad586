"""Wire models of the public REST API (pydantic v2): request bodies with their limits, the sandbox
view, and the models of every answer (they feed /openapi.json; answers are built as plain JSON).

Called by the routers (controlplane.routes_*); the same models feed /openapi.json.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import JsonDict

from atoll.controlplane import db as dbm
from atoll.core import ids, templatespec, worker_api
from atoll.guest.agent import ptyframes

DEFAULT_MEMORY_MB = 512  # also the size of the template image made at start-up
NEXT_CURSOR = Field(
    default=None,
    description="Pass it as `?cursor=` for the next page (controlplane.paging); null on the last page",
)

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# What the validators below check, told in /openapi.json too (the validators' messages stay theirs).
_ENV_SCHEMA: JsonDict = {"propertyNames": {"pattern": _ENV_KEY.pattern}}
_USER_SCHEMA: JsonDict = {"pattern": _USER.pattern}


def _check_env(v: dict[str, str] | None) -> dict[str, str] | None:
    if v is None:
        return v
    for k, val in v.items():
        if not _ENV_KEY.fullmatch(k):
            raise ValueError(
                f"environment variable name {k!r} is invalid; use letters, digits and '_' (not first a digit)"
            )
        if "\x00" in val:
            raise ValueError(f"environment variable {k!r} contains a NUL byte")
    return v


def _check_sandbox_env(v: dict[str, str] | None) -> dict[str, str] | None:
    """A sandbox's env is its commands' env: a PATH that can find nothing (a control character, no
    absolute directory) is refused here, naming PATH (an exec's env may set any PATH)."""
    v = _check_env(v)
    if v and "PATH" in v and (problem := templatespec.path_problem(v["PATH"])):
        raise ValueError(f"env: {problem}")
    return v


MAX_LIFETIME_S = 30 * 86400
_TIMEOUT_DOC = "Lifetime in seconds from now (> 0, at most 30 days); at its end `on_timeout` happens"
_ON_TIMEOUT_DOC = (
    'What the end of the lifetime does: "pause" (to the disk tier; the lifetime is then cleared) or "delete"'
)
_ON_WORKER_LOST_DOC = (
    "What happens to it when its worker has been lost for ATOLL_WORKER_GONE_S while it runs or is in "
    'the memory or disk tier: "fail" (failed, with the reason), or "restore": it comes back on another '
    "worker from its last archive in the object store (its state as of that archive: what changed since "
    "is lost; with no archive it fails). An archive-tier sandbox moves in either case"
)


def _check_lifetime(v: object) -> object:
    """A lifetime must end in the future: a clear message for what the bounds would refuse."""
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(
            f"timeout_s must be a number of seconds from now, got {type(v).__name__} {v!r}; "
            "e.g. 3600 (or null for no lifetime)"
        )
    if not v > 0:
        raise ValueError(
            f"timeout_s={v} would end the lifetime now or in the past; give seconds from now (> 0), "
            "or null for no lifetime"
        )
    if not v <= MAX_LIFETIME_S:
        raise ValueError(
            f"timeout_s={v} is over the longest lifetime, {MAX_LIFETIME_S} s (30 days); give less, "
            "or null for no lifetime (extend it later with PATCH)"
        )
    return v


class NetworkPolicy(BaseModel):
    """Egress policy: default deny; `deny_out` wins over `allow_out` (docs/api.md, "Network")."""

    model_config = ConfigDict(extra="forbid")

    allow_out: list[str] = Field(
        default_factory=list,
        max_length=512,
        description="Domains (pypi.org), wildcard domains (*.github.com), IPv4 addresses or networks "
        "(203.0.113.7, 10.0.0.0/8) or * (the public internet), each optionally with :PORT",
    )
    deny_out: list[str] = Field(
        default_factory=list, max_length=512, description="Same entries; wins over allow_out"
    )


Shell = Literal["bash", "sh"]


class MountRequest(BaseModel):
    """A volume or drive mounted into a new sandbox."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The volume's or drive's name", max_length=64)
    path: str = Field(
        description="Absolute directory inside the sandbox (not /, /proc, /dev, /sys, /tmp, /etc, /opt/atoll)"
    )
    read_only: pydantic.StrictBool = Field(False, description="Mount it read-only")


class CreateStore(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="1-64 letters, digits, '_', '.', '-' (starting with a letter or digit)")
    size_mb: int = Field(description="Its size limit in MB (8 to 1048576): writes past it fail with ENOSPC")


class CloneStore(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The copy's name")


class Volume(BaseModel):
    name: str
    size_mb: int
    used_mb: float
    attached_to: str | None = Field(description="The sandbox that has it mounted (null: none)")
    worker_id: str
    created_at: str | None


class Drive(BaseModel):
    name: str
    size_mb: int
    used_mb: float
    attached_to: list[str] = Field(description="The live sandboxes that have it mounted")
    worker_id: str
    created_at: str | None


class VolumeList(BaseModel):
    items: list[Volume]
    next_cursor: str | None = NEXT_CURSOR


class DriveList(BaseModel):
    items: list[Drive]
    next_cursor: str | None = NEXT_CURSOR


class StandbyPolicy(BaseModel):
    """When an idle sandbox moves down the standby tiers (controlplane.policy); a field left out
    keeps the server's default (memory_s 15, disk_s 300, archive_after_s 0 = never)."""

    model_config = ConfigDict(extra="forbid")

    memory_s: float | None = Field(
        None,
        ge=0,
        le=7 * 86400,
        description="Seconds without activity before the memory tier (0 = never); alias of idle_timeout_s",
    )
    disk_s: float | None = Field(
        None,
        ge=0,
        le=30 * 86400,
        description="Seconds in the memory tier before disk (0 = never); alias of disk_after_s",
    )
    archive_after_s: float | None = Field(
        None,
        ge=0,
        le=365 * 86400,
        description="Seconds in standby (memory and disk together) before a disk-tier sandbox moves to "
        "the archive tier, the object store (0 = never)",
    )


class StandbySettings(BaseModel):
    """A sandbox's standby policy as it is (GET): memory_s and disk_s are idle_timeout_s and disk_after_s."""

    memory_s: float
    disk_s: float
    archive_after_s: float


_STANDBY_ALIASES = (("memory_s", "idle_timeout_s"), ("disk_s", "disk_after_s"))


class E2BOptions(BaseModel):
    """E2B's per-sandbox lifecycle, sent by atoll's E2B port (atoll.e2b) on create and kept in
    the sandbox's `compat` (docs/e2b-compat.md §6.4). Internal but documented: any caller may
    send it, and it changes only how the E2B port treats the sandbox."""

    model_config = ConfigDict(extra="forbid")

    auto_resume: pydantic.StrictBool = Field(
        False,
        description="E2B's `autoResume.enabled`: envd calls to the sandbox in standby resume it; "
        "without it they answer 502 (paused) until `Sandbox.connect`",
    )
    on_timeout: Literal["kill", "pause"] = Field(
        "kill",
        description='E2B\'s end of the lifetime: "kill" (atoll\'s on_timeout "delete") or "pause"; '
        "sets on_timeout when that is not given, and must agree with it when it is",
    )


class Compat(BaseModel):
    """A sandbox's `compat`: E2B's lifecycle when it was created through the E2B port."""

    created_via: Literal["e2b"]
    auto_resume: bool = Field(description="envd calls resume it from standby (else 502 until connect)")
    on_timeout: Literal["kill", "pause"] = Field(description="E2B's name for its on_timeout")


class CreateSandbox(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant_id: str | None = Field(
        None,
        description="The tenant it belongs to (admin keys only; a tenant key's is its own; default: `default`)",
    )
    shell: Shell | None = Field(
        None, description="Shell of string commands: bash (`bash -l -c`), sh; default bash when present"
    )

    template: str = Field("base", max_length=64, description="Template name (GET /v1/templates)")
    snapshot: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="A snapshot of yours (its id or name, GET /v1/snapshots) to start from instead of a "
        "template: its files, and with a memory snapshot its memory and running processes. The sandbox "
        "takes the snapshot's template, user, workdir, disk size and (for a memory snapshot) memory_mb; "
        "it is made on the worker that keeps the snapshot; no volumes or drives",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of every process in the sandbox",
        json_schema_extra=_ENV_SCHEMA,
    )
    metadata: dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=64
    )
    idle_timeout_s: float = Field(
        15, ge=0, le=7 * 86400, description="Seconds without activity before standby (0 = never)"
    )
    disk_after_s: float = Field(
        300, ge=0, le=30 * 86400, description="Seconds in the memory tier before moving to disk (0 = never)"
    )
    memory_mb: int = Field(
        DEFAULT_MEMORY_MB, ge=64, le=65536, description="Memory the sandbox's programs may use"
    )
    cpus: float = Field(
        1,
        ge=0.01,
        le=64,
        description="CPU cores (enforced with a CFS quota; at least 0.01, its 1 ms per 100 ms minimum)",
    )
    disk_mb: int | None = Field(
        None, ge=64, le=1024 * 1024, description="Quota of the writable layer (default 4096)"
    )
    user: str | None = Field(
        None, description="Default user of exec calls (default root)", json_schema_extra=_USER_SCHEMA
    )
    network: NetworkPolicy | None = Field(None, description="Egress policy (default: no way out)")
    volumes: list[MountRequest] | None = Field(
        None,
        description="Volumes to mount (one holder at a time: a volume another sandbox has is 409 volume_in_use). "
        "A sandbox with volumes or drives boots cold (its template's start command runs)",
    )
    drives: list[MountRequest] | None = Field(None, description="Drives to mount (shared by many sandboxes)")
    secrets: dict[str, str] | None = Field(
        None,
        max_length=64,
        description="Secrets by environment variable: {ENV: secret_name}. The sandbox sees a placeholder "
        "in ENV; its egress gateway replaces it with the value in requests to the secret's hosts",
        json_schema_extra=_ENV_SCHEMA,
    )
    # the lifetime (controlplane.lifetime)
    timeout_s: float | None = Field(
        None, gt=0, le=MAX_LIFETIME_S, description=_TIMEOUT_DOC + " (default: none, it lives until deleted)"
    )
    on_timeout: Literal["pause", "delete"] = Field("pause", description=_ON_TIMEOUT_DOC)
    on_worker_lost: Literal["fail", "restore"] = Field("fail", description=_ON_WORKER_LOST_DOC)
    standby: StandbyPolicy | None = Field(
        None,
        description="Standby policy {memory_s, disk_s, archive_after_s}; memory_s and disk_s are "
        "idle_timeout_s and disk_after_s by other names (give either form, or both with equal values)",
    )

    e2b: E2BOptions | None = Field(
        None,
        description="Sent by atoll's E2B port (docs/e2b-compat.md): E2B's lifecycle options, kept as "
        'the sandbox\'s `compat` {"created_via": "e2b", "auto_resume", "on_timeout"}',
    )

    _v_timeout = field_validator("timeout_s", mode="before")(classmethod(lambda cls, v: _check_lifetime(v)))
    _v_env = field_validator("env")(classmethod(lambda cls, v: _check_sandbox_env(v)))

    @pydantic.model_validator(mode="after")
    def _v_e2b(self) -> CreateSandbox:
        """E2B's on_timeout sets atoll's when that is not given; given, the two must agree."""
        if self.e2b is None:
            return self
        want = "delete" if self.e2b.on_timeout == "kill" else "pause"
        if "on_timeout" in self.model_fields_set and self.on_timeout != want:
            raise ValueError(
                f"e2b.on_timeout={self.e2b.on_timeout!r} and on_timeout={self.on_timeout!r} disagree "
                f'(E2B\'s "kill" is atoll\'s "delete"); give one of them'
            )
        self.on_timeout = want  # type: ignore[assignment]
        return self

    def compat(self) -> dict | None:
        """The sandbox's `compat` record (db.SandboxRecord.compat) for this create."""
        if self.e2b is None:
            return None
        return {"created_via": "e2b", "auto_resume": self.e2b.auto_resume, "on_timeout": self.e2b.on_timeout}

    @pydantic.model_validator(mode="after")
    def _v_standby(self) -> CreateSandbox:
        """Fold `standby`'s aliases into idle_timeout_s / disk_after_s; both forms must agree."""
        if self.standby is None:
            return self
        for alias, name in _STANDBY_ALIASES:
            value = getattr(self.standby, alias)
            if value is None:
                continue
            if name in self.model_fields_set and getattr(self, name) != value:
                raise ValueError(
                    f"standby.{alias}={value:g} and {name}={getattr(self, name):g} disagree (they are "
                    f"the same setting); give one of them"
                )
            setattr(self, name, value)
        return self

    @property
    def archive_after_s(self) -> float:
        return (self.standby.archive_after_s if self.standby else None) or 0.0

    @field_validator("user")
    @classmethod
    def _v_user(cls, v: str | None) -> str | None:
        if v is not None and not _USER.fullmatch(v):
            raise ValueError(
                f"user {v!r} is not a valid user name (lower-case letters, digits, '_' or '-'); uids are not accepted"
            )
        return v


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str] = Field(
        ...,
        description="Shell string (run with `bash -l -c`, or `sh -c`: see `shell`) or argv list",
        json_schema_extra={"minLength": 1, "minItems": 1},
    )
    cwd: str | None = Field(
        None, description="Absolute working directory inside the sandbox", json_schema_extra={"pattern": "^/"}
    )
    env: dict[str, str] | None = Field(None, json_schema_extra=_ENV_SCHEMA)
    timeout_s: float | None = Field(None, gt=0, le=86400)
    background: pydantic.StrictBool = False
    user: str | None = Field(None, json_schema_extra=_USER_SCHEMA)
    max_output_bytes: int | None = Field(
        None,
        ge=1,
        description=(
            "Bytes of each stream kept in a non-streamed answer (its first and last halves, with a marker "
            "naming the bytes dropped between); default and upper bound: the server's "
            "ATOLL_MAX_EXEC_OUTPUT_KB. Streamed output (Accept: application/x-ndjson) is never cut."
        ),
    )
    stdin: str | None = Field(
        None,
        description="Text fed to the command's stdin, which is then closed (default: /dev/null; a "
        "background process without it gets a stdin pipe for POST …/processes/{pid}/stdin)",
    )
    shell: Shell | None = Field(
        None,
        description="What runs a string cmd: bash (`bash -l -c`) or sh (`sh -c`); default: the "
        "sandbox's shell, else bash when the sandbox has /bin/bash",
    )

    _v_env = field_validator("env")(classmethod(lambda cls, v: _check_env(v)))

    @field_validator("user")
    @classmethod
    def _v_user(cls, v: str | None) -> str | None:
        if v is not None and not _USER.fullmatch(v):
            raise ValueError(f"user {v!r} is not a valid user name (lower-case letters, digits, '_' or '-')")
        return v

    @field_validator("cmd")
    @classmethod
    def _v_cmd(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("cmd is an empty string; give a shell command or an argv list")
            if "\x00" in v:
                raise ValueError("cmd contains a NUL byte")
        else:
            if not v:
                raise ValueError("cmd is an empty list; give at least the program to run")
            if any("\x00" in a for a in v):
                raise ValueError("an argument of cmd contains a NUL byte")
        return v

    @field_validator("cwd")
    @classmethod
    def _v_cwd(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"cwd {v!r} must be an absolute path inside the sandbox")
        return v


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tier: Literal["memory", "disk", "archive"] = "memory"
    end_streams: bool = Field(
        False,
        description="End the sandbox's open process output follows and file watches (each with a last "
        '`{"ended": "paused", …}` line, a watch with an `ended` event) instead of refusing the pause '
        "with 409 sandbox_busy; the processes run on after a resume. Calls that are not such streams "
        "(a command, a file transfer) still make the pause 409 sandbox_busy. What E2B's pause does.",
    )


def _no_default(schema: JsonDict) -> None:
    """A PATCH field has no default: what is not sent keeps its value (the model's defaults are
    never applied, see lifetime.update)."""
    schema.pop("default", None)


class UpdateSandbox(BaseModel):
    """PATCH /v1/sandboxes/{id}: only the fields sent change (same bounds as the create)."""

    model_config = ConfigDict(extra="forbid")

    idle_timeout_s: float = Field(
        15,
        ge=0,
        le=7 * 86400,
        description="Seconds without activity before standby (0 = never)",
        json_schema_extra=_no_default,
    )
    disk_after_s: float = Field(
        300,
        ge=0,
        le=30 * 86400,
        description="Seconds in the memory tier before disk (0 = never)",
        json_schema_extra=_no_default,
    )
    archive_after_s: float = Field(
        0,
        ge=0,
        le=365 * 86400,
        description="Seconds in standby before a disk-tier sandbox moves to the archive (0 = never)",
        json_schema_extra=_no_default,
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=MAX_LIFETIME_S,
        description=_TIMEOUT_DOC + "; null removes the lifetime",
        json_schema_extra=_no_default,
    )
    on_timeout: Literal["pause", "delete"] = Field(
        "pause", description=_ON_TIMEOUT_DOC, json_schema_extra=_no_default
    )
    on_worker_lost: Literal["fail", "restore"] = Field(
        "fail", description=_ON_WORKER_LOST_DOC, json_schema_extra=_no_default
    )
    metadata: dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict,
        max_length=64,
        description="Replaces the labels ({} removes them all)",
        json_schema_extra=_no_default,
    )

    @pydantic.model_validator(mode="before")
    @classmethod
    def _v_fields(cls, data: object) -> object:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(
                    f"unknown field(s) {', '.join(map(repr, unknown))}; PATCH changes only "
                    + ", ".join(cls.model_fields)
                )
            for name in (
                "idle_timeout_s",
                "disk_after_s",
                "archive_after_s",
                "on_timeout",
                "on_worker_lost",
                "metadata",
            ):
                if name in data and data[name] is None:
                    raise ValueError(f"{name} cannot be null; leave it out to keep its value")
        return data

    _v_timeout = field_validator("timeout_s", mode="before")(classmethod(lambda cls, v: _check_lifetime(v)))


class CreateSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="1-64 letters, digits, '_', '.' or '-'", max_length=64)
    value: str = Field(..., description="The value (never returned); no control characters", max_length=65536)
    hosts: list[str] = Field(
        ..., max_length=64, description="Host names the value may be sent to: api.example.com, *.example.com"
    )
    allow_http: pydantic.StrictBool = Field(
        False,
        description="Also put the value in plain-HTTP requests to these hosts (clear text on the wire); "
        "by default only HTTPS requests get it",
    )


class ReplaceSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="If given, the path's name", max_length=64)
    value: str = Field(..., max_length=65536)
    hosts: list[str] = Field(..., max_length=64)
    allow_http: pydantic.StrictBool = Field(False, description="As at create; not given = false")


class Secret(BaseModel):
    name: str
    tenant_id: str | None = None
    hosts: list[str]
    allow_http: bool = Field(description="Whether plain-HTTP requests get the value too")
    created_at: str | None
    updated_at: str | None


class SecretList(BaseModel):
    items: list[Secret]
    next_cursor: str | None = NEXT_CURSOR


class PreviewUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    public: pydantic.StrictBool = Field(..., description="Serve this port without a token")


class Preview(BaseModel):
    sandbox_id: str
    port: int
    url: str = Field(description="https://{port}-{sandbox_id}.{ATOLL_PREVIEW_DOMAIN}:{ATOLL_INGRESS_PORT}/")
    token: str = Field(description="The sandbox's access token: send it as the Atoll-Access-Token header")
    public: bool
    signed_url: str = Field(description="The URL with a signature valid until expires_at (no header needed)")
    expires_at: int
    headers: dict[str, str] = Field(description="Headers that route to this port on any host name")


class GrantWorker(BaseModel):
    id: str
    name: str = Field(description="The name its TLS certificate carries")
    tunnel_port: int = Field(
        description="Its port tunnel (terminals: an `ATOLL-PTY` hello with `grant:<grant>`)"
    )
    url: str = Field(description="The worker protocol's base URL (https:// across machines)")


class GrantDefaults(BaseModel):
    """What the API fills into a data call itself, for the edge to do the same."""

    workdir: str | None = Field(description="Where relative file paths start")
    user: str | None = Field(description="The sandbox's default user (an exec without `user` runs as it)")
    shell: str | None = Field(description="The sandbox's shell for string commands (null: bash if present)")
    max_output_bytes: int = Field(description="This server's cap per stream of a non-streamed exec")
    max_file_bytes: int = Field(description="This server's cap on a file upload (ATOLL_MAX_FILE_MB)")


class GrantRequest(BaseModel):
    """The optional body of `POST /v1/sandboxes/{id}/grant`."""

    resume: bool = Field(
        True, description="Resume the sandbox when it is in standby (false: answer 409 invalid_state)"
    )


class Grant(BaseModel):
    sandbox_id: str
    worker: GrantWorker
    grant: str = Field(
        description="`<sandbox_id>.<expires>.<scope>.<mac>`: send it to the worker as "
        "`Authorization: Grant <grant>`; it opens this sandbox's data verbs only"
    )
    expires_at: int = Field(description="Unix seconds after which the worker refuses the grant")
    defaults: GrantDefaults
    e2b_access_token: str | None = Field(
        None,
        description="The sandbox's envd access token (E2B's `envdAccessToken`), when asked with an API "
        "key; null when asked with that token (`Authorization: E2B-Access <token>`)",
    )
    compat: Compat | None = Field(None, description="The sandbox's `compat` (E2B's auto-resume)")


class CreateSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        max_length=128,
        description="A name unique in your tenant (1-128 letters, digits and `._:/-`); creates may name "
        "the snapshot by it",
    )
    memory: pydantic.StrictBool = Field(
        True,
        description="Keep the sandbox's memory and running processes (true, the default: sandboxes made "
        "from it restore them, at its memory_mb) or its files only (false: they boot cold, at any memory_mb)",
    )
    end_streams: pydantic.StrictBool = Field(
        False,
        description="As pause's: end the sandbox's process-output follows and watches first (they "
        'end with `ended: "paused"`; the processes run on) instead of answering 409 sandbox_busy',
    )
    replace: pydantic.StrictBool = Field(
        False,
        description="When your tenant has a snapshot of this `name` already: delete it once this one is "
        "kept, and give the name to this one (else 409 snapshot_exists)",
    )


class Snapshot(BaseModel):
    id: str = Field(description="`snp-` and 16 hex digits")
    name: str | None
    names: list[str] = Field(description="[name] when it has one (E2B's shape)")
    tenant_id: str
    sandbox_id: str = Field(description="The sandbox it was taken of")
    template: str
    memory: bool = Field(description="Whether it holds memory and processes (else files only)")
    memory_mb: int = Field(description="The memory_mb a sandbox made from it has (0: files only, any)")
    bytes: int = Field(description="Its size on its worker's disk (memory image + files)")
    worker: str | None = Field(
        description="The worker that keeps it (creates from it go there, or anywhere once it is stored)"
    )
    stored: bool = Field(
        description="A whole copy is in the object store the workers share (uploaded in the background "
        "after it is taken): a create from it goes to any ready worker, also when its own is gone"
    )
    created_at: str | None


class SnapshotList(BaseModel):
    items: list[Snapshot]
    next_cursor: str | None


def iso(t):
    """A stored time as ISO 8601 (SQLite hands datetimes back naive; they are UTC)."""
    if t is None:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).isoformat()


def _mount_view(m: dict) -> dict:
    return {"name": m["name"], "path": m["path"], "read_only": bool(m.get("read_only"))}


def sandbox_view(
    rec: dbm.SandboxRecord,
    worker: str | None,
    usage: worker_api.Usage | None = None,
    worker_state: str | None = None,
) -> dict:
    return {
        "id": rec.id,
        "tenant_id": rec.tenant_id,
        "state": rec.state,
        "standby_tier": rec.standby_tier,
        "standby_reason": rec.standby_reason,
        "failure_reason": rec.failure_reason,
        "resume_error": rec.resume_error,
        "template": rec.template,
        "build_id": rec.build_id,
        "workdir": rec.workdir,
        "metadata": rec.metadata_,
        "env": rec.env,
        "user": rec.user,
        "shell": rec.shell,
        "network": rec.network or {"allow_out": [], "deny_out": []},
        "secrets": {var: b["secret"] for var, b in (rec.secrets or {}).items()},
        "public_ports": sorted((rec.previews or {}).get("public", [])),
        "volumes": [_mount_view(m) for m in (rec.mounts or []) if m["kind"] == "volume"],
        "drives": [_mount_view(m) for m in (rec.mounts or []) if m["kind"] == "drive"],
        "egress": {
            "allowed": usage.egress_allowed if usage else 0,
            "refused": usage.egress_refused if usage else 0,
            "dns_refused": usage.dns_refused if usage else 0,
        },
        "memory_mb": rec.memory_mb,
        "cpus": rec.cpus,
        "disk_mb": rec.disk_mb,
        "idle_timeout_s": rec.idle_timeout_s,
        "disk_after_s": rec.disk_after_s,
        "standby": {
            "memory_s": rec.idle_timeout_s,
            "disk_s": rec.disk_after_s,
            "archive_after_s": rec.archive_after_s or 0.0,
        },
        "worker": worker,
        "worker_id": rec.worker_id,
        "worker_state": worker_state,
        "created_at": iso(rec.created_at),
        "updated_at": iso(rec.updated_at),
        "standby_since": iso(rec.standby_since),
        "expires_at": iso(rec.expires_at),
        "on_timeout": rec.on_timeout or "pause",
        "on_worker_lost": rec.on_worker_lost or "fail",
        "compat": rec.compat,
    }


# ---- answers (for /openapi.json) ----------------------------------------------------------------


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code (see docs/api.md)")
    message: str = Field(description="What failed, the value involved and how to fix it")
    request_id: str
    retryable: bool = Field(description="Whether repeating the same request can succeed")


class ErrorBody(BaseModel):
    error: ErrorDetail


class EgressCounts(BaseModel):
    allowed: int = Field(description="Connections let through")
    refused: int = Field(description="Connections refused (each is also logged, rate-limited)")
    dns_refused: int = Field(description="DNS questions answered REFUSED")


class Sandbox(BaseModel):
    id: str
    tenant_id: str
    state: Literal["creating", "running", "standby", "failed", "deleted"]
    standby_tier: Literal["memory", "disk", "archive"] | None
    standby_reason: str | None
    failure_reason: str | None
    resume_error: str | None = Field(
        None,
        description="Why the last resume from the disk tier failed: the sandbox stays in standby with its "
        "files and image, and the next call tries again (after 3 failed tries it is failed); null once a "
        "resume succeeds",
    )
    template: str
    build_id: str | None = Field(
        None, description="The user template build it was made from (null: built in)"
    )
    workdir: str | None = Field(
        None, description="Its template's workdir: default cwd of exec, base of relative file paths"
    )
    metadata: dict[str, str]
    env: dict[str, str]
    user: str | None
    shell: Shell | None = Field(None, description="Shell of string commands (null: bash when present)")
    network: NetworkPolicy
    secrets: dict[str, str] = Field(description="{ENV: secret_name}; the values are never shown")
    public_ports: list[int] = Field(description="Ports its preview URLs serve without a token")
    egress: EgressCounts = Field(
        description="Its egress gateway's counts since the sandbox's network was attached, as of the "
        "worker's last usage report (every few seconds while it runs)"
    )
    memory_mb: int
    cpus: float
    disk_mb: int
    idle_timeout_s: float
    disk_after_s: float
    standby: StandbySettings = Field(description="Its standby policy (memory_s, disk_s as the two above)")
    worker: str | None = Field(description="Name of the worker that holds the sandbox")
    worker_id: str
    worker_state: Literal["joining", "ready", "draining", "lost"] | None = Field(
        None,
        description='The state of the worker that holds it: "lost" means calls to it answer 503 '
        "worker_unavailable until the worker returns, or until ATOLL_WORKER_GONE_S settles it "
        "(moved, restored or failed); null: a worker this server no longer knows",
    )
    created_at: str | None
    updated_at: str | None
    standby_since: str | None
    expires_at: str | None = Field(None, description="End of its lifetime (ISO 8601, UTC); null: none")
    on_timeout: Literal["pause", "delete"] = Field("pause", description=_ON_TIMEOUT_DOC)
    on_worker_lost: Literal["fail", "restore"] = Field("fail", description=_ON_WORKER_LOST_DOC)
    compat: Compat | None = Field(
        None, description="What a compatibility API it was created through keeps (null: atoll's own API)"
    )


class SandboxMetrics(BaseModel):
    """GET /v1/sandboxes/{id}/metrics. A sandbox in standby is not woken: cpu_percent 0, memory
    what its frozen cgroup holds (0 on disk), processes null."""

    sandbox_id: str
    state: Literal["creating", "running", "standby", "failed"]
    standby_tier: Literal["memory", "disk", "archive"] | None
    cpu_percent: float = Field(description="Share of one CPU used over about the last 2 s, in percent")
    memory_used_mb: float = Field(description="Host memory its cgroup charges (programs and gVisor's own)")
    memory_limit_mb: int = Field(description="Memory its programs may use (memory_mb)")
    disk_used_mb: float = Field(description="Space used in its writable layer")
    disk_limit_mb: int = Field(description="Size of its writable layer (disk_mb)")
    processes: int | None = Field(description="Processes inside (null: not counted, it is in standby)")


class SandboxList(BaseModel):
    items: list[Sandbox]
    next_cursor: str | None = NEXT_CURSOR


class ExecResult(BaseModel):
    exit_code: int | None
    stdout: str
    stderr: str
    duration_ms: int
    timed_out: bool
    stdout_truncated_bytes: int = 0
    stderr_truncated_bytes: int = 0


class ProcessStarted(BaseModel):
    pid: int
    log_path: str | None = None


class ProcessInfo(BaseModel):
    pid: int
    cmd: str | list[str] | None
    running: bool
    exit_code: int | None
    background: bool
    started_at: float
    log_path: str | None = None
    stdin_open: bool = Field(False, description="Its stdin pipe takes input (POST …/processes/{pid}/stdin)")
    timed_out: bool = False
    output_bytes: int = Field(0, description="Offset after the newest byte of its output")
    signal: int | None = Field(
        None,
        description="The signal that ended it, whoever sent it (its exit_code is then 128 + signal); "
        "null when it exited by itself or runs",
    )


class ProcessList(BaseModel):
    items: list[ProcessInfo]
    next_cursor: str | None = NEXT_CURSOR


class SignalRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    signal: str | int = Field(
        ..., description="A signal name or number: TERM, SIGTERM or 15 (Linux names)", examples=["TERM"]
    )


class WaitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float | None = Field(
        None, ge=0, le=86400, description="Give up after this long with 409 process_running (null: no limit)"
    )


class StdinWritten(BaseModel):
    written: int = Field(description="Bytes delivered to the process's stdin")
    eof: bool = Field(description="Whether its stdin was closed after them")


class FileEntry(BaseModel):
    name: str
    path: str
    name_b64: str
    path_b64: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class FileList(BaseModel):
    items: list[FileEntry]


class StoreEntry(BaseModel):
    """One path of a volume's or drive's tree (lstat: a symlink as itself, with its `target`)."""

    name: str
    path: str
    name_b64: str
    path_b64: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int = Field(description="permission bits (0o7777 at most)")
    uid: int
    gid: int
    atime: float = Field(description="last access, unix seconds")
    mtime: float = Field(description="last change of the content, unix seconds")
    ctime: float = Field(description="last change of the entry (content, mode, owner), unix seconds")
    target: str | None = Field(None, description="a symlink's target (as stored), else null")


class DriveToken(BaseModel):
    name: str
    token: str = Field(description="opens this drive's file routes only; keep it secret")
    scheme: Literal["E2B-Volume"] = Field(description="send it as `Authorization: E2B-Volume <token>`")


class StoreEntryList(BaseModel):
    items: list[StoreEntry] = Field(
        description="a directory's entries sorted by name, each directory's own right after it (depth > 1)"
    )


class StoreFileAttrs(BaseModel):
    """What `PATCH …/files` sets; a field left out is left as it is."""

    model_config = ConfigDict(extra="forbid")
    mode: int | None = Field(None, ge=0, le=0o7777, description="permission bits, e.g. 493 (0o755)")
    uid: int | None = Field(None, ge=0, le=0xFFFFFFFE, description="owner's user id")
    gid: int | None = Field(None, ge=0, le=0xFFFFFFFE, description="owner's group id")


class StoreMakeDir(StoreFileAttrs):
    """`POST …/files/mkdir`: the new directory's mode and owner, and whether parents are made."""

    parents: bool = Field(
        False, description="make missing parent directories too (else 404 when one is missing)"
    )


# ---- files, issue 9 (routes_fileops) ------------------------------------------------------------
class FileStat(BaseModel):
    """One path's lstat: a symlink is reported as itself, with its `target`."""

    name: str
    path: str
    name_b64: str
    path_b64: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    target: str | None = Field(description="a symlink's target (as stored), else null")


class MkdirResult(BaseModel):
    path: str
    created: bool = Field(description="false when the directory existed already")


class FileMoveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    from_: str = Field(alias="from", min_length=1, max_length=4096, description="the path to move")
    to: str = Field(min_length=1, max_length=4096, description="its new path (parents are created)")


class FileChmodRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, max_length=4096)
    mode: int | str = Field(
        description='the permission bits: an integer (493 = 0o755) or octal text such as "755" or "0o644"'
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ValueError(f"mode must be an integer or octal text such as '755', not {type(v).__name__}")
        if isinstance(v, str):
            t = v.strip().lower().removeprefix("0o")
            if not t or any(ch not in "01234567" for ch in t):
                raise ValueError(f"mode {v!r} is not octal text such as '755' or '0644'")
            v = int(t, 8)
        if not 0 <= v <= 0o7777:
            raise ValueError(f"mode {v} is outside 0..0o7777 (4095); give permission bits such as '755'")
        return v


class TarWritten(BaseModel):
    path: str
    files: int = Field(description="regular files written")
    dirs: int
    links: int = Field(description="symlinks and hard links made")
    bytes: int = Field(description="bytes of file content written")


class FileEvent(BaseModel):
    """One line of GET …/files/watch."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["ready", "create", "modify", "delete", "rename", "chmod", "overflow"]
    path: str
    is_dir: bool
    from_: str | None = Field(None, alias="from", description="a rename's old path")


class TemplateInfo(BaseModel):
    name: str
    status: Literal["missing", "building", "ready", "failed"]
    hash: str
    progress: str
    error: str | None
    description: str
    packages: list[str]
    built_at: float | None
    size_bytes: int | None


class TemplateList(BaseModel):
    items: list[TemplateInfo]
    next_cursor: str | None = NEXT_CURSOR


class Health(BaseModel):
    status: Literal["ok", "starting", "degraded"]
    version: str
    templates: dict[str, str]
    workers: dict[str, str] = Field(default_factory=dict, description="worker name -> state")
    error: str | None = None


class Resources(BaseModel):
    memory_mb: float
    cpus: float
    disk_mb: float


class WorkerCapacity(Resources):
    slots: int = Field(
        0,
        description="The most sandboxes holding its resources (creating, running, memory tier, warm-pool "
        "members) it takes: `atoll worker --slots N` / ATOLL_WORKER_SLOTS; 0: no limit",
    )


class WorkerAllocated(Resources):
    slots: int = Field(
        0,
        description="Slots taken: its sandboxes creating, running or in the memory tier, and resumes "
        "from the disk or archive tier in flight (disk and archive standby take none)",
    )


class LeftSandbox(BaseModel):
    id: str
    reason: str = Field(description="Why it stays on the draining worker")


class Evacuation(BaseModel):
    state: Literal["running", "done", "stopped"] = Field(
        description="`stopped`: the worker was undrained before every sandbox had its turn"
    )
    moved: int = Field(description="Sandboxes moved to other workers")
    pending: int = Field(
        description="Sandboxes whose turn has not come yet (after `stopped`: those that had none)"
    )
    left: list[LeftSandbox] = Field(description="Sandboxes that stay, each with the reason")
    pool_members_dropped: int = Field(description="Unclaimed warm-pool members deleted (refilled elsewhere)")
    started_at: str
    resumed_at: str | None = Field(
        description="When a server that started (or the worker's return) last resumed it (null: never)"
    )
    finished_at: str | None


class Worker(BaseModel):
    id: str
    name: str
    state: Literal["joining", "ready", "lost", "draining"]
    state_reason: str | None
    capacity: WorkerCapacity
    allocated: WorkerAllocated
    sandboxes: int = Field(description="Live sandboxes on this worker")
    evacuated: bool = Field(
        False, description="Draining and holding no sandbox any more (a drain's evacuation is complete)"
    )
    evacuation: Evacuation | None = Field(
        None,
        description="The last drain's evacuation of this worker, kept in its record (null: never drained)",
    )
    version: str | None
    protocol: int | None
    url: str | None = Field(description="Where the server calls it (null for the in-process worker)")
    tunnel_port: int | None = Field(
        None, description="Its port tunnel (the ingress router's way to its sandboxes; on the url's host)"
    )
    installation: str | None
    registered_at: str | None
    last_heartbeat_at: str | None


class WorkerList(BaseModel):
    items: list[Worker]
    next_cursor: str | None = NEXT_CURSOR


class Lease(BaseModel):
    name: str = Field(
        description='The lease: "leader" (the background loops: tier policy and lifetimes, pool keepers, lost workers, metering)'
    )
    holder: str = Field(description="The id of the server holding it (each server logs its own at start)")
    acquired_at: str = Field(description="When this holder took it")
    renewed_at: str = Field(description="Its holder's last renewal (every third of ATOLL_LEASE_TTL_S)")
    expires_at: str = Field(description="When another server may take it unless its holder renews it")
    expired: bool = Field(
        description="Nobody holds it now (its holder stopped or died; another server takes it at its next try)"
    )
    this_server: bool = Field(description="Held by the server that answered")


class LeaseList(BaseModel):
    server_id: str = Field(description="The id of the server that answered")
    items: list[Lease] = Field(description="Every lease (a handful: not paged)")


class WorkerPass(BaseModel):
    runtimes: int = Field(description="Live runtimes on the worker")
    removed: list[str] = Field(description="Host objects no sandbox owned, removed")
    failed: list[str] = Field(description="Sandboxes whose runtime had vanished, now failed")
    wall_ms: float
    cpu_ms: float = Field(description="CPU time of the worker's pass")


class ReconcileAnswer(BaseModel):
    worker: WorkerPass


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    draining: pydantic.StrictBool = Field(
        True, description="false: undrain (and stop an evacuation between sandboxes)"
    )
    evacuate: pydantic.StrictBool = Field(
        True,
        description="Move every sandbox to other workers (false: only cordon: no new sandboxes go there)",
    )


_WORKER_INFO = pydantic.TypeAdapter(worker_api.WorkerInfo)


class RegisterRequest(BaseModel):
    """What `atoll worker` sends when it registers (the `info` is core.worker_api.WorkerInfo)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=512, description="Where the server can call the worker")
    info: dict = Field(
        description="The worker's core.worker_api.WorkerInfo: name, version, protocol, installation, "
        "capacity {memory_mb, cpus, disk_mb, slots}, templates, default_disk_mb"
    )
    proof: str | None = Field(
        default=None,
        max_length=128,
        description="Sent by a worker registering again while it holds a token: HMAC-SHA256 of that "
        "token over 'atoll-register <url>' (hex). A registration from a live worker's URL without "
        "it, or with a wrong one, is 409 worker_conflict",
    )

    @field_validator("info")
    @classmethod
    def _v_info(cls, v: dict) -> dict:
        """Checked here, so that a malformed one is the caller's 400 (not a protocol failure)."""
        try:
            _WORKER_INFO.validate_python(v)
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or "info"
            raise ValueError(
                f"not a worker's info (core.worker_api.WorkerInfo): {where}: {err['msg']}"
            ) from None
        return v


class RegisterAnswer(BaseModel):
    worker_id: str
    token: str = Field(description="What the server presents to this worker from now on")
    epoch: str
    protocol: int
    heartbeat_s: float
    lost_after_s: float


class CertificateRequest(BaseModel):
    """What `atoll worker` sends before it registers when its API is https://: a CSR over the key
    it keeps (the key never leaves the worker)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        max_length=64,
        description="The worker's name (--name): its certificate names it",
        pattern=f"^{ids.WORKER_NAME_RE.pattern}$",
    )
    url: str = Field(
        max_length=512,
        description="The https:// URL the server will call the worker at (its host goes in the certificate)",
    )
    csr: str = Field(max_length=16384, description="A PEM certificate signing request (EC P-256)")


class CertificateAnswer(BaseModel):
    certificate: str = Field(
        description="PEM: the worker's certificate from the installation CA, its SAN the URL's host and "
        "urn:atoll:worker:<name>"
    )
    ca: str = Field(description="PEM: the installation CA (what GET /v1/ca.crt answers)")


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: str | None = Field(None, max_length=64)


class HeartbeatAnswer(BaseModel):
    state: str


# ---- terminals (routes_pty) ------------------------------------------------------------------


class PtyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cols: int = Field(80, ge=ptyframes.MIN_SIZE, le=ptyframes.MAX_COLS, description="Terminal width")
    rows: int = Field(24, ge=ptyframes.MIN_SIZE, le=ptyframes.MAX_ROWS, description="Terminal height")
    term: str | None = Field(
        None, pattern=r"^[A-Za-z0-9._+-]{1,64}$", description="TERM for the program (default xterm-256color)"
    )
    cmd: str | list[str] | None = Field(
        None,
        description="Default: the user's login shell (from /etc/passwd) as a login shell, else /bin/sh; "
        "a string runs with that shell's -c; a list is the argv",
        json_schema_extra={"minLength": 1, "minItems": 1},
    )
    cwd: str | None = Field(None, description="Working directory (default: the sandbox's workdir)")
    env: dict[str, str] | None = Field(None, json_schema_extra=_ENV_SCHEMA)
    user: str | None = Field(None, json_schema_extra=_USER_SCHEMA)

    _v_env = field_validator("env")(classmethod(lambda cls, v: _check_env(v)))

    @field_validator("cmd")
    @classmethod
    def _v_cmd(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, str) and (not v.strip() or "\x00" in v):
            raise ValueError(
                "cmd must be a non-empty shell command without NUL bytes, or omitted for a shell"
            )
        if isinstance(v, list) and (not v or not v[0] or any("\x00" in a for a in v)):
            raise ValueError("cmd as a list is a non-empty argv without NUL bytes")
        return v


class PtyCreated(BaseModel):
    pty_id: str
    pid: int


class PtyInfo(BaseModel):
    pty_id: str
    pid: int
    cmd: str | list[str] | None
    cols: int
    rows: int
    term: str
    running: bool
    exit_code: int | None
    created_at: float
    attached: int


class PtyList(BaseModel):
    items: list[PtyInfo]
    next_cursor: str | None = NEXT_CURSOR


# ---- tenants and keys (controlplane.routes_tenants) ------------------------------------------------


class Quotas(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_running: int | None = Field(None, description="Running sandboxes at once")
    max_memory_mb: int | None = Field(None, description="Memory (MB) of running sandboxes, summed")
    max_standby_gb: float | None = Field(None, description="Standby storage (disk + archive tier), GB")
    max_volume_gb: float | None = Field(None, description="Volume and drive storage, GB")
    creates_per_minute: int | None = Field(None, description="Sandbox creates per minute (429 beyond)")
    max_pool_slots: int | None = Field(None, description="Warm pool slots over all its templates")
    build_minutes_per_day: float | None = Field(None, description="Template build minutes per day")
    max_snapshots: int | None = Field(None, description="Named snapshots kept at once")
    max_snapshot_gb: float | None = Field(
        None, description="Named snapshots' storage, GB (a take is refused once they reach it)"
    )

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_only(cls, v: object) -> object:
        # `true` or "5" is no quota (PATCH's check refuses them; pydantic's lax mode made them 1, 5)
        if isinstance(v, bool | str):
            raise ValueError("a quota is a number")
        return v


class CreateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="1-63 lower-case letters, digits, '.', '_' or '-'")
    quotas: Quotas | None = Field(None, description="Limits; a quota left out is unlimited")


class UpdateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    quotas: dict | None = Field(None, description="Quotas to change; null for one removes it (unlimited)")


class Tenant(BaseModel):
    id: str
    name: str
    quotas: dict
    created_at: str | None
    updated_at: str | None
    use: dict | None = Field(
        None,
        description="GET /v1/tenants/{id} only: what the tenant uses now, by quota (running, memory_mb, "
        "standby_gb, volume_gb, creates_last_minute, snapshots, snapshot_gb)",
    )


class TenantList(BaseModel):
    items: list[Tenant]
    next_cursor: str | None = NEXT_CURSOR


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: str = Field("admin", description='"admin" or "worker" (tenant keys: POST /v1/tenants/{id}/keys)')
    expires_at: str | None = Field(None, description="ISO 8601; the key stops working then")


class CreateTenantKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expires_at: str | None = Field(None, description="ISO 8601; the key stops working then")


class ApiKey(BaseModel):
    id: str
    scope: str
    tenant_id: str | None
    created_at: str | None
    expires_at: str | None
    revoked_at: str | None
    key: str | None = Field(None, description="The key itself: only in the answer that created it")


class ApiKeyList(BaseModel):
    items: list[ApiKey]
    next_cursor: str | None = NEXT_CURSOR
