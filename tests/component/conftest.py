"""Component tier: the real control plane in process (FastAPI app, records, lifecycle, tier policy)
over `atoll.testing.FakeWorker`s, through `atoll.testing.FakeAtoll`. Its records are SQLite; a
module or test marked `databases` runs on SQLite and on PostgreSQL (tests/conftest.py)."""

from __future__ import annotations

import pytest

from atoll.testing import FakeAtoll

KEY = "component-key"


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
