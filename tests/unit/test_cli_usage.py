"""`atoll usage` and `Client.usage` (cli.usage, the SDK's usage call) over an httpx.MockTransport:
the query sent, the table with its total row, the bar chart, bad options refused."""

from __future__ import annotations

import datetime as dt
import json

import httpx
import pytest

from atoll.cli import usage as cli_usage

from .test_cli import Routes, routes, run  # noqa: F401 - the fixture

AMOUNTS = {
    "cpu_seconds": 0.0,
    "memory_gb_seconds": 0.0,
    "standby_memory_gb_seconds": 0.0,
    "snapshot_gb_seconds": 0.0,
    "snapshot_disk_gb_seconds": 0.0,
    "snapshot_archive_gb_seconds": 0.0,
    "volume_gb_seconds": 0.0,
    "drive_gb_seconds": 0.0,
    "egress_bytes": 0,
    "ingress_bytes": 0,
    "build_seconds": 0.0,
    "cost": 0.0,
}


def body(by: str) -> dict:
    a = {**AMOUNTS, "cpu_seconds": 60.0, "cost": 0.5}
    b = {**AMOUNTS, "standby_memory_gb_seconds": 30.0, "cost": 0.25}
    key = {"sandbox": "sandbox_id", "day": "day", "tenant": "tenant_id"}[by]
    items = [{key: "sb-aaaaaaaaaaaaaaaa", **a}, {key: "sb-bbbbbbbbbbbbbbbb", **b}]
    total = {k: a[k] + b[k] for k in AMOUNTS}
    return {
        "from": "2026-12-01T00:00:00Z",
        "to": "2026-12-02T00:00:00Z",
        "group_by": by,
        "items": items,
        "total": total,
    }


def test_usage_prints_a_table_with_its_total_and_a_bar_chart(routes: Routes):  # noqa: F811
    routes.on("GET", "/v1/usage", httpx.Response(200, json=body("day")))
    r = run("usage", "--from", "2026-12-01", "--to", "2026-12-02", "--by", "day")
    assert r.exit_code == 0, r.output
    q = dict(routes.last.url.params)
    assert q == {"from": "2026-12-01", "to": "2026-12-02", "group_by": "day"}
    lines = r.output.splitlines()
    assert any(line.startswith("TOTAL") and "0.7500" in line and "60.0" in line for line in lines), r.output
    chart = lines[lines.index("cost:") + 1 :]
    assert chart[0].count("█") == cli_usage.BAR_WIDTH and chart[0].endswith("0.5000")
    assert chart[1].count("█") == cli_usage.BAR_WIDTH // 2


def test_usage_json_and_bad_options(routes: Routes):  # noqa: F811
    routes.on("GET", "/v1/usage", httpx.Response(200, json=body("tenant")))
    r = run("usage", "--by", "tenant", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["group_by"] == "tenant"
    assert run("usage", "--by", "week").exit_code == 2
    assert run("usage", "--chart", "gpus").exit_code == 2


def test_client_usage_sends_iso_times():
    import atoll

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=body("sandbox"))

    with atoll.Client("http://atoll.test", "k", transport=httpx.MockTransport(handler)) as c:
        out = c.usage(from_=dt.datetime(2026, 12, 1), to=dt.datetime(2026, 12, 2, tzinfo=dt.UTC))
        assert out["total"]["cost"] == 0.75
        with pytest.raises(ValueError, match="not one of"):
            c.usage(group_by="week")
    assert dict(seen[0].url.params) == {
        "group_by": "sandbox",
        "from": "2026-12-01T00:00:00Z",
        "to": "2026-12-02T00:00:00+00:00",
    }
