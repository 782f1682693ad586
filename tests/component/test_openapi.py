"""/openapi.json is accurate and drivable: the document is checked for soundness (every `$ref`
resolves, no 422 this server never answers, the bearer scheme and a 401 on every protected
operation, an ErrorBody for the 4xx answers), then schemathesis drives every operation of the
in-process control plane (atoll.testing.FakeAtoll, through its ASGI app) and checks that no
answer is a 5xx and that every answer — status, content type, body — is one the document declares.

Component tier (no root). The same checks against a real `atoll up`: tests/integration/test_openapi_live.py.
"""

from __future__ import annotations

import asyncio
import os
import typing

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from atoll.controlplane import app as app_mod
from atoll.controlplane import http as http_mod
from atoll.testing import FakeAtoll, FakeWorker
from tests.component.conftest import ENDLESS_ROUTES, KEY

# the operations of app.PUBLIC_PATHS (the others are not in the document); /metrics only with
# ATOLL_METRICS_PUBLIC=1
PUBLIC = {"/healthz", "/metrics"} & app_mod.PUBLIC_PATHS


def _refs(node: typing.Any) -> typing.Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _operations(doc: dict) -> typing.Iterator[tuple[str, str, dict]]:
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield path, method.upper(), op


async def test_the_document_is_sound(fake):
    r = await fake.http.get("/openapi.json", headers={"Authorization": ""})  # public
    assert r.status_code == 200
    doc = r.json()
    components = doc["components"]["schemas"]
    for ref in set(_refs(doc)):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in components, ref
    for name, hand_made in http_mod.component_schemas().items():  # no two models of one name
        assert components[name] == hand_made, name
    assert "HTTPValidationError" not in components and "ValidationError" not in components
    # the hand-read bodies are components, not inlined copies
    for name in ("CreateSandbox", "ExecRequest", "PauseRequest", "DrainRequest", "RegisterRequest"):
        assert name in components and "$defs" not in components[name], name
    scheme = doc["components"]["securitySchemes"][app_mod.BEARER]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    error_body = {"$ref": "#/components/schemas/ErrorBody"}
    for path, method, op in _operations(doc):
        name = f"{method} {path}"
        answers = op["responses"]
        assert "422" not in answers, name
        errors = {s: a for s, a in answers.items() if s[0] in "45"}
        for status, answer in errors.items():
            if (path, status) != ("/healthz", "503"):  # 503 `starting` is the Health object
                assert answer["content"]["application/json"]["schema"] == error_body, (name, status)
        assert "500" in errors, name
        if op.get("parameters") or op.get("requestBody"):
            assert "400" in errors, name
        if path in PUBLIC:  # nothing about them can be a 4xx: no parameters, no key
            assert "security" not in op and not any(s[0] == "4" for s in errors), name
        else:
            assert op["security"] == [{app_mod.BEARER: []}] and "401" in errors, name
    files = doc["paths"]["/v1/sandboxes/{sid}/files"]["put"]["requestBody"]
    assert files["content"] == {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
    }
    listing = doc["paths"]["/v1/sandboxes"]["get"]
    metadata = next(p for p in listing["parameters"] if p["name"] == "metadata")
    assert metadata["style"] == "form" and metadata["explode"] is True
    assert "metadata." in listing["description"]


async def test_the_metadata_filters_work_as_documented(fake):
    """`{"metadata.team": "a"}` in the exploded form style is `?metadata.team=a`: what the route reads."""
    await fake.http.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"team": "a"}})
    await fake.http.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"team": "b"}})
    r = await fake.http.get("/v1/sandboxes", params={"metadata.team": "a"})
    assert [s["metadata"] for s in r.json()["items"]] == [{"team": "a"}]


# ---- schemathesis over the ASGI app ---------------------------------------------------------------
# The pieces below are shared with tests/integration/test_openapi_live.py.

LIVE = "@live"  # a path parameter hypothesis chose to point at something that exists (see `aim`)
FILE = "/root/live.txt"  # a file kept in the live sandbox, for the files routes
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance]


def point_at_live(case: schemathesis.Case) -> schemathesis.Case:
    """The case with its ids marked to be replaced by real ones at call time (and the live file as
    its path), so that the routes are driven past their 404s too."""
    for name in ("sid", "pid", "wid"):
        if name in (case.path_parameters or {}):
            case.path_parameters[name] = LIVE
    if "/files" in case.path and case.query is not None:
        case.query.pop("path_b64", None)
        case.query["path"] = FILE
    return case


def add_live_choice(loaded: schemathesis.BaseSchema) -> None:
    """Let hypothesis choose, case by case, between its own ids and real ones."""

    @loaded.hook
    def flatmap_case(context, case):
        return st.booleans().map(lambda real: point_at_live(case) if real else case)


