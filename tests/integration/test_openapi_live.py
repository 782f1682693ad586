"""schemathesis against a real `atoll up` (real gVisor sandboxes): the checks of
tests/component/test_openapi.py — no 5xx, every answer's status, content type and body declared
in /openapi.json — over HTTP, with ids pointing at real sandboxes, processes and files half the time.

More tightly bounded than the component run: 5 examples per operation, no coverage phase (each of
its cases is a real call; POST /v1/sandboxes alone would boot dozens of sandboxes), no stateful
phase, and commands bounded to 10 s. Left out: DELETE /v1/workers/{wid} (it forgets a lost worker
for good), the endless streams (tests/component/conftest.py ENDLESS_ROUTES: GET
/v1/sandboxes/watch) and the worker protocol (register, certificate, heartbeat, stopping: the
workers' own calls; a registration that passes makes the server call the URL it names). Every
sandbox the run made is deleted afterwards and a drained worker undrained, since the server is the
session's (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from atoll.controlplane import app as app_mod
from tests.component.test_openapi import CHECKS, add_live_choice, aim, without_endless

pytestmark = pytest.mark.integration

EXEC_TIMEOUT_S = 10  # what a generated command may run for (hypothesis may write `yes` or `cat`)


@pytest.fixture
def live_schema(atoll_server, api, request):
    # schemathesis 4.32 vs pytest 9.2: see the live_atoll fixture of tests/component/test_openapi.py
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid
    before = {s["id"] for s in api.get("/v1/sandboxes").json()["items"]}
    config = schemathesis.Config.from_dict(
        {
            "generation": {"max-examples": 5},
            "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
            "auth": {"openapi": {app_mod.BEARER: {"bearer": atoll_server.api_key}}},
            "request-timeout": 300,
        }
    )
    loaded = schemathesis.openapi.from_url(atoll_server.url + "/openapi.json", config=config)
    add_live_choice(loaded)

    @loaded.hook
    def map_body(context, body):
        if context.operation.path.endswith("/exec") and isinstance(body, dict):
            body["timeout_s"] = EXEC_TIMEOUT_S
        return body

    yield loaded
    for worker in api.get("/v1/workers").json()["items"]:
        if worker["state"] == "draining":
            api.post(f"/v1/workers/{worker['id']}/drain", json={"draining": False})
    for sb in api.get("/v1/sandboxes").json()["items"]:
        if sb["id"] not in before:
            api.delete(f"/v1/sandboxes/{sb['id']}")


schema = without_endless(
    schemathesis.pytest.from_fixture("live_schema")
    .exclude(method="DELETE", path="/v1/workers/{wid}")
    .exclude(
        path=[
            "/v1/workers/register",
            "/v1/workers/certificate",
            "/v1/workers/{wid}/heartbeat",
            "/v1/workers/{wid}/stopping",
        ]
    )
)


@pytest.mark.parametrize("atoll_server", ["up"], indirect=True)
@schema.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_every_answer_is_declared(case, api):
    aim(case, api.request)
    case.call_and_validate(checks=CHECKS)
