"""The SDK's lifetime conventions and retries, against `httpx.MockTransport` servers: `timeout=`
refused, `timeout_s`/`on_timeout`/`request_timeout` sent where they belong, `connect`, `update`,
`metrics`, and tenacity-driven retries of idempotent calls only (Retry-After honoured)."""

from __future__ import annotations

import json

import httpx
import pytest

import atoll
from atoll import errors
from atoll._client import _base

URL = "http://atoll.test"
SB = {"id": "sb-aaaaaaaaaaaaaaaa", "state": "running", "standby_tier": None, "metadata": {}}


class Script:
    """Answers from a list, one per request (the last repeats), recording each request."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def waits(monkeypatch):
    """The retry sleeps, recorded instead of slept."""
    seen: list[float] = []
    monkeypatch.setattr(_base, "sleep", seen.append)

    async def asleep(s):
        seen.append(s)

    monkeypatch.setattr(_base, "asleep", asleep)
    return seen


def _client(script, **kw) -> atoll.Client:
    return atoll.Client(URL, "k", transport=httpx.MockTransport(script), **kw)


def _busy(status=503, **headers):
    return httpx.Response(
        status,
        headers=headers,
        json={
            "error": {"code": "worker_unavailable", "message": "busy", "request_id": "r", "retryable": True}
        },
    )


def test_timeout_is_refused_with_a_pointer_to_both_meanings():
    with pytest.warns(DeprecationWarning, match="request_timeout="):
        legacy = atoll.Client(URL, timeout=5)  # the client's own HTTP timeout: its old name still works
    assert legacy.request_timeout == 5
    legacy.close()
    with pytest.raises(TypeError, match="not both"):
        atoll.Client(URL, timeout=5, request_timeout=7)
    script = Script(httpx.Response(201, json=SB))
    with _client(script) as c, pytest.raises(TypeError, match="timeout_s="):
        c.sandboxes.create(timeout=300)
    assert script.requests == []  # nothing was sent


def test_create_sends_the_lifetime_and_uses_request_timeout_for_http():
    script = Script(httpx.Response(201, json={**SB, "expires_at": "2026-12-01T20:00:00+00:00"}))
    with _client(script, request_timeout=7) as c:
        sb = c.sandboxes.create(timeout_s=300, on_timeout="delete", request_timeout=42)
        assert c.request_timeout == 7
    body = json.loads(script.requests[0].content)
    assert body["timeout_s"] == 300 and body["on_timeout"] == "delete"
    assert script.requests[0].extensions["timeout"]["read"] == 42
    assert sb.expires_at == "2026-12-01T20:00:00+00:00" and sb.on_timeout == "pause"  # not in answer


def test_connect_resumes_and_update_sends_only_what_is_given():
    script = Script(httpx.Response(200, json=SB))
    with _client(script) as c:
        sb = c.sandboxes.connect(SB["id"])
        assert script.requests[-1].method == "POST" and script.requests[-1].url.path.endswith("/resume")
        assert sb.state == "running"
        sb.update(timeout_s=600)
        assert json.loads(script.requests[-1].content) == {"timeout_s": 600}
        sb.update(timeout_s=None, metadata={"a": "b"})
        assert json.loads(script.requests[-1].content) == {"timeout_s": None, "metadata": {"a": "b"}}
        sb.update(idle_timeout_s=30, on_timeout="delete")
        req = script.requests[-1]
        assert req.method == "PATCH" and json.loads(req.content) == {
            "idle_timeout_s": 30,
            "on_timeout": "delete",
        }


def test_metrics_model():
    figures = {
        "cpu_percent": 12.5,
        "memory_used_mb": 40.1,
        "memory_limit_mb": 512,
        "disk_used_mb": 3.0,
        "disk_limit_mb": 4096,
        "processes": 2,
        "state": "running",
        "standby_tier": None,
    }
    script = Script(httpx.Response(200, json=SB), httpx.Response(200, json=figures))
    with _client(script) as c:
        m = c.sandboxes.connect(SB["id"]).metrics()
    assert script.requests[-1].url.path == f"/v1/sandboxes/{SB['id']}/metrics"
    assert (m.cpu_percent, m.memory_used_mb, m.memory_limit_mb, m.processes) == (12.5, 40.1, 512, 2)


def test_idempotent_calls_retry_retryable_codes_with_backoff(waits):
    script = Script(_busy(503), _busy(502), httpx.Response(200, json=SB))
    with _client(script) as c:
        assert c.sandboxes.get(SB["id"]).id == SB["id"]
    assert len(script.requests) == 3 and len(waits) == 2
    assert 0 < waits[0] <= waits[1]  # exponential (jitter smaller than the step)


def test_retry_after_is_honoured(waits):
    script = Script(_busy(429, **{"Retry-After": "2"}), httpx.Response(200, json=SB))
    with _client(script) as c:
        c.sandboxes.get(SB["id"])
    assert waits == [2.0]


def test_retries_give_up_with_the_servers_error(waits):
    script = Script(_busy(503))
    with _client(script, retries=2) as c, pytest.raises(errors.AtollError) as info:
        c.sandboxes.get(SB["id"])
    assert info.value.status_code == 503 and len(script.requests) == 3


def test_connection_failures_are_retried_then_mapped(waits):
    script = Script(httpx.ConnectError("refused"), httpx.Response(200, json=SB))
    with _client(script) as c:
        c.sandboxes.get(SB["id"])
    assert len(script.requests) == 2
    script = Script(httpx.ConnectError("refused"))
    with _client(script, retries=1) as c, pytest.raises(errors.APIConnectionError):
        c.sandboxes.get(SB["id"])
    assert len(script.requests) == 2


def test_posts_are_never_retried(waits):
    script = Script(_busy(503))
    with _client(script) as c:
        sb = atoll.Sandbox(c, SB)
        with pytest.raises(errors.AtollError):
            sb.exec("true")
        with pytest.raises(errors.AtollError):
            c.sandboxes.create()
    assert len(script.requests) == 2 and waits == []
    script = Script(httpx.ConnectError("refused"))
    with _client(script) as c, pytest.raises(errors.APIConnectionError):
        c.sandboxes.create()
    assert len(script.requests) == 1


def test_a_create_with_an_idempotency_key_is_retried_with_the_same_key(waits):
    script = Script(_busy(503), httpx.ConnectError("refused"), httpx.Response(201, json=SB))
    with _client(script) as c:
        sb = c.sandboxes.create(idempotency_key="job-7")
    assert sb.id == SB["id"] and len(script.requests) == 3 and len(waits) == 2
    assert {r.headers["Idempotency-Key"] for r in script.requests} == {"job-7"}
    assert len({r.content for r in script.requests}) == 1  # the same body each time


def test_retries_zero_disables_and_patch_and_delete_retry(waits):
    script = Script(_busy(503))
    with _client(script, retries=0) as c, pytest.raises(errors.AtollError):
        c.sandboxes.get(SB["id"])
    assert len(script.requests) == 1
    script = Script(_busy(504), httpx.Response(200, json=SB), _busy(503), httpx.Response(204))
    with _client(script) as c:
        sb = atoll.Sandbox(c, SB)
        sb.update(timeout_s=5)
        sb.delete()
    assert [r.method for r in script.requests] == ["PATCH", "PATCH", "DELETE", "DELETE"]


def test_a_streamed_get_is_retried_before_it_starts(waits):
    script = Script(_busy(503), httpx.Response(200, content=b"hello"))
    with _client(script) as c:
        assert b"".join(atoll.Sandbox(c, SB).files.stream("/f")) == b"hello"
    assert len(script.requests) == 2


async def test_the_async_client_retries_the_same_way(waits):
    script = Script(_busy(503), httpx.Response(200, json=SB))
    async with atoll.AsyncClient(URL, "k", transport=httpx.MockTransport(script)) as c:
        sb = await c.sandboxes.get(SB["id"])
        await sb.update(timeout_s=None)
        with pytest.raises(TypeError):
            await c.sandboxes.create(timeout=60)
    assert [r.method for r in script.requests] == ["GET", "GET", "PATCH"] and len(waits) == 1


def test_on_worker_lost_is_sent_at_create_and_update_and_worker_state_read():
    script = Script(
        httpx.Response(201, json={**SB, "on_worker_lost": "restore", "worker_state": "lost"}),
        httpx.Response(200, json={**SB, "on_worker_lost": "fail", "worker_state": "ready"}),
    )
    with _client(script) as c:
        sb = c.sandboxes.create(on_worker_lost="restore")
        assert json.loads(script.requests[0].content)["on_worker_lost"] == "restore"
        assert (sb.on_worker_lost, sb.worker_state) == ("restore", "lost")
        sb.update(on_worker_lost="fail")
        assert json.loads(script.requests[-1].content) == {"on_worker_lost": "fail"}
        assert (sb.on_worker_lost, sb.worker_state) == ("fail", "ready")
