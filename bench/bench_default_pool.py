"""The default `base` pool (ATOLL_DEFAULT_POOL): a default create and its first exec with a pool
to claim from against the same create restoring `base`'s snapshot, side by side in one run.

Run standalone (`.venv/bin/python bench/bench_default_pool.py [--n 10]`, root; starts its own
`atoll up`) or from bench/run_all.py (section `default_pool`), which calls `run(atoll)`. The atoll
it is given must keep no `base` pool (atoll.testing's ATOLL_DEFAULT_POOL=0); it starts a second
`atoll up` over the same template cache with ATOLL_DEFAULT_POOL=2 (what a fresh installation
keeps), waits until that pool is full, and then, alternately on each, times:

  create            POST /v1/sandboxes {} sent → 201 received (no template, the default memory size)
  first_exec        then POST …/exec {"cmd": ["python3", "-c", "pass"]} → 200 received
  total             the two together: what an agent waits for before its first command has run

Between rounds both sandboxes are deleted and the pool is left to refill (ready = 2, then 0.5 s of
quiet), so every pooled create claims from a full pool and no refill competes with the timed calls.
Each pooled create is checked against the pool's `claimed` count, each unpooled one against the
worker's log ("by template image"). Prints one JSON document. Traffic goes only to loopback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as c  # noqa: E402

FIRST = ["python3", "-c", "pass"]


def _pool(a: c.Atoll) -> dict:
    return a.api.get("/v1/templates/base/pool").json()


def _wait_full(a: c.Atoll, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while (p := _pool(a))["ready"] < p["desired"] or p["starting"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the base pool did not fill within {timeout} s: {p}")
        time.sleep(0.1)
    time.sleep(0.5)


def _one(a: c.Atoll) -> tuple[dict, float, float]:
    with c.Timer() as t_create:
        sb = a.create()
    with c.Timer() as t_exec:
        r = a.exec(sb["id"], FIRST)
    if r["exit_code"] != 0:
        raise RuntimeError(f"first exec failed: {r}")
    return sb, t_create.ms, t_exec.ms


def run(plain: c.Atoll, n: int = 10) -> dict:
    """`plain`: an atoll without a `base` pool, warmed up (common.warm_up)."""
    if _pool(plain)["desired"]:
        raise RuntimeError(f"the atoll to restore on keeps a base pool: {_pool(plain)}")
    samples: dict[str, dict[str, list[float]]] = {
        k: {"create": [], "first_exec": [], "total": []} for k in ("pool", "restore")
    }
    with c.local_atoll(env={"ATOLL_DEFAULT_POOL": "2"}) as pooled:
        pooled.wait_template_image()
        _wait_full(pooled)
        for i in range(n):
            for key, a in (
                (("pool", pooled), ("restore", plain))
                if i % 2 == 0
                else (
                    ("restore", plain),
                    ("pool", pooled),
                )
            ):
                claimed = _pool(a)["claimed"]
                sb, create_ms, exec_ms = _one(a)
                if key == "pool" and _pool(a)["claimed"] != claimed + 1:
                    raise RuntimeError(f"a default create did not claim from the pool: {_pool(a)}")
                if key == "restore":
                    how = [r["how"] for r in a.runtime_starts(sb["id"])]
                    if how != ["template image"]:
                        raise RuntimeError(f"an unpooled create was made by {how}")
                samples[key]["create"].append(create_ms)
                samples[key]["first_exec"].append(exec_ms)
                samples[key]["total"].append(create_ms + exec_ms)
                a.delete(sb["id"])
            _wait_full(pooled)
    out: dict = {k: {part: c.summarize(xs) for part, xs in parts.items()} for k, parts in samples.items()}
    out["ratio_total_p50_pool_over_restore"] = c.ratio(out["pool"]["total"], out["restore"]["total"])
    out["method"] = __doc__.split("\n\n")[1].strip() if __doc__ else ""
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else "")
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
    c.run_main(lambda a: run(a, args.n), "default_pool")


if __name__ == "__main__":
    main()
