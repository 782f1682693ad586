"""Component tier: the real control plane in process (FastAPI app, SQLite, lifecycle, tier policy)
over `atoll.testing.FakeWorker`s, through `atoll.testing.FakeAtoll`."""

from __future__ import annotations

import pytest

from atoll.testing import FakeAtoll

KEY = "component-key"


@pytest.fixture
async def fake(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY, max_file_bytes=1024, max_exec_output_bytes=4096) as f:
        yield f


async def create(c, **kw) -> str:
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, **kw})
    assert r.status_code == 201, r.text
    return r.json()["id"]
