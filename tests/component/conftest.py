"""Component tier: the real control plane in process (FastAPI app, records, lifecycle, tier policy)
over `atoll.testing.FakeWorker`s, through `atoll.testing.FakeAtoll`. Its records are SQLite; a
module or test marked `databases` runs on SQLite and on PostgreSQL (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvicorn

from atoll.testing import FakeAtoll

KEY = "component-key"
ENDLESS_ROUTES = [("GET", "/v1/sandboxes/watch")]
"""(method, path) of the routes that, let through, stream until their client leaves (keep-alive
lines, no end, so no request timeout ends them either): the walks over every route
(tests/component/test_openapi.py, tests/integration/test_openapi_live.py,
tests/security/test_scopes.py) wait for an answer's end, and leave them out;
tests/component/test_watch.py covers them."""


@pytest.fixture
async def fake(request, tmp_path, database_kind):
    """The control plane over one fake worker; its records in SQLite, or — in a module or test
    marked `databases`, which then runs twice — on the session's PostgreSQL too."""
    url = request.getfixturevalue("database_url") if database_kind != "sqlite" else None
    async with FakeAtoll(
        tmp_path, api_key=KEY, max_file_bytes=1024, max_exec_output_bytes=4096, database_url=url
    ) as f:
        yield f


async def create(c, **kw) -> str:
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, **kw})
    assert r.status_code == 201, r.text
    return r.json()["id"]


@contextlib.asynccontextmanager
async def serve_on_loopback(app):
    """`app` served by uvicorn (WebSockets too) on a free loopback port: its "127.0.0.1:port"."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_config=None, lifespan="off", ws="websockets-sansio"
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
