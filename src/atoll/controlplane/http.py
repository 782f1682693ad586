"""What every router of the public API shares: the error envelope, size-limited JSON bodies, file
paths, calls that end when the API client hangs up, and the pieces of /openapi.json the routers
declare by hand.

Bodies are parsed by hand (size-limited before they are read whole; malformed JSON, a non-object or a
failed validation is `400 invalid_request` naming the field and the value) and validated with the
pydantic models of controlplane.schemas. Since FastAPI does not see those bodies (nor the models a
route names only in a `$ref`), `body_schema` and `ref` record their models, and `component_schemas`
gives app the schemas to add to the document's `components/schemas`.
Called by the routers (controlplane.routes_*) and app.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import typing

import pydantic
import pydantic.json_schema
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from atoll.controlplane import schemas
from atoll.core import errors, filepaths, inputs
from atoll.shared import relay

_log = logging.getLogger(__name__)

MAX_JSON_BYTES = inputs.MAX_JSON_BYTES
NDJSON = "application/x-ndjson"


def dumps(obj: typing.Any) -> bytes:
    """Compact JSON, UTF-8 as is (output with non-ASCII text is not inflated by escapes)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def json_response(obj: typing.Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def error_response(
    status: int, code: str, message: str, request_id: str, retryable: bool = False
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "request_id": request_id, "retryable": retryable}},
        status_code=status,
        headers={"X-Request-Id": request_id},
    )


REF_TEMPLATE = "#/components/schemas/{model}"
# Models the document names only by `$ref` (hand-read bodies, hand-built answers), with the JSON
# Schema mode they are seen in: "validation" for what the server reads, "serialization" for answers.
_COMPONENTS: dict[type[pydantic.BaseModel], pydantic.json_schema.JsonSchemaMode] = {}


def ref(model: type[pydantic.BaseModel], mode: pydantic.json_schema.JsonSchemaMode = "serialization") -> dict:
    """`{"$ref": …}` to `model` in components/schemas (which app fills from component_schemas)."""
    _COMPONENTS.setdefault(model, mode)
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def component_schemas() -> dict[str, dict]:
    """The JSON Schemas of every model recorded by `ref`, with the models they use, by name."""
    if not _COMPONENTS:
        return {}
    _, top = pydantic.json_schema.models_json_schema(list(_COMPONENTS.items()), ref_template=REF_TEMPLATE)
    return top.get("$defs", {})


def body_schema(model: type[pydantic.BaseModel], *, required: bool = True) -> dict:
    """openapi_extra for a route whose JSON body is read by hand (see read_json)."""
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": ref(model, "validation")}},
        }
    }


def error_responses(descriptions: dict[int, str]) -> dict:
    """`responses=` entries of error answers, all the envelope (schemas.ErrorBody), by status."""
    return {
        status: {"model": schemas.ErrorBody, "description": text} for status, text in descriptions.items()
    }


M = typing.TypeVar("M", bound=pydantic.BaseModel)


async def read_json(request: Request, model: type[M], *, optional: bool = False) -> M:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit():
        inputs.check_json_size(int(declared), declared=True)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        inputs.check_json_size(len(buf))
    data = inputs.json_object(buf, f"a JSON object ({model.__name__})")
    if data is None:
        if optional:
            return model()
        raise errors.InvalidRequest(f"request body is empty; send a JSON object ({model.__name__})")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise errors.InvalidRequest("invalid request body: " + validation_message(e)) from None


