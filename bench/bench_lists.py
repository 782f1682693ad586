"""Benchmark: `GET /v1/sandboxes` with 10,000 sandbox records — one page, the way lists scale.

Run standalone (`.venv/bin/python bench/bench_lists.py [--records 1000,10000] [--quick] [--no-save]`;
no root, no runsc): the real control plane (FastAPI app, SQLite in a temp dir, lifecycle, paging) of
`atoll.testing.FakeAtoll` served by uvicorn on 127.0.0.1, with N sandbox records written straight
to its database — 90% running, 10% in the disk tier, a third labelled team=a — once per N (default
1,000 and 10,000: a page must cost the same whatever the total; `ratio_largest_to_smallest`).
Prints one JSON document to stdout (also bench/results/lists.json unless --no-save or --quick);
progress on stderr. `--database postgresql` keeps the records in a private PostgreSQL instead
(atoll.testing.postgres, loopback TCP; lists-postgresql.json), `--database both` measures SQLite
and PostgreSQL one after the other in the same run with their ratios (lists-databases.json).

Measured (wall clock on the caller's side, kept-alive httpx client on loopback; n=30 after 3
warm-ups, the page cases interleaved per round, `gc.collect()` untimed between rounds):
  first_page_1000   GET /v1/sandboxes (the default limit, 1000 items) → 200, body read (~1 MB;
                    parsing it on the caller's side is not timed)
  page_100          GET /v1/sandboxes?limit=100
  deep_page_1000    the 9th page of 1000 (its cursor from an untimed walk): keyset, not OFFSET
  filtered_state    GET /v1/sandboxes?state=standby&tier=disk (1,000 of them, one page)
  filtered_metadata GET /v1/sandboxes?metadata.team=a&limit=100 (JSON filter in the database)
  walk_all          every page one after another (what the SDK's list() does), total time (n=10,
                    in a loop of its own after the page cases, with the next one)
  unpaged_in_process  for comparison: SandboxManager.list() of every record plus the view of each,
                    in process (what GET /v1/sandboxes did before paging, minus HTTP)
The promise (docs/specification.md): a page of GET /v1/sandboxes with 10,000 records in ≤ 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import socket
import sys
import tempfile

import httpx
import uvicorn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

from atoll.controlplane import db as dbm  # noqa: E402
from atoll.controlplane.routes_sandboxes import view  # noqa: E402
from atoll.core import ids  # noqa: E402
from atoll.testing import FakeAtoll  # noqa: E402

KEY = "bench-lists-key"
_CASES = ("first_page_1000", "page_100", "deep_page_1000", "filtered_state", "filtered_metadata", "walk_all")


def insert(fake: FakeAtoll, n: int) -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    recs = []
    for i in range(n):
        standby = i % 10 == 9
        recs.append(
            dbm.SandboxRecord(
                id=ids.new_sandbox_id(),
                tenant_id=ids.DEFAULT_TENANT,
                worker_id="w-bench",
                state="standby" if standby else "running",
                standby_tier="disk" if standby else None,
                template="base",
                metadata_={"team": "a" if i % 3 == 0 else "b", "n": str(i)},
                env={},
                memory_mb=256,
                cpus=1.0,
                disk_mb=1024,
                idle_timeout_s=300,
                disk_after_s=600,
                created_at=t0 + dt.timedelta(milliseconds=i),
            )
        )
    with fake.manager.db.session.begin() as s:
        s.add_all(recs)


async def timed(client: httpx.AsyncClient, path: str, params: dict | None = None) -> tuple[float, dict]:
    with c.Timer() as t:
        r = await client.get(
            path, params=params
        )  # the body is read whole; parsing it is the caller's, untimed
    assert r.status_code == 200, r.text
    return t.ms, r.json()


async def measure(records: int, rounds: int, database_url: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(dir=c.BENCH_TMP) as tmp:
        async with FakeAtoll(tmp, api_key=KEY, tier_policy=False, database_url=database_url) as fake:
            with c.Timer() as t_ins:
                insert(fake, records)
            c.log(f"{records} records written in {t_ins.ms:.0f} ms")
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
            serving = asyncio.ensure_future(server.serve(sockets=[sock]))
            try:
                while not server.started:
                    await asyncio.sleep(0.01)
                return await _rounds(fake, f"http://127.0.0.1:{port}", records, rounds)
            finally:
                server.should_exit = True
                await serving
                sock.close()


async def _rounds(fake: FakeAtoll, url: str, records: int, rounds: int) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        # the cursor of the 9th page of 1000 (or the last one there is)
        cursor, pages, seen = None, 0, 0
        while True:
            _, body = await timed(client, "/v1/sandboxes", {"cursor": cursor} if cursor else None)
            seen += len(body["items"])
            pages += 1
            if body["next_cursor"] is None or pages == 8:
                deep = body["next_cursor"]
                break
            cursor = body["next_cursor"]
        cases = {
            "first_page_1000": ("/v1/sandboxes", None),
            "page_100": ("/v1/sandboxes", {"limit": "100"}),
            "deep_page_1000": ("/v1/sandboxes", {"cursor": deep} if deep else None),
            "filtered_state": ("/v1/sandboxes", {"state": "standby", "tier": "disk"}),
            "filtered_metadata": ("/v1/sandboxes", {"metadata.team": "a", "limit": "100"}),
        }
        samples: dict[str, list[float]] = {k: [] for k in cases}
        items: dict[str, int] = {}
        for rnd in range(rounds + 3):
            gc.collect()  # untimed: the garbage of the previous round is not charged to the next case
            for name, (path, params) in cases.items():
                ms, body = await timed(client, path, params)
                items[name] = len(body["items"])
                if rnd >= 3:
                    samples[name].append(ms)
        # the whole list, paged and (for comparison) unpaged in process: after the page cases, so
        # that their large garbage does not land in the small requests' samples
        walk: list[float] = []
        unpaged: list[float] = []
        for rnd in range(max(3, rounds // 3) + 1):
            gc.collect()
            with c.Timer() as t:
                total, cursor = 0, None
                while True:
                    _, body = await timed(client, "/v1/sandboxes", {"cursor": cursor} if cursor else None)
                    total += len(body["items"])
                    cursor = body["next_cursor"]
                    if cursor is None:
                        break
            assert total == records, total
            gc.collect()
            with c.Timer() as u:
                recs = fake.manager.list(None, {})
                json.dumps([view_of(fake, r) for r in recs])
            if rnd >= 1:
                walk.append(t.ms)
                unpaged.append(u.ms)
    out = {
        name: {**c.summarize(xs, keep_samples=False), "items": items[name]} for name, xs in samples.items()
    }
    out["walk_all"] = {**c.summarize(walk, keep_samples=False), "items": records}
    out["unpaged_in_process"] = {**c.summarize(unpaged, keep_samples=False), "items": records}
    out["records"] = records
    out["promise_ms"] = 50
    out["first_page_within_promise"] = out["first_page_1000"]["p50"] <= 50
    return out


class _Req:
    """What routes_sandboxes.view reads of a request: the app (for its context)."""

    def __init__(self, app) -> None:
        self.app = app


def view_of(fake: FakeAtoll, rec) -> dict:
    return view(_Req(fake.app), rec)  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--records", default="1000,10000", help="comma-separated record counts, each its own installation"
    )
    ap.add_argument("--quick", action="store_true", help="1,000 records, 3 rounds (smoke test, never saved)")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/lists.json")
    ap.add_argument(
        "--database",
        choices=("sqlite", "postgresql", "both"),
        default="sqlite",
        help="where the records are: SQLite (default), a private PostgreSQL (atoll.testing.postgres), "
        "or both side by side (saved as lists-databases.json, with ratio_postgresql_to_sqlite)",
    )
    args = ap.parse_args()
    sizes, rounds = ([1000], 3) if args.quick else ([int(n) for n in args.records.split(",")], 30)
    machine = c.machine_info()
    kinds = ("sqlite", "postgresql") if args.database == "both" else (args.database,)
    by_kind: dict = {}
    pg = None
    try:
        if "postgresql" in kinds:
            from atoll.testing import postgres

            pg = postgres.PostgresCluster().start()
        for kind in kinds:
            res: dict = {}
            for n in sizes:
                c.log(f"{n} records ({kind})")
                url = pg.create_database(f"lists_{n}") if kind == "postgresql" and pg is not None else None
                res[str(n)] = asyncio.run(measure(n, rounds, url))
            if len(sizes) > 1:  # the same page read from the smallest and the largest installation
                lo, hi = res[str(min(sizes))], res[str(max(sizes))]
                res["ratio_largest_to_smallest"] = {
                    k: c.ratio(hi[k], lo[k]) for k in ("first_page_1000", "page_100", "filtered_metadata")
                }
            by_kind[kind] = res
    finally:
        if pg is not None:
            pg.stop()
    if len(kinds) == 1:
        res = by_kind[kinds[0]]
    else:
        res = dict(by_kind)
        res["ratio_postgresql_to_sqlite"] = {
            str(n): {
                k: c.ratio(by_kind["postgresql"][str(n)][k], by_kind["sqlite"][str(n)][k]) for k in _CASES
            }
            for n in sizes
        }
    doc = {
        "benchmark": "lists",
        "timestamp": c.timestamp(),
        "machine": machine,
        "results": res,
        "quick": args.quick,
        "database": args.database,
    }
    c.emit(doc)
    if not args.no_save and not args.quick:
        os.makedirs(c.RESULTS, exist_ok=True)
        name = {"sqlite": "lists.json", "postgresql": "lists-postgresql.json"}.get(
            args.database, "lists-databases.json"
        )
        with open(os.path.join(c.RESULTS, name), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
