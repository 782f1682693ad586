"""Integration tier: real runsc, namespaces and cgroups through a real `atoll up` (fixtures in
tests/conftest.py), plus `local`: a private `atoll up` per test (for restarts and host checks),
started by the test and reaped afterwards, with `client` / `exec_ok` helpers."""

from __future__ import annotations

import httpx
import pytest

from atoll.testing import LocalAtoll
from tests.conftest import TEMPLATE_CACHE, run  # noqa: F401  (run re-exported for the test modules)


@pytest.fixture
def local(tmp_path):
    la = LocalAtoll(home=tmp_path / "home", env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE})
    yield la
    # Reap whatever the test left, with a server running.
    if la.proc is None:
        la.start(timeout=600)
    la.stop(reap=True)


def client(la: LocalAtoll) -> httpx.Client:
    return httpx.Client(base_url=la.url, headers=la.headers(), timeout=300)


def exec_ok(c: httpx.Client, sid: str, cmd) -> dict:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    return r.json()