def validation_message(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']} (got {excerpt(err.get('input'))})")
    return "; ".join(parts)


def excerpt(value: typing.Any) -> str:
    """The start of a rejected value for an error message (a deeply nested one by its type only)."""
    try:
        return json.dumps(value, default=str)[:100]
    except (RecursionError, ValueError):
        return f"a deeply nested {type(value).__name__}"


async def unless_disconnected(request: Request, aw: typing.Awaitable) -> typing.Any:
    """Await `aw` unless the API client hangs up first: then cancel it (the worker resets its
    connection to the guest agent, which kills the command) instead of running on unobserved."""
    return await relay.unless_disconnected(
        request.receive, aw, errors.InvalidRequest("the client disconnected; the command was stopped")
    )


# A files call's target (moved to core.filepaths, which the edge shares); the names stay here.
MAX_PATH = filepaths.MAX_PATH
check_path = filepaths.check_path


# ---- request bodies and streamed answers shared by the routes ---------------------------------
def limited_body(request: Request, limit: int, what: str) -> tuple[typing.AsyncIterator[bytes], int | None]:
    """A streamed request body bounded by `limit` bytes (`what` names it in the 413), and its
    declared size: refused before the first byte when Content-Length says it is too large."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise errors.PayloadTooLarge(f"{what} is {declared} bytes; the limit is {limit} (ATOLL_MAX_FILE_MB)")

    async def chunks() -> typing.AsyncIterator[bytes]:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise errors.PayloadTooLarge(f"{what} exceeds {limit} bytes (ATOLL_MAX_FILE_MB)")
            if chunk:
                yield chunk

    return chunks(), int(declared) if declared and declared.isdigit() else None


async def open_held(
    manager: typing.Any, sid: str, open_stream: typing.Callable[[typing.Any], typing.AsyncContextManager]
) -> tuple[typing.Any, typing.Callable[[BaseException | None], typing.Awaitable[None]]]:
    """Open a worker stream (`open_stream(worker)`) under `manager.activity(sid)`, which it holds
    (the sandbox counts as active) until the returned `close(failure)` is awaited. An error while
    opening releases the activity and is raised, as an ordinary error answer."""
    activity = manager.activity(sid)
    worker = await activity.__aenter__()
    cm = open_stream(worker)
    try:
        value = await cm.__aenter__()
    except BaseException as e:
        await activity.__aexit__(type(e), e, e.__traceback__)
        raise

    async def close(failure: BaseException | None) -> None:
        await cm.__aexit__(None, None, None)
        # a SandboxDied passed on marks the sandbox failed (see SandboxManager.activity)
        await activity.__aexit__(type(failure) if failure else None, failure, None)

    return value, close


def broken_line(e: BaseException, sid: str, what: str) -> bytes:
    """The in-band NDJSON line that ends a stream whose headers are sent, `{"error": {…}}`."""
    code, message = (
        (e.code, e.message)
        if isinstance(e, errors.AtollError)
        else ("runtime_error", f"the {what} stream from the sandbox broke")
    )
    _log.warning("%s stream broke: %s", what, message, extra={"sandbox_id": sid, "detail": repr(e)})
    return dumps({"error": {"code": code, "message": message}}) + b"\n"


async def relayed(
    sid: str,
    chunks: typing.AsyncIterator[bytes],
    close: typing.Callable[[BaseException | None], typing.Awaitable[None]],
    what: str,
) -> typing.AsyncIterator[bytes]:
    """A download's body from a held worker stream (open_held): relayed chunk by chunk; a break
    after the headers cuts the answer short (the client sees it end early) and is logged.

    The stream is released (the sandbox no longer busy) before the last chunk is handed on: a
    client that has the whole answer (Content-Length) may send its next call on another connection
    at once, and a pause must not find this download still in progress."""
    failure: BaseException | None = None
    released = False
    end = object()
    try:
        it = aiter(chunks)
        chunk: typing.Any = await anext(it, end)
        while chunk is not end:
            following = await anext(it, end)
            if following is end:
                released = True
                await close(None)
            yield chunk
            chunk = following
    except Exception as e:  # the headers are sent: the download is cut short
        failure = e
        _log.warning(
            "%s download broke: %s",
            what,
            getattr(e, "message", e),
            extra={"sandbox_id": sid, "detail": repr(e)},
        )
        raise
    finally:
        if not released:
            await close(failure)


def query_time(name: str, value: str | None) -> dt.datetime | None:
    """A time given in a query parameter (`name`), in UTC: ISO 8601 / RFC 3339, `Z` or an offset
    (a `+` sent unencoded arrives as a space and is read as one), none meaning UTC; None when the
    parameter is absent or empty. `400 invalid_request` naming the value otherwise, also for a
    time that is out of range once moved to UTC (year 1 with +14:00, year 9999 with -12:00).
    Used by GET /v1/sandboxes (created_after/before) and GET /v1/audit (from/to)."""
    if value is None or value == "":
        return None
    bad = f"{name}={value[:60]!r} is not a time; use ISO 8601 / RFC 3339, e.g. 2026-12-06T18:00:00Z"
    try:
        t = dt.datetime.fromisoformat(re.sub(r" (\d\d:?\d\d)$", r"+\1", value.replace("Z", "+00:00")))
        return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)
    except (ValueError, OverflowError):
        raise errors.InvalidRequest(bad) from None
