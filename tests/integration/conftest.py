"""Integration tier: real runsc, namespaces and cgroups through a real `atoll up` (fixtures in
tests/conftest.py), plus `local`: a private `atoll up` per test (for restarts and host checks),
started by the test and reaped afterwards (through its API when it still runs, else purged from
the host), with `client` / `exec_ok` helpers."""

from __future__ import annotations

import httpx
import pytest

from atoll.testing import LocalAtoll, purge
from tests.conftest import TEMPLATE_CACHE, run  # noqa: F401  (run re-exported for the test modules)


@pytest.fixture
def local(tmp_path):
    la = LocalAtoll(home=tmp_path / "home", env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE})
    yield la
    if la.proc is None:
        # Stopped (or killed) by the test: remove what it left from the host, as stop(reap=True)
        # does last (atoll.testing.purge), without starting it again only to delete (~10-15 s).
        purge(la.home)
    else:
        la.stop(reap=True)


def client(la: LocalAtoll) -> httpx.Client:
    return httpx.Client(base_url=la.url, headers=la.headers(), timeout=300)


def exec_ok(c: httpx.Client, sid: str, cmd) -> dict:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    return r.json()
