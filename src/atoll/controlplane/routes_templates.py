"""Public routes of templates: build (a JSON spec, a Dockerfile, or a tar build context), list, get,
build logs (streamed while the build runs), delete, and warm pools.

Part of the app built by controlplane.app; templates go through controlplane.templates, pools
through controlplane.pools.
"""

from __future__ import annotations

import asyncio
import io
import json
import posixpath
import tarfile

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from atoll.controlplane import http, paging, templates
from atoll.controlplane.context import ctx
from atoll.core import dockerfile, errors, templatespec, wire

router = APIRouter(tags=["templates"])

MAX_CONTEXT_BYTES = 64 * 2**20
MAX_CONTEXT_FILES_BYTES = 64 * 2**20
MAX_CONTEXT_MEMBERS = 10000
MAX_DOCKERFILE_BYTES = 2**20
ERRORS = http.error_responses(
    {
        400: "invalid_request: the spec or Dockerfile is malformed (an unsupported instruction names its line)",
        404: "template_not_found",
        409: "template_exists (a build is running) or template_in_use",
        503: "no_worker: no worker can build now (retryable)",
    }
)


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise errors.PayloadTooLarge(f"request body is {declared} bytes; the limit here is {limit} bytes")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise errors.PayloadTooLarge(f"request body exceeds {limit} bytes, the limit here")
    return bytes(buf)


def _check_budget(budget: int, member: str, size: int) -> None:
    if budget < 0:
        raise errors.PayloadTooLarge(
            f"the build context unpacks to more than {MAX_CONTEXT_FILES_BYTES} bytes "
            f"({member!r} alone is {size}); leave large files out of it (.dockerignore "
            "is not read: send only what COPY/ADD need)"
        )


def _context(data: bytes) -> tuple[str, dict[str, dockerfile.ContextEntry]]:
    """The Dockerfile and the files of a tar build context: regular files; symbolic links as
    links (target kept as written, never followed here or on the worker; resolved inside the
    sandbox); a hard link as what it names, earlier in the context: a copy of a regular file, or
    that symbolic link itself (the inode they share is the link).
    Directories are implied by the paths; devices and FIFOs are refused."""
    files: dict[str, dockerfile.ContextEntry] = {}
    budget = MAX_CONTEXT_FILES_BYTES  # what it unpacks to (a small .tar.gz may hold gigabytes)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for m in tar:
                if len(files) >= MAX_CONTEXT_MEMBERS:
                    raise errors.PayloadTooLarge(
                        f"the build context has more than {MAX_CONTEXT_MEMBERS} entries; send less"
                    )
                name = posixpath.normpath(m.name.lstrip("/"))
                if name.startswith("..") or name == ".":
                    if name == ".":
                        continue
                    raise errors.InvalidRequest(f"build context: {m.name!r} points outside the context")
                if m.issym():
                    files[name] = (b"", 0o777, m.linkname)
                elif m.islnk():
                    # A hard link shares the inode of the member it names: a regular file becomes
                    # a copy of that file, a symbolic link that link (never followed). It is resolved
                    # here, against what the context held so far (tar writes the inode's first name
                    # first), not by tarfile, which follows a link to a symbolic link.
                    target = files.get(posixpath.normpath(m.linkname.lstrip("/")))
                    if target is None:
                        raise errors.InvalidRequest(
                            f"build context: hard link {m.name!r} names {m.linkname!r}, which is not "
                            "a file or symbolic link earlier in the context; send the file itself "
                            "(tar --hard-dereference) or include the member it names"
                        )
                    if len(target) == 2:
                        budget -= len(target[0])
                        _check_budget(budget, m.name, len(target[0]))
                    files[name] = target
                elif m.isfile():
                    budget -= m.size
                    _check_budget(budget, m.name, m.size)
                    f = tar.extractfile(m)
                    files[name] = (f.read() if f else b"", m.mode & 0o7777)
                elif not m.isdir():
                    raise errors.InvalidRequest(
                        f"build context: {m.name!r} is a device or a FIFO; a context holds files, "
                        "directories and links only"
                    )
    except (tarfile.TarError, EOFError, OSError) as e:
        raise errors.InvalidRequest(
            f"the build context is not a readable tar archive ({e}); send `tar -c -C DIR .` with "
            "Content-Type: application/x-tar"
        ) from None
    if "Dockerfile" not in files:
        raise errors.InvalidRequest("the build context has no Dockerfile at its root")
    if len(files["Dockerfile"]) == 3:
        raise errors.InvalidRequest(
            "the build context's Dockerfile is a symbolic link; send the file itself (tar -h follows links)"
        )
    try:
        text = files["Dockerfile"][0].decode()
    except UnicodeDecodeError:
        raise errors.InvalidRequest("the Dockerfile is not UTF-8 text") from None
    return text, files