def live_id(request: typing.Callable[..., httpx.Response], what: str) -> str:
    """The id of something that exists — `sid` a usable sandbox of this test's (labelled
    test=openapi), `file` one holding FILE, `pid` a background process in it, `wid` the (first)
    worker — made through `request` if need be."""
    wid = request("GET", "/v1/workers").json()["items"][0]["id"]
    if what == "wid":
        return wid
    mine = request("GET", "/v1/sandboxes", params={"metadata.test": "openapi"}).json()["items"]
    usable = [s for s in mine if s["state"] in ("running", "standby")]
    if usable:
        sid = usable[0]["id"]
    else:
        request("POST", f"/v1/workers/{wid}/drain", json={"draining": False})  # if the fuzzing drained it
        r = request("POST", "/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"test": "openapi"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
    if what == "pid":
        # short-lived: a fuzzed `wait` without timeout_s or an `output?follow=1` lasts as long as it does
        r = request("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sleep", "5"], "background": True})
        assert r.status_code == 200, r.text
        return str(r.json()["pid"])
    if what == "file":
        r = request("PUT", f"/v1/sandboxes/{sid}/files", params={"path": FILE}, content=b"live\n")
        assert r.status_code == 204, r.text
    return sid


def aim(case: schemathesis.Case, request: typing.Callable[..., httpx.Response]) -> None:
    """Replace the LIVE marks by real ids. Coverage cases (made without hypothesis, so without the
    choice) always get real ids, but for the parameter the case is about, so that the variations of
    their bodies and queries reach the sandbox instead of stopping at a 404."""
    meta = case.meta
    if case.path.startswith("/v1/templates") and case.method.upper() in ("POST", "PUT"):
        # a build or a pool places work on a worker, as a create does: undo a fuzzed drain first
        wid = request("GET", "/v1/workers").json()["items"][0]["id"]
        request("POST", f"/v1/workers/{wid}/drain", json={"draining": False})
    if case.path.endswith("/files/watch") and case.method.upper() == "GET" and isinstance(case.query, dict):
        # a watch of a directory that exists streams until its client leaves (the fuzzer would wait
        # for its end): fuzzed paths that are not a file become the file, which answers 400 at once
        # (tests/component/test_fileops.py covers watches that stream)
        case.query.pop("path_b64", None)
        case.query["path"] = FILE
    varied = meta.phase.data.parameter if meta is not None and meta.phase.name == "coverage" else LIVE
    params = case.path_parameters or {}
    for name, what in (("sid", "file" if "/files" in case.path else "sid"), ("pid", "pid"), ("wid", "wid")):
        if name in params and (params[name] == LIVE or varied not in (LIVE, name)):
            params[name] = live_id(request, what)


class LiveAtoll:
    """An ASGI app whose lifespan starts a FakeAtoll (and stops it), so that the control plane runs
    on the event loop schemathesis serves its in-process requests from; `request` calls its API
    from the test's thread, on that loop."""

    def __init__(self, directory: str):
        self.directory = directory
        self.fake: FakeAtoll | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            assert self.fake is not None
            return await self.fake.app(scope, receive, send)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # room for every sandbox the fuzzing creates (placement refusals are tested elsewhere)
                worker = FakeWorker(memory_mb=1 << 30, cpus=1 << 20)
                self.fake = FakeAtoll(self.directory, [worker], api_key=KEY, max_file_bytes=1 << 20)
                await self.fake.start()
                self.loop = asyncio.get_running_loop()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.fake is not None:
                    await self.fake.stop()
                    self.fake = None
                await send({"type": "lifespan.shutdown.complete"})
                return

    def request(self, method: str, url: str, **kw: typing.Any) -> httpx.Response:
        assert self.fake is not None and self.loop is not None
        call = self.fake.http.request(method, url, **kw)
        return asyncio.run_coroutine_threadsafe(call, self.loop).result(timeout=30)


@pytest.fixture
def live_atoll(tmp_path, request):
    # schemathesis 4.32 renames the test node per operation through `node._nodeid`, which pytest 9.2
    # no longer has (the id is `node.nodeid`, from `_id`): give it the attribute it reads and sets.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid
    app = LiveAtoll(os.fspath(tmp_path))
    yield app
    if app.fake is not None:  # schemathesis ends the lifespan after each test; in case it did not
        schemathesis.python.asgi.shutdown_lifespans()


@pytest.fixture
def api_schema(live_atoll):
    config = schemathesis.Config.from_dict(
        {
            "generation": {"max-examples": 15},
            "phases": {"stateful": {"enabled": False}},
            "auth": {"openapi": {app_mod.BEARER: {"bearer": KEY}}},
        }
    )
    loaded = schemathesis.openapi.from_asgi("/openapi.json", live_atoll, config=config)
    add_live_choice(loaded)
    return loaded


def without_endless(schema):
    """`schema` without the ENDLESS_ROUTES: each streams until its client leaves, and the fuzzer
    waits for an answer's end (tests/component/test_watch.py covers them)."""
    for method, path in ENDLESS_ROUTES:
        schema = schema.exclude(method=method, path=path)
    return schema


# POST /v1/workers/register is left out: a registration that passes makes the control plane adopt
# a remote worker at the URL it names and call it — schemathesis would pick the address.
schema = without_endless(
    schemathesis.pytest.from_fixture("api_schema").exclude(method="POST", path="/v1/workers/register")
)


@schema.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_every_answer_is_declared(case, live_atoll):
    aim(case, live_atoll.request)
    case.call_and_validate(checks=CHECKS)
