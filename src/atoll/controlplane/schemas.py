"""Wire models of the public REST API (pydantic v2): request bodies with their limits, the sandbox view.

Called by controlplane.api; the same models feed /openapi.json.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from atoll.controlplane import db as dbm

DEFAULT_MEMORY_MB = 512  # also the size of the template image made at start-up

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


def _check_env(v: dict[str, str] | None) -> dict[str, str] | None:
    if v is None:
        return v
    for k, val in v.items():
        if not _ENV_KEY.match(k):
            raise ValueError(
                f"environment variable name {k!r} is invalid; use letters, digits and '_' (not first a digit)"
            )
        if "\x00" in val:
            raise ValueError(f"environment variable {k!r} contains a NUL byte")
    return v


class CreateSandbox(BaseModel):
    model_config = ConfigDict(extra="forbid")

    template: str = Field("base", max_length=64, description="Template name (GET /v1/templates)")
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment of every process in the sandbox"
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
    user: str | None = Field(None, description="Default user of exec calls (default root)")

    _v_env = field_validator("env")(classmethod(lambda cls, v: _check_env(v)))

    @field_validator("user")
    @classmethod
    def _v_user(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
            raise ValueError(
                f"user {v!r} is not a valid user name (lower-case letters, digits, '_' or '-'); uids are not accepted"
            )
        return v


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str] = Field(..., description="Shell string (run with /bin/sh -c) or argv list")
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout_s: float | None = Field(None, gt=0, le=86400)
    background: bool = False
    user: str | None = None
    max_output_bytes: int | None = Field(
        None,
        ge=1,
        description=(
            "Bytes of each stream kept in a non-streamed answer (its first and last halves, with a marker "
            "naming the bytes dropped between); default and upper bound: the server's "
            "ATOLL_MAX_EXEC_OUTPUT_KB. Streamed output (Accept: application/x-ndjson) is never cut."
        ),
    )

    _v_env = field_validator("env")(classmethod(lambda cls, v: _check_env(v)))

    @field_validator("user")
    @classmethod
    def _v_user(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
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

    tier: Literal["memory", "disk"] = "memory"


def sandbox_view(rec: dbm.SandboxRecord) -> dict:
    def iso(t):  # SQLite hands datetimes back naive; they are UTC
        if t is None:
            return None
        return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).isoformat()

    return {
        "id": rec.id,
        "tenant_id": rec.tenant_id,
        "state": rec.state,
        "standby_tier": rec.standby_tier,
        "standby_reason": rec.standby_reason,
        "failure_reason": rec.failure_reason,
        "template": rec.template,
        "metadata": rec.metadata_,
        "env": rec.env,
        "user": rec.user,
        "memory_mb": rec.memory_mb,
        "cpus": rec.cpus,
        "disk_mb": rec.disk_mb,
        "idle_timeout_s": rec.idle_timeout_s,
        "disk_after_s": rec.disk_after_s,
        "worker_id": rec.worker_id,
        "created_at": iso(rec.created_at),
        "updated_at": iso(rec.updated_at),
        "standby_since": iso(rec.standby_since),
    }
