"""Fixtures that start a real atoll (`atoll up`, real gVisor sandboxes) and reap what they start."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from atoll.testing import LocalAtoll
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration


def _skip_unless_root():
    if os.geteuid() != 0 or not shutil.which("runsc"):
        pytest.skip("integration tests need root and runsc (run `make test`, which installs them)")


@pytest.fixture(scope="session")
def atoll_server(tmp_path_factory):
    _skip_unless_root()
    home = tmp_path_factory.mktemp("atoll-home")
    local = LocalAtoll(home=home, env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE})
    local.start(timeout=120)
    yield local
    local.stop()


@pytest.fixture(scope="session")
def api(atoll_server):
    with httpx.Client(base_url=atoll_server.url, headers=atoll_server.headers(), timeout=600) as c:
        yield c


@pytest.fixture
def sandbox(api):
    """A fresh running sandbox (auto-standby disabled), deleted afterwards."""
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"test": "fixture"}})
    assert r.status_code == 201, r.text
    sb = r.json()
    yield sb
    api.delete(f"/v1/sandboxes/{sb['id']}")


def run(api, sid, cmd, **kw):
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **kw})
    assert r.status_code == 200, r.text
    return r.json()
