"""Metering on a real gVisor sandbox (an `atoll up` of this module's own, whose worker reports
usage every second, ATOLL_USAGE_EVERY_S, instead of every 5 s: the waits below are a report or
a few long, so ~45 s shorter): CPU burnt inside shows up in `GET /v1/usage` as the runtime
cgroup's own CPU time (read beside it from cpuacct), and an idle sandbox records next to none;
standby images and a volume accrue the bytes they really take."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from atoll.core import ids
from atoll.testing import LocalAtoll
from tests.conftest import TEMPLATE_CACHE, _skip_unless_root

pytestmark = pytest.mark.integration

BURN_S = 3.0
REPORT_S = 1.0  # ATOLL_USAGE_EVERY_S of `metered`


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    _skip_unless_root()
    la = LocalAtoll(
        home=tmp_path_factory.mktemp("metered"),
        env={
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_E2B_PORT": "off",
            "ATOLL_USAGE_EVERY_S": str(REPORT_S),
        },
    )
    la.start(timeout=600)
    yield la
    la.stop()


def _cpu(api, sid: str) -> float:
    r = api.get("/v1/usage", params={"group_by": "sandbox"})
    assert r.status_code == 200, r.text
    return sum(i["cpu_seconds"] for i in r.json()["items"] if i["sandbox_id"] == sid)


def _cgroup_cpu(home: str, sid: str) -> float:
    with open(os.path.join(home, "sandboxes", sid, "runtime.json")) as f:
        gen = json.load(f)["generation"]
    path = f"/sys/fs/cgroup/cpuacct/atoll-{ids.installation_id(home)}/{sid}-{gen}/cpuacct.usage"
    with open(path) as f:
        return int(f.read()) / 1e9


def test_cpu_burnt_in_a_sandbox_is_the_cgroups_cpu_time(metered):
    home = os.path.realpath(metered.home)
    made = []
    with httpx.Client(base_url=metered.url, headers=metered.headers(), timeout=120) as api:
        try:
            for _ in range(2):
                r = api.post("/v1/sandboxes", json={"cpus": 1, "idle_timeout_s": 0})
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
            hot, idle = made
            time.sleep(REPORT_S + 1)  # a first usage report of each
            hot0, idle0, cg0 = _cpu(api, hot), _cpu(api, idle), _cgroup_cpu(home, hot)
            # a fixed amount of the guest's CPU time, whatever else the machine runs
            code = (
                f"import time\nt = time.process_time()\nwhile time.process_time() - t < {BURN_S}:\n    pass\n"
            )
            r = api.post(f"/v1/sandboxes/{hot}/exec", json={"cmd": ["python3", "-c", code]})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            time.sleep(REPORT_S + 1.5)  # the next report after the burn
            burnt, cg = _cpu(api, hot) - hot0, _cgroup_cpu(home, hot) - cg0
            assert cg >= BURN_S * 0.5, (burnt, cg)
            # the same counter, read a report (≤ 1 s of an idle sandbox's CPU) apart
            assert abs(burnt - cg) <= 0.5, (burnt, cg)
            assert _cpu(api, idle) - idle0 < 0.5
        finally:
            for sid in made:
                api.delete(f"/v1/sandboxes/{sid}")


GIB = 2**30
WAIT_REPORT_S = REPORT_S + 2.0
RATE_S = 4.0


def _allocated(path: str) -> int:
    """Allocated bytes of a file or tree (st_blocks), as `du` counts them."""
    if os.path.isfile(path):
        return os.stat(path).st_blocks * 512
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def _subjects(api) -> tuple[float, dict[str, dict]]:
    """The usage items and when they were accrued up to: the middle of the request (the server
    accrues to the moment it answers), so a slow answer does not skew a short window's rate."""
    t0 = time.time()
    r = api.get("/v1/usage", params={"group_by": "sandbox"})
    t1 = time.time()
    assert r.status_code == 200, r.text
    return (t0 + t1) / 2, {i["subject"]: i for i in r.json()["items"]}


def _window(api, *watched: tuple[str, str]) -> tuple[float, dict, float, dict]:
    """Two usage samples in which each watched (subject, field) accrued at one steady rate.

    The meter accrues a new standby image at the disk_mb bound until the worker's report has
    measured it (MEASURE_WAIT_S); on a loaded machine that report can come late, and a window
    that straddles it mixes the two rates. So: windows of RATE_S in a row, until two in a row give
    the same rates (the measured ones, the bound being thousands of times larger), for up to a
    minute; then the two together."""
    deadline = time.monotonic() + 60
    t0, u0 = _subjects(api)
    last = None
    while True:
        time.sleep(RATE_S)
        t1, u1 = _subjects(api)
        rates = [(u1[s][f] - u0[s][f]) / (t1 - t0) if s in u0 and s in u1 else None for s, f in watched]
        if last is not None and all(
            r is not None and p is not None and r == pytest.approx(p, rel=0.05)
            for r, p in zip(rates, last[0], strict=True)
        ):
            return last[1], last[2], t1, u1
        if time.monotonic() > deadline:
            return t0, u0, t1, u1
        last = (rates, t0, u0)
        t0, u0 = t1, u1


