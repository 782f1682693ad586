"""Bad input gets a clear JSON error with a stable code, never a traceback or a 5xx."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.seam]


def _err(r: httpx.Response, status: int | tuple, code: str) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    assert body["message"] and body["request_id"].startswith("req_")
    assert "Traceback" not in r.text
    return body


def test_auth_required(atoll_server):
    r = httpx.get(atoll_server.url + "/v1/sandboxes")
    _err(r, 401, "unauthorized")
    r = httpx.get(atoll_server.url + "/v1/sandboxes", headers={"Authorization": "Bearer wrong"})
    _err(r, 401, "unauthorized")
    assert httpx.get(atoll_server.url + "/healthz").status_code == 200
    # per-tenant usage labels: /metrics needs an admin key (unless ATOLL_METRICS_PUBLIC=1)
    _err(httpx.get(atoll_server.url + "/metrics"), 401, "unauthorized")
    m = httpx.get(atoll_server.url + "/metrics", headers=atoll_server.headers())
    assert (
        m.status_code == 200 and "atoll_sandboxes" in m.text and "atoll_lifecycle_duration_seconds" in m.text
    )
    spec = httpx.get(atoll_server.url + "/openapi.json").json()
    assert "/v1/sandboxes/{sid}/exec" in spec["paths"]


def test_unknown_and_malformed(api):
    e = _err(api.post("/v1/sandboxes", json={"template": "nope"}), 404, "template_not_found")
    assert "nope" in e["message"] and "base" in e["message"]
    _err(api.get("/v1/sandboxes/sb-0000000000000000"), 404, "sandbox_not_found")
    e = _err(api.get("/v1/sandboxes/not-an-id"), 400, "invalid_request")
    assert "not-an-id" in e["message"]
    _err(api.post("/v1/sandboxes/sb-0000000000000000/exec", json={"cmd": "true"}), 404, "sandbox_not_found")
    r = api.post("/v1/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"})
    _err(r, 400, "invalid_request")
    e = _err(api.post("/v1/sandboxes", json={"memory_mb": -5}), (400, 422), "invalid_request")
    assert "memory_mb" in e["message"]
    _err(api.post("/v1/sandboxes", json={"idle_timeout_s": "soon"}), (400, 422), "invalid_request")
    _err(
        api.post(
            "/v1/sandboxes", content=b"x" * (2 * 1024 * 1024), headers={"Content-Type": "application/json"}
        ),
        413,
        "payload_too_large",
    )
    _err(api.get("/v1/sandboxes", params={"state": "sleepy"}), 400, "invalid_request")
    _err(api.get("/v1/nothing-here"), 404, "not_found")


def test_sandbox_level_errors(api, sandbox):
    sid = sandbox["id"]
    _err(api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ""}), 400, "invalid_request")
    _err(api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": []}), 400, "invalid_request")
    _err(api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "cwd": "rel"}), 400, "invalid_request")
    e = _err(
        api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "cwd": "/does/not/exist"}),
        400,
        "invalid_request",
    )
    assert "/does/not/exist" in e["message"]
    _err(
        api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "timeout_s": -1}),
        (400, 422),
        "invalid_request",
    )
    _err(api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "ice"}), (400, 422), "invalid_request")
    _err(api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/etc"}), 400, "invalid_path")
    _err(api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/nope"}), 404, "file_not_found")
    _err(api.delete(f"/v1/sandboxes/{sid}/processes/abc"), 400, "invalid_request")
    # The sandbox is unharmed by all of this.
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo fine"})
    assert r.json()["stdout"] == "fine\n"


def test_delete_during_pause_waits_and_loses_nothing(api):
    import threading

    sid = api.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
    res = {}
    t = threading.Thread(
        target=lambda: res.setdefault("pause", api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}))
    )
    t.start()
    r = api.delete(f"/v1/sandboxes/{sid}")
    t.join()
    assert r.status_code == 204
    assert res["pause"].status_code in (200, 404, 409), res["pause"].text
    _err(api.get(f"/v1/sandboxes/{sid}"), 404, "sandbox_not_found")


def test_calls_in_flight_when_the_sandbox_is_deleted_answer_404(api):
    """An exec still running when its sandbox is deleted (and a listing the dashboard had in flight)
    answer 404 sandbox_not_found: the worker closed the agent's connection on purpose, which is not
    the agent failing to answer (that was a 500 runtime_error)."""
    import threading
    import time

    sid = api.post("/v1/sandboxes", json={"idle_timeout_s": 0}).json()["id"]
    assert api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 200
    res: dict = {}
    t = threading.Thread(
        target=lambda: res.setdefault(
            "exec",
            api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "touch /tmp/started; sleep 60"}, timeout=90),
        )
    )
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the exec is running once its file is there
        if api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/started"}).status_code == 200:
            break
        time.sleep(0.1)
    assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
    t.join(90)
    r = res["exec"]
    assert r.status_code == 404, r.text
    _err(r, 404, "sandbox_not_found")
    assert "deleted" in r.json()["error"]["message"]
