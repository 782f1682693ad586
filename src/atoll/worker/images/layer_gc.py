"""Garbage collection of the template layer cache (worker.images.layers): layers nothing uses go.

The template directory may be shared by several installations on the host (the test suite shares
one across parallel installations), and a worker sees only its own records. So a layer is removed
only when all of these hold:

- no build (`<home>/builds/<id>/build.json`, `layers`) and no runtime (`runtime.json`, `lower`) of
  this installation stacks it, and it is not the current built-in template's layer;
- no overlay mounted on the host stacks it: the `lowerdir=` option of every overlay in every mount
  namespace (`/proc/<pid>/mountinfo`, one per namespace), which names host paths — so another
  installation's running or checkpointed sandboxes keep their layers;
- it was last used (its `used` marker, touched when it is made and whenever a build, create or
  restore stacks it) longer than `ttl_s` ago (ATOLL_LAYER_CACHE_TTL_S, default 7 days) — which
  covers another installation's builds, whose records this worker cannot see, until they go unused
  that long. A layer without a marker (made by an earlier version) gets one at its first pass: its
  idle time starts then, never at its layer.json's date.

With a size cap (ATOLL_LAYER_CACHE_GB), layers that pass the first two rules and were not used in the
last CAP_MIN_IDLE_S go too, least recently used first, while the cache is over the cap. Each removal
happens under the key's lock with the last-use check made again there (LayerStore.remove), so a
build that just found the layer cached keeps it. Called by worker.service.node's garbage loop
(at start and every LAYER_GC_EVERY_S), which skips it while a template build runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import typing
from dataclasses import dataclass

from atoll.worker.images.layers import LayerStore

log = logging.getLogger(__name__)

LAYER_GC_EVERY_S = 3600.0
CAP_MIN_IDLE_S = 600.0
"""A size cap never removes a layer used more recently than this (a build may be stacking it)."""

_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(value: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), value)


def parse_mountinfo(text: str) -> set[str]:
    """The host paths in the `lowerdir=` option of every overlay mount in a mountinfo text."""
    out: set[str] = set()
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields = tail.split(" ")
        if len(fields) < 3 or fields[0] != "overlay":
            continue
        for opt in fields[2].split(","):
            if opt.startswith("lowerdir="):
                # a ':' inside a path is escaped as '\:'; octal escapes (\040) are the kernel's
                for part in re.split(r"(?<!\\):", opt[len("lowerdir=") :]):
                    if part:
                        out.add(_unescape(part.replace("\\:", ":")))
    return out


def mounted_lowers(proc: str = "/proc") -> set[str]:
    """Lower layers of every overlay mounted on this host: the mountinfo of one process per mount
    namespace (sandboxes' runsc processes live in namespaces of their own). Blocking."""
    seen: set[str] = set()
    out = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            ns = os.readlink(f"{proc}/{pid}/ns/mnt")
            if ns in seen:
                continue
            with open(f"{proc}/{pid}/mountinfo") as f:
                text = f.read()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        seen.add(ns)
        out |= parse_mountinfo(text)
    return out


@dataclass(frozen=True)
class Removed:
    key: str
    size_bytes: int
    idle_s: float
    why: str  # "ttl" | "cap"


def _real(paths: typing.Iterable[str]) -> set[str]:
    return {os.path.realpath(p) for p in paths if p}


async def collect(
    store: LayerStore,
    referenced: typing.Iterable[str],
    keep_keys: typing.Iterable[str],
    *,
    ttl_s: float,
    cap_bytes: int = 0,
    mounted: typing.Callable[[], set[str]] = mounted_lowers,
    now: typing.Callable[[], float] = time.time,
) -> list[Removed]:
    """One pass (see the module doc): `referenced` are the host paths this installation's builds
    and runtimes stack, `keep_keys` the current built-in layers' keys. Returns what was removed."""
    debris = await asyncio.to_thread(store.sweep_debris)
    for path in debris:
        log.info("layer cache: removed %s (left by a process that stopped)", path)
    in_use = _real(referenced)
    keep = set(keep_keys)

    def held(key: str, live_mounts: set[str]) -> bool:
        fs = os.path.realpath(store.path(key))
        return key in keep or fs in in_use or fs in live_mounts

    live = _real(await asyncio.to_thread(mounted))
    candidates = [k for k in store.keys() if not held(k, live)]

    def idle(key: str) -> float:
        used = store.last_used(key)
        return float("inf") if used is None else now() - used

    removed: list[Removed] = []

    async def drop(key: str, min_idle: float, why: str) -> int:
        """Remove the layer if it may still go under its lock; the bytes freed (0: kept)."""
        size, age = store.size(key), idle(key)

        def may_go() -> bool:  # again, under the key's lock: a use or a mount may have come since
            return idle(key) > min_idle and not held(key, _real(mounted()))

        if not await asyncio.to_thread(store.remove, key, may_go):
            return 0
        removed.append(Removed(key, size, round(age), why))
        return size

    for key in candidates:
        if idle(key) > ttl_s:
            await drop(key, ttl_s, "ttl")
    if cap_bytes:
        gone = {r.key for r in removed}
        total = sum(store.size(k) for k in store.keys())
        for key in sorted((k for k in candidates if k not in gone), key=idle, reverse=True):
            if total <= cap_bytes or idle(key) <= CAP_MIN_IDLE_S:
                break  # under the cap, or the rest were used more recently still
            total -= await drop(key, CAP_MIN_IDLE_S, "cap")
    for r in removed:
        log.info(
            "layer cache: removed layer %s (%d bytes, unused for %.0f s, %s)",
            r.key,
            r.size_bytes,
            r.idle_s,
            "past ATOLL_LAYER_CACHE_TTL_S" if r.why == "ttl" else "over ATOLL_LAYER_CACHE_GB",
        )
    return removed