def _archive_soon(api: httpx.Client, sid: str, timeout: float = 60) -> httpx.Response:
    """Pause `sid` to the archive. While another process's mount namespace still holds a copy of
    its upper layer's mount (one made by a test running beside this one), the worker keeps it in
    the disk tier and says so ("still attached to a loop device ... tried again later"): ask
    again until that copy is gone. Any other reason is the answer."""
    deadline = time.monotonic() + timeout
    while True:
        r = api.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
        if r.status_code != 200 or r.json()["standby_tier"] == "archive" or time.monotonic() > deadline:
            return r
        if "still attached to a loop device" not in (r.json().get("standby_reason") or ""):
            return r
        time.sleep(2)


def test_standby_images_and_volumes_meter_their_real_bytes(metered):
    """A sandbox paused to disk accrues snapshot_gb_seconds at the bytes its checkpoint and upper
    layer take on the host (not its disk_mb), then in the archive tier at its object's size in the
    store; a volume with 10 MiB written accrues ~10 MiB (not its size_mb)."""
    home = os.path.realpath(metered.home)
    made = []
    vol = f"meter-{os.getpid()}"
    with httpx.Client(base_url=metered.url, headers=metered.headers(), timeout=120) as api:
        try:
            r = api.post("/v1/volumes", json={"name": vol, "size_mb": 256})
            assert r.status_code == 201, r.text
            r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            paused = r.json()["id"]
            made.append(paused)
            disk_mb = r.json()["disk_mb"]
            r = api.post(
                "/v1/sandboxes", json={"idle_timeout_s": 0, "volumes": [{"name": vol, "path": "/data"}]}
            )
            assert r.status_code == 201, r.text
            writer = r.json()["id"]
            made.append(writer)
            r = api.post(
                f"/v1/sandboxes/{writer}/exec",
                json={"cmd": ["sh", "-c", "head -c 10485760 /dev/urandom > /data/blob && sync"]},
            )
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            r = api.post(f"/v1/sandboxes/{paused}/pause", json={"tier": "disk"})
            assert r.status_code == 200 and r.json()["standby_tier"] == "disk", r.text
            time.sleep(WAIT_REPORT_S)  # the worker's next report measures both
            key = f"volume:default/{vol}"
            t0, u0, t1, u1 = _window(api, (paused, "snapshot_gb_seconds"), (key, "volume_gb_seconds"))
            # what the host holds: the checkpoint and the upper layer image; the volume's use
            d = os.path.join(home, "sandboxes", paused)
            image = _allocated(os.path.join(d, "snapshot")) + _allocated(os.path.join(d, "upper.img"))
            st = os.statvfs(os.path.join(home, "stores", "volume", vol, "fs"))
            used = (st.f_blocks - st.f_bfree) * st.f_frsize

            snap_rate = (u1[paused]["snapshot_gb_seconds"] - u0[paused]["snapshot_gb_seconds"]) / (t1 - t0)
            assert snap_rate == pytest.approx(image / GIB, rel=0.05), (snap_rate * GIB, image, disk_mb)
            assert image < disk_mb * 2**20 / 2  # the bound would be far off
            vol_rate = (u1[key]["volume_gb_seconds"] - u0[key]["volume_gb_seconds"]) / (t1 - t0)
            assert 10 * 2**20 <= used <= 14 * 2**20, used
            assert vol_rate == pytest.approx(used / GIB, rel=0.05), (vol_rate * GIB, used)

            # the archive tier: the object's size in the store, as its manifest says
            r = _archive_soon(api, paused)
            assert r.status_code == 200 and r.json()["standby_tier"] == "archive", r.text
            time.sleep(WAIT_REPORT_S)
            field = "snapshot_archive_gb_seconds"
            t0, u0, t1, u1 = _window(api, (paused, field))
            with open(os.path.join(d, "archive.json")) as f:
                stored = json.load(f)["size"]
            arch_rate = (u1[paused][field] - u0[paused][field]) / (t1 - t0)
            assert stored > 0
            assert arch_rate == pytest.approx(stored / GIB, rel=0.05), (arch_rate * GIB, stored)
        finally:
            for sid in made:
                api.delete(f"/v1/sandboxes/{sid}")
            for _ in range(60):  # the volume is free once its holder is gone
                if api.delete(f"/v1/volumes/{vol}").status_code in (204, 404):
                    break
                time.sleep(0.5)