@router.post(
    "/v1/templates",
    status_code=202,
    responses={202: {"description": "the build started: {name, build_id, status}"}, **ERRORS},
)
async def build_template(
    request: Request,
    name: str | None = Query(
        None, description="The template's name (required with a Dockerfile or a build context)"
    ),
):
    """Build a template from a JSON spec `{name, from, apt, pip, run, files, env, workdir, user,
    start, ready}`, a Dockerfile (`Content-Type: text/x-dockerfile`) or a tar build context with a
    Dockerfile at its root (`application/x-tar`). The build runs in the background: poll
    GET /v1/templates/{name} or stream its logs."""
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if kind in ("text/x-dockerfile", "application/x-tar", "application/tar"):
        if not name:
            raise errors.InvalidRequest(
                "a Dockerfile build needs the template's name: POST /v1/templates?name=NAME"
            )
        if kind == "text/x-dockerfile":
            raw = await _body(request, MAX_DOCKERFILE_BYTES)
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                raise errors.InvalidRequest("the Dockerfile is not UTF-8 text") from None
            spec = dockerfile.parse(text, name, None)
        else:
            text, files = await asyncio.to_thread(_context, await _body(request, MAX_CONTEXT_BYTES))
            spec = dockerfile.parse(text, name, files)
    else:  # a JSON spec, whatever else the Content-Type says (the API's bodies are JSON: curl -d)
        raw = await _body(request, 32 * 2**20)
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as e:
            raise errors.InvalidRequest(
                f"request body is not a JSON template spec ({e}); a Dockerfile needs Content-Type: "
                "text/x-dockerfile, a build context application/x-tar"
            ) from None
        if not isinstance(body, dict):
            raise errors.InvalidRequest("the template spec must be a JSON object")
        spec = templatespec.from_request(body, name)
    build = await ctx(request).manager.templates.build(spec)
    return http.json_response({"name": spec.name, "build_id": build.id, "status": build.status}, 202)


def _builtin(request: Request) -> list[dict]:
    return [wire.dump(t) for t in ctx(request).manager.workers.templates()]


@router.get("/v1/templates", openapi_extra=paging.OPENAPI, responses=ERRORS)
async def list_templates(request: Request):
    """Built-in templates (with their status on the workers) and yours, by name, a page at a time."""
    items = [*_builtin(request), *ctx(request).manager.templates.list()]
    page, nxt = paging.of_list(
        paging.page(request, "/v1/templates"), items, lambda t: (t["name"], t.get("tenant_id") or "")
    )
    return paging.answer(page, nxt)


@router.get("/v1/templates/{name}", responses=ERRORS)
async def get_template(request: Request, name: str):
    """A template: `status` (building | ready | failed) and `build_id` of its latest build, `error`,
    the build that serves creates (`current_build_id`), its settings and `start_mode`."""
    builtin = _builtin(request)
    for t in builtin:
        if t["name"] == name:
            return {**t, "build_id": None, "current_build_id": None}
    if name in templates.BUILTIN and builtin:  # workers answer, none offers it
        raise errors.TemplateNotFound(
            f"template {name!r} is not offered by this installation's workers (they run with "
            "ATOLL_E2B_CODE_INTERPRETER=0); templates: " + ", ".join(sorted({t["name"] for t in builtin}))
        )
    if name in templates.BUILTIN:
        raise errors.Unavailable(
            f"template {name!r} is built in, and no usable worker reports it now (each worker "
            "builds and holds its own); start a worker or wait for the registered ones to come "
            "back (GET /v1/workers), then retry",
            code="no_worker",
        )
    svc = ctx(request).manager.templates
    return svc.view(svc.record(name))


@router.get(
    "/v1/templates/{name}/builds/{build_id}/logs",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/plain": {}}, "description": "the build's log, streamed until it ends"},
        **ERRORS,
    },
)
async def build_logs(request: Request, name: str, build_id: str):
    """The build's log from its start; the answer ends when the build does."""
    svc = ctx(request).manager.templates
    build = svc.build_record(name, build_id)
    worker = svc.worker_of(build)
    cm = worker.build_log(build.id)
    chunks = await cm.__aenter__()

    async def body():
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await cm.__aexit__(None, None, None)

    return StreamingResponse(body(), media_type="text/plain; charset=utf-8")


@router.delete("/v1/templates/{name}", status_code=204, responses=ERRORS)
async def delete_template(request: Request, name: str):
    """Delete a template, its builds and its pool; 409 template_in_use while sandboxes use it."""
    await ctx(request).manager.templates.delete(name)
    return Response(status_code=204)


@router.put("/v1/templates/{name}/pool", responses=ERRORS)
async def set_pool(request: Request, name: str):
    """Keep `min`–`max` sandboxes of the template ready (frozen, claimed by creates); `schedule`
    raises the floor in UTC windows: `[{"from": "08:00", "to": "20:00", "min": 5}]`."""
    raw = await _body(request, 64 * 1024)
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise errors.InvalidRequest(f"request body is not valid JSON: {e}") from None
    return ctx(request).manager.pools.set(name, body)


@router.get("/v1/templates/{name}/pool", responses=ERRORS)
async def get_pool(request: Request, name: str):
    """The pool: min, max, schedule, desired now, ready, starting, claimed, last_error."""
    return ctx(request).manager.pools.view(name)
