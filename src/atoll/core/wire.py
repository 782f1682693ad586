"""The JSON form of the seam's types (core.worker_api) on the control plane ↔ worker protocol.

Both sides send `Atoll-Protocol: <PROTOCOL_VERSION>` on every request and answer; a peer that
sends another version is refused (`check_protocol`), naming both versions. Values are checked as
they are decoded (pydantic TypeAdapters over the dataclasses): a malformed message from a peer is a
`RuntimeFailure`, never an unchecked dict. Errors travel as the public envelope
`{"error": {"code", "message", "retryable"}}` and are rebuilt with `errors.from_code`. The port
tunnel's token is derived here too (`tunnel_token`), and a registering worker's proof that it
holds its current token (`registration_proof`).
Pure; called by worker.httpapi, worker.registration, controlplane.remote_worker and
controlplane.routes_workers.
"""

from __future__ import annotations

import hashlib
import hmac
import typing
from typing import Annotated, Any

import pydantic

from atoll.core import errors, worker_api

PROTOCOL_HEADER = "Atoll-Protocol"


def tunnel_token(token: str) -> str:
    """What the port tunnel's hello carries instead of the registration's token: derived from it
    (HMAC-SHA256), so that the tunnel — plain TCP even when the API link is TLS — never shows the
    token that opens the worker's API."""
    return hmac.new(token.encode(), b"atoll-tunnel", hashlib.sha256).hexdigest()


def registration_proof(token: str, url: str) -> str:
    """What a worker that registers again sends to show it holds the token of its current
    registration (HMAC-SHA256 of the token over its URL, without a trailing /), without sending the token: the server
    checks it against the token it calls that worker with (controlplane.impostors)."""
    return hmac.new(token.encode(), f"atoll-register {url.rstrip('/')}".encode(), hashlib.sha256).hexdigest()


_Event = Annotated[worker_api.WorkerEvent, pydantic.Field(discriminator="kind")]
_ExecEvent = Annotated[worker_api.ExecEvent, pydantic.Field(discriminator="kind")]
_ProcessEvent = Annotated[worker_api.ProcessEvent, pydantic.Field(discriminator="kind")]


_ADAPTERS: dict[Any, pydantic.TypeAdapter] = {}


def _adapter(tp: Any) -> pydantic.TypeAdapter:
    """One TypeAdapter per type, built on first use (building one costs ~1 ms)."""
    adapter = _ADAPTERS.get(tp)
    if adapter is None:
        adapter = _ADAPTERS[tp] = pydantic.TypeAdapter(tp)
    return adapter


def dump(obj: Any, tp: Any = None) -> Any:
    """`obj` as plain JSON values."""
    return _adapter(tp if tp is not None else type(obj)).dump_python(obj, mode="json")


T = typing.TypeVar("T")


def load(tp: type[T], data: Any, what: str = "message") -> T:
    """Decode and check `data` as `tp`; a peer's malformed message is a RuntimeFailure."""
    try:
        return _adapter(tp).validate_python(data)
    except pydantic.ValidationError as e:
        raise errors.RuntimeFailure(
            f"a malformed {what} arrived from the other side of the worker protocol",
            detail=str(e)[:2000],
        ) from None


def dump_event(ev: worker_api.WorkerEvent) -> Any:
    return dump(ev, _Event)


def load_event(data: Any) -> worker_api.WorkerEvent:
    return typing.cast(worker_api.WorkerEvent, load(typing.cast(type, _Event), data, "worker event"))


def dump_exec_event(ev: worker_api.ExecEvent) -> Any:
    return dump(ev, _ExecEvent)


def load_exec_event(data: Any) -> worker_api.ExecEvent:
    return typing.cast(worker_api.ExecEvent, load(typing.cast(type, _ExecEvent), data, "exec event"))


def dump_process_event(ev: worker_api.ProcessEvent) -> Any:
    return dump(ev, _ProcessEvent)


def load_process_event(data: Any) -> worker_api.ProcessEvent:
    return typing.cast(
        worker_api.ProcessEvent, load(typing.cast(type, _ProcessEvent), data, "process output event")
    )


def error_body(e: errors.AtollError) -> dict:
    return {"error": {"code": e.code, "message": e.message, "retryable": e.retryable}}


def error_from_body(status: int, body: Any, fallback: str) -> errors.AtollError:
    """The domain error of an error answer; `fallback` describes a body that is not our envelope."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str) and isinstance(err.get("message"), str):
        return errors.from_code(err["code"], err["message"], status=status)
    return errors.RuntimeFailure(fallback)


def check_protocol(value: str | None, peer: str) -> None:
    """Refuse a peer whose `Atoll-Protocol` header is missing or another version."""
    ours = worker_api.PROTOCOL_VERSION
    if value is None or value.strip() != str(ours):
        raise errors.IncompatibleProtocol(
            f"{peer} speaks worker protocol {value or 'none (no Atoll-Protocol header)'}, "
            f"this side speaks {ours}; run the same atoll version on the server and its workers"
        )
