"""Template builds that must end, and paths that must not be told apart, through a real `atoll up`
with real gVisor build sandboxes: a step past ATOLL_BUILD_STEP_TIMEOUT_S and a build past
ATOLL_BUILD_TIMEOUT_S end `failed`, naming the step (or what the build was doing), and leave no
build sandbox behind; FROM oci-archive: gives one answer for a missing path, a directory and a
file that is no image archive."""

from __future__ import annotations

import os
import secrets
import subprocess
import time

import pytest

import atoll
from atoll.testing import LocalAtoll
from tests.conftest import TEMPLATE_CACHE, _skip_unless_root

pytestmark = pytest.mark.integration

NONCE = secrets.token_hex(4)
STEP_LIMIT_S = 10
"""Long enough for `RUN echo` on a loaded 2-core machine (3 s was not: a CI-load flake)."""
BUILD_LIMIT_S = 25


@pytest.fixture(scope="module")
def la(tmp_path_factory):
    _skip_unless_root()
    local = LocalAtoll(
        home=tmp_path_factory.mktemp("atoll-build-limits") / "home",
        env={
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_BUILD_STEP_TIMEOUT_S": str(STEP_LIMIT_S),
            "ATOLL_BUILD_TIMEOUT_S": str(BUILD_LIMIT_S),
            "ATOLL_BUILD_ALLOW_OUT": "",
        },
    )
    local.start(timeout=600)
    try:
        yield local
    finally:
        local.stop(reap=True)


@pytest.fixture(scope="module")
def client(la):
    with atoll.Client(base_url=la.url, api_key=la.api_key, request_timeout=120) as c:
        yield c


def _host_sandboxes(la) -> tuple[set[str], set[str]]:
    """The sandbox directories of the worker's home and the containers its runsc knows."""
    dirs = set(os.listdir(os.path.join(la.home, "sandboxes")))
    listed = subprocess.run(
        ["runsc", "--root", os.path.join(la.home, "runsc"), "list", "-quiet"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return dirs, set(listed)


def _fails(client, name, **spec) -> tuple[atoll.BuildFailed, float]:
    t0 = time.monotonic()
    with pytest.raises(atoll.BuildFailed) as ei:
        client.templates.build(name, timeout=300, **spec)
    return ei.value, time.monotonic() - t0


def _log(la, name, build_id) -> str:
    import httpx

    r = httpx.get(f"{la.url}/v1/templates/{name}/builds/{build_id}/logs", headers=la.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.text


def test_a_step_past_its_limit_fails_the_build_naming_it(la, client):
    before = _host_sandboxes(la)
    e, took = _fails(client, "step-limit", run=[f"echo {NONCE}", f"sleep 1000 # {NONCE}"])
    want = (
        f"step 2/2 (RUN sleep 1000 # {NONCE}) did not finish within {STEP_LIMIT_S}s "
        "(ATOLL_BUILD_STEP_TIMEOUT_S)"
    )
    assert want in e.message, e.message
    assert took < 120, took  # not 1000 s
    t = client.templates.get("step-limit")
    assert t.status == "failed" and want in (t.error or ""), t.to_dict()
    log = _log(la, "step-limit", e.build_id)
    assert f"STEP [2/2] RUN sleep 1000 # {NONCE}" in log and log.rstrip().splitlines()[-1].startswith("ERROR")
    # the build sandbox was deleted before the build was reported failed
    assert _host_sandboxes(la) == before


def test_a_build_past_its_limit_fails_naming_what_it_was_doing(la, client):
    before = _host_sandboxes(la)
    e, took = _fails(
        client,
        "build-limit",
        env={"NONCE": NONCE},
        start="sleep 1000",
        ready={"cmd": "false", "timeout_s": 600},
    )
    assert f"the build did not finish within {BUILD_LIMIT_S}s (ATOLL_BUILD_TIMEOUT_S)" in e.message, e.message
    assert "booting the template and making its snapshot" in e.message, e.message
    assert BUILD_LIMIT_S - 1 < took < BUILD_LIMIT_S + 90, took
    assert client.templates.get("build-limit").status == "failed"
    assert _host_sandboxes(la) == before


def test_oci_archive_paths_get_one_answer_whether_they_exist_or_not(la, client, tmp_path):
    """A missing path, a directory, a text file and a tar that is no image archive: the same
    accepted request, the same failed build, the same error and log line but for the path; the
    cause is in the worker's log only."""
    os.mkdir(tmp_path / "dir")
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    subprocess.run(["tar", "-cf", str(tmp_path / "backup.tar"), "-C", str(tmp_path), "passwd"], check=True)
    paths = [tmp_path / "nope.tar", tmp_path / "dir", tmp_path / "passwd", tmp_path / "backup.tar"]
    answers = set()
    for i, path in enumerate(paths):
        name = f"oci-{i}"
        e, _ = _fails(client, name, from_=f"oci-archive:{path}")
        log = _log(la, name, e.build_id)
        [error_line] = [ln for ln in log.splitlines() if ln.startswith("ERROR")]
        error = client.templates.get(name).error or ""
        assert error in e.message, (error, e.message)  # the SDK adds the build's id and name
        answers.add((error.replace(str(path), "PATH"), error_line.replace(str(path), "PATH")))
        for cause in ("does not exist", "not a regular file", "not a tar", "neither manifest.json"):
            assert cause not in log and cause not in e.message, (path, e.message, log)
    assert len(answers) == 1, answers
    [(message, _)] = answers
    assert "no docker save or OCI image archive can be read at this path" in message, message
    with open(la.log_path, encoding="utf-8", errors="replace") as f:
        worker_log = f.read()
    assert f"{paths[0]}: does not exist" in worker_log and f"{paths[1]}: not a regular file" in worker_log
