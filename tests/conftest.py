"""Shared test configuration: markers, the template cache shared by every test installation, and the
session-wide real atoll (integration and e2e tiers) with fixtures that reap what they start.

`atoll_server` is a real `atoll up`. A test that crosses the control plane <-> worker seam in a way
the split can break (streams, tunnels, terminals, disconnects, large bodies, error mapping,
standby/resume driven over the seam) opts in with the `seam` marker (on the test, or in its module's
`pytestmark`): it then runs twice, against `atoll up` and against `atoll server` + one separate
`atoll worker` (LocalCluster). Everything else runs against `atoll up` only, so a new module costs
one deployment by default; the guest agent's own behaviour is the same behind either.
tests/integration/test_split_routes.py walks every REST route through the split, so that no route
goes untested there, and tests/integration/test_split.py covers the split's own failure modes."""

from __future__ import annotations

import itertools
import os
import shutil

import httpx
import pytest

from atoll.testing import LocalAtoll, LocalCluster
from atoll.testing import postgres as pgtesting
from tests import file_order

# One template layer cache for all test installations, so the Debian base layer is built once per
# machine (~30-60 s) rather than once per test home.
TEMPLATE_CACHE = os.environ.get("ATOLL_TEST_TEMPLATE_DIR", "/var/tmp/atoll-test-templates")
# And one cache of built-in templates' start-up snapshots (the `base` image every installation
# would otherwise boot and checkpoint again, ~4-10 s of each start): every installation a test starts
# (they inherit this environment) copies it in, or makes it and publishes a copy
# (worker.images.image_cache). ATOLL_TEST_IMAGE_CACHE= (empty) turns it off.
IMAGE_CACHE = os.environ.setdefault("ATOLL_TEST_IMAGE_CACHE", "/var/tmp/atoll-test-images")
PG_TEMPLATE = "atoll_template"


def pytest_configure(config):
    # ATOLL_TEST_ORDER=longest (pytest-xdist, --dist loadfile): the longest files first
    # (tests/file_order.py). Off by default: its one CI run took 16 min 35 s against 13 min 18 s
    # before it (2026-12-07), not yet told apart from the suite's growth.
    if os.environ.get("ATOLL_TEST_ORDER") == "longest":
        file_order.configure(config)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integration" in str(item.fspath) or "e2e" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


def _skip_unless_root():
    if os.geteuid() != 0 or not shutil.which("runsc"):
        pytest.skip("integration tests need root and runsc (run `make test`, which installs them)")


def pytest_generate_tests(metafunc):
    # The explicit opt-in: only `seam` tests run in both deployments (see the module docstring).
    # A `slow` test runs once, against `atoll up`, even when it is marked `seam` too.
    d = metafunc.definition
    # `databases` tests (and those that take `database_url` themselves) run on SQLite and PostgreSQL
    if "database_kind" in metafunc.fixturenames and (
        d.get_closest_marker("databases") or "database_url" in metafunc.fixturenames
    ):
        metafunc.parametrize("database_kind", ["sqlite", "postgresql"], indirect=True)
    if (
        "atoll_server" in metafunc.fixturenames
        and d.get_closest_marker("seam")
        and not d.get_closest_marker("slow")
    ):
        metafunc.parametrize("atoll_server", ["up", "split"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def postgres():
    """One private PostgreSQL cluster per test process (atoll.testing.postgres), with a database
    `atoll_template` at the newest migration that each test's database is copied from. Missing
    PostgreSQL fails the test (CI must run both databases); ATOLL_TEST_SKIP_POSTGRES=1 skips it."""
    try:
        cluster = pgtesting.PostgresCluster().start()
    except pgtesting.PostgresMissing as e:  # no programs, or (as root) no `postgres` user
        if os.environ.get("ATOLL_TEST_SKIP_POSTGRES") == "1":
            pytest.skip(f"ATOLL_TEST_SKIP_POSTGRES=1: {e}")
        pytest.fail(f"{e} (or set ATOLL_TEST_SKIP_POSTGRES=1 to skip the PostgreSQL runs)", pytrace=False)
    try:
        cluster.migrated_template(PG_TEMPLATE)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def database_kind(request) -> str:
    """ "sqlite" or "postgresql": both for `databases` tests (pytest_generate_tests); for the others
    $ATOLL_TEST_DATABASE (default sqlite), so `ATOLL_TEST_DATABASE=postgresql pytest tests/component`
    runs every `fake` control plane on PostgreSQL."""
    return getattr(request, "param", None) or os.environ.get("ATOLL_TEST_DATABASE", "sqlite")


_databases = itertools.count()


@pytest.fixture
def database_url(request, database_kind, tmp_path):
    """A fresh records database of `database_kind`, at the newest migration: SQLite in tmp_path, or
    on PostgreSQL a database copied from the session's template (dropped afterwards)."""
    if database_kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'records.db'}"
        return
    cluster = request.getfixturevalue("postgres")
    name = f"t{os.getpid()}_{next(_databases)}"
    yield cluster.create_database(name, template=PG_TEMPLATE)
    cluster.drop_database(name)


@pytest.fixture(scope="session")
def atoll_up(tmp_path_factory):
    _skip_unless_root()
    home = tmp_path_factory.mktemp("atoll-home")
    local = LocalAtoll(home=home, env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE})
    local.start(timeout=600)
    yield local
    local.stop()


@pytest.fixture(scope="session")
def atoll_split(tmp_path_factory):
    _skip_unless_root()
    cluster = LocalCluster(
        tmp_path_factory.mktemp("atoll-split"), workers=1, env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE}
    )
    cluster.start(timeout=600)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def atoll_server(request):
    """`atoll up`, or (parametrized "split") `atoll server` + one `atoll worker`."""
    return request.getfixturevalue(
        "atoll_split" if getattr(request, "param", "up") == "split" else "atoll_up"
    )


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


@pytest.fixture(scope="module")
def shared_sandbox(api):
    """One running sandbox for a module's read-only tests, deleted after the module: a test takes it
    instead of `sandbox` only if it changes nothing another test could observe (no files another
    test reads, no processes left running, no standby, no limits, no kills)."""
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"test": "shared"}})
    assert r.status_code == 201, r.text
    sb = r.json()
    yield sb
    api.delete(f"/v1/sandboxes/{sb['id']}")


def run(api, sid, cmd, **kw):
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **kw})
    assert r.status_code == 200, r.text
    return r.json()
