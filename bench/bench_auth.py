"""Benchmark: what a tenant key's check and tenant scoping add to an exec (issue 20: ≤ 0.3 ms p50).

Standalone, no root (`.venv/bin/python bench/bench_auth.py [--rounds N]`): the control plane in
process over a fake worker (atoll.testing.FakeAtoll, requests through its ASGI app, no sockets), so
the figure is the control plane's own cost. Prints one JSON document.

Measured (`perf_counter_ns` around each request, medians): `POST /v1/sandboxes/{id}/exec
{"cmd": "true"}` on one sandbox of a tenant, once with the admin key (ATOLL_API_KEY: a constant-
time compare, every record visible) and once with the tenant's `atk_` key (a primary-key read of
its row, an HMAC-SHA256, the request tracked for revocation, the record's tenant checked),
interleaved in rounds of 200 after warm-ups; `added_us` = the difference of the medians. Also the
key check alone (`Keys.check`, mean of 20,000) for both kinds of key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

import httpx

from atoll.testing import FakeAtoll


async def _loop(client: httpx.AsyncClient, sid: str, n: int) -> list[int]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        out.append(time.perf_counter_ns() - t0)
        assert r.status_code == 200, r.text
    return out


async def main(rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        async with FakeAtoll(d, api_key="bench-admin-key", tier_policy=False) as cp:
            admin = cp.http
            tid = (await admin.post("/v1/tenants", json={"name": "bench"})).json()["id"]
            key = (await admin.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]
            tenant = httpx.AsyncClient(
                transport=cp.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {key}"}
            )
            sid = (await tenant.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
            await _loop(admin, sid, 300)
            await _loop(tenant, sid, 300)
            a: list[int] = []
            t: list[int] = []
            for _ in range(rounds):
                a += await _loop(admin, sid, 200)
                t += await _loop(tenant, sid, 200)
            keys = cp.manager.keys
            assert keys is not None
            n = 20000
            t0 = time.perf_counter_ns()
            for _ in range(n):
                keys.check(b"bench-admin-key")
            check_admin = (time.perf_counter_ns() - t0) / n / 1000
            t0 = time.perf_counter_ns()
            raw = key.encode()
            for _ in range(n):
                keys.check(raw)
            check_tenant = (time.perf_counter_ns() - t0) / n / 1000
            await tenant.aclose()
    admin_p50 = statistics.median(a) / 1000
    tenant_p50 = statistics.median(t) / 1000
    return {
        "bench": "auth",
        "n_each": len(a),
        "exec_admin_key_p50_us": round(admin_p50, 1),
        "exec_tenant_key_p50_us": round(tenant_p50, 1),
        "added_us": round(tenant_p50 - admin_p50, 1),
        "target_added_us": 300,
        "met": tenant_p50 - admin_p50 <= 300,
        "key_check_admin_us": round(check_admin, 2),
        "key_check_tenant_us": round(check_tenant, 2),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    json.dump(asyncio.run(main(args.rounds)), sys.stdout, indent=2)
    print()
