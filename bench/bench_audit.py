"""Benchmark: what the audit trail costs a mutation, a batch insert and a page of GET /v1/audit.

Standalone, no root (`.venv/bin/python bench/bench_audit.py [--rows N]`): the control plane in
process over a fake worker (atoll.testing.FakeAtoll, requests through its ASGI app, no sockets), so
the figures are the control plane's own cost without network noise. Prints one JSON document.

Measured (`perf_counter_ns` around each request, medians):
  exec_with_audit / exec_without_audit   POST /v1/sandboxes/{id}/exec {"cmd": "true"} on two
      FakeAtolls built alike, one with its AuditMiddleware taken out; interleaved in rounds of 200
      (n = rounds x 200 each, after warm-ups); `added_us` = the difference of the medians
  middleware_alone_us   the AuditMiddleware around an app that only answers an exec-shaped request
                        (the row built and queued; the queue's own append is left out), mean of 20,000
  flush_500_rows_ms     one batch insert of 500 rows (what the background task does at most every
                        second, off the event loop)
  page_1000_ms / page_1000_tenant_ms / page_1000_from_cursor_ms   GET /v1/audit?limit=1000 over a
      trail of `--rows` rows (default 100,000): the first page, one tenant's first page, and a
      page from a cursor in the middle
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time

from atoll.controlplane import audit
from atoll.testing import FakeAtoll


def _ms(ns: int) -> float:
    return ns / 1e6


async def _exec_loop(client, sid: str, n: int) -> list[int]:
    out = []
    body = {"cmd": "true"}
    for _ in range(n):
        t0 = time.perf_counter_ns()
        r = await client.post(f"/v1/sandboxes/{sid}/exec", json=body)
        out.append(time.perf_counter_ns() - t0)
        assert r.status_code == 200, r.text
    return out


async def middleware_alone(n: int = 20000) -> float:
    """Microseconds the AuditMiddleware adds to one exec-shaped request around an app that only
    answers (mean over n, the bare app's own time taken off): the part the A/B loop cannot resolve."""
    from atoll.controlplane import auth

    principal = auth.Principal("ak-0000000000000001", "tenant", "tn-0000000000000001")

    class Route:
        path = "/v1/sandboxes/{sid}/exec"

    body = b'{"exit_code":0,"stdout":"","stderr":"","duration_ms":1}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def answer(scope, receive, send):
        scope["route"], scope["path_params"] = Route, {"sid": "sb-0000000000000001"}
        scope["state"]["principal"], scope["state"]["request_id"] = principal, "req_0123456789abcdef"
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def sink(message):
        pass

    class NoLog:
        def record(self, row):
            pass

    wrapped = audit.AuditMiddleware(answer, NoLog())  # type: ignore[arg-type]

    def scope():
        return {
            "type": "http",
            "method": "POST",
            "path": "/v1/sandboxes/sb-0000000000000001/exec",
            "client": ("127.0.0.1", 5000),
            "state": {},
        }

    async def loop(app) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            await app(scope(), None, sink)
        return (time.perf_counter_ns() - t0) / n / 1000

    await loop(wrapped)
    return round(await loop(wrapped) - await loop(answer), 2)


async def main(rows: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        plain = FakeAtoll(os.path.join(d, "plain"), tier_policy=False)
        plain.app.user_middleware = [
            m for m in plain.app.user_middleware if m.cls is not audit.AuditMiddleware
        ]
        audited = FakeAtoll(os.path.join(d, "audited"), tier_policy=False)
        async with plain, audited:
            sids = []
            for f in (plain, audited):
                r = await f.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})
                sids.append(r.json()["id"])
                await _exec_loop(f.http, sids[-1], 100)  # warm-up
            with_a: list[int] = []
            without: list[int] = []
            for _ in range(rounds):
                without += await _exec_loop(plain.http, sids[0], 200)
                with_a += await _exec_loop(audited.http, sids[1], 200)
            log = audited.app.state.audit
            await log.flush()
            with plain.manager.db.session() as s:  # the plain one really recorded nothing
                assert s.query(audit.AuditRecord).count() == 0
            with audited.manager.db.session() as s:
                assert s.query(audit.AuditRecord).count() >= len(with_a)
            now = dt.datetime.now(dt.UTC)
            batch = [
                (now, "ak-x", "tn-x", "sandbox.exec", "sb-x", 200, None, "req_x", "127.0.0.1")
                for _ in range(500)
            ]
            t0 = time.perf_counter_ns()
            log._write(batch)
            flush_ns = time.perf_counter_ns() - t0
            start = now - dt.timedelta(days=30)
            chunk = []
            for i in range(rows):
                at = start + dt.timedelta(seconds=i * 25)
                tenant = f"tn-{i % 50:016d}"
                chunk.append(
                    (at, "ak-x", tenant, "sandbox.create", f"sb-{i:016d}", 201, None, f"req_{i}", "10.0.0.1")
                )
                if len(chunk) == 5000:
                    log._write(chunk)
                    chunk = []
            if chunk:
                log._write(chunk)
            c = audited.http

            async def timed(params: dict) -> tuple[float, dict]:
                xs = []
                for _ in range(5):
                    t0 = time.perf_counter_ns()
                    r = await c.get("/v1/audit", params=params)
                    xs.append(time.perf_counter_ns() - t0)
                    assert r.status_code == 200, r.text
                return round(_ms(int(statistics.median(xs))), 2), r.json()

            page_ms, first = await timed({"limit": 1000})
            tenant_ms, _ = await timed({"limit": 1000, "tenant_id": "tn-0000000000000007"})
            mid = log.cursors.make(start + dt.timedelta(seconds=rows // 2 * 25), 0)
            cursor_ms, _ = await timed({"limit": 1000, "cursor": mid})
    med_with, med_without = statistics.median(with_a), statistics.median(without)
    return {
        "exec_with_audit_us": round(med_with / 1000, 1),
        "exec_without_audit_us": round(med_without / 1000, 1),
        "added_us": round((med_with - med_without) / 1000, 1),
        "n_each": len(with_a),
        "middleware_alone_us": await middleware_alone(),
        "flush_500_rows_ms": round(_ms(flush_ns), 2),
        "trail_rows": rows,
        "page_1000_ms": page_ms,
        "page_1000_tenant_ms": tenant_ms,
        "page_1000_from_cursor_ms": cursor_ms,
        "first_page_items": len(first["items"]),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    json.dump(asyncio.run(main(args.rows, args.rounds)), sys.stdout, indent=2)
    print()
