"""The template layer cache's garbage collection (worker.images.layer_gc) on real files and real
flocks in a private template directory: a layer goes only when no record of this installation
stacks it, no overlay on the host does, it is not the current built-in layer, and it went unused
past the TTL (or, over a size cap, least recently used first); a layer whose lock is held, or that
was used meanwhile, stays; what a crash left is cleaned; overlay lower dirs are read from mountinfo."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import time

import pytest

from atoll.worker.images import layer_gc, layers

DAY = 86400.0


def _layer(
    store: layers.LayerStore, key: str, *, age_s: float = 0.0, size: int = 10, used: bool = True
) -> str:
    """A complete layer `key`, last used `age_s` ago (its `used` marker); without the marker
    (`used=False`, an earlier version's layer) made `age_s` ago."""
    d = os.path.join(store.dir, key)
    os.makedirs(os.path.join(d, "fs", "etc"))
    with open(os.path.join(d, "fs", "etc", "os-release"), "w") as f:
        f.write(key)
    with open(os.path.join(d, "layer.json"), "w") as f:
        json.dump({"key": key, "what": "test", "size_bytes": size, "made_at": time.time()}, f)
    when = time.time() - age_s
    marker = os.path.join(d, layers.USED if used else "layer.json")
    if used:
        open(marker, "w").close()
    os.utime(marker, (when, when))
    if used:
        os.utime(os.path.join(d, "layer.json"), (when - DAY, when - DAY))
    return store.path(key)


def _nothing_mounted() -> set[str]:
    return set()


async def test_only_unreferenced_unmounted_idle_non_builtin_layers_go(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    _layer(store, "old", age_s=8 * DAY)
    _layer(store, "older", age_s=9 * DAY)
    _layer(store, "earlier-version", age_s=300 * DAY, used=False)  # never marked: its clock starts now
    referenced = _layer(store, "referenced", age_s=30 * DAY)
    _layer(store, "base-0123456789abcdef", age_s=30 * DAY)
    _layer(store, "recent", age_s=6 * DAY)
    _layer(store, "recently-used", age_s=1 * DAY)  # its layer.json is 2 days old
    mounted = _layer(store, "mounted", age_s=30 * DAY)
    removed = await layer_gc.collect(
        store,
        [referenced, "/elsewhere/not/a/layer"],
        {"base-0123456789abcdef"},
        ttl_s=7 * DAY,
        mounted=lambda: {mounted},
    )
    assert sorted(r.key for r in removed) == ["old", "older"]
    assert all(r.why == "ttl" and r.idle_s >= 8 * DAY - 5 and r.size_bytes == 10 for r in removed)
    assert store.keys() == [
        "base-0123456789abcdef",
        "earlier-version",
        "mounted",
        "recent",
        "recently-used",
        "referenced",
    ]
    assert time.time() - (store.last_used("earlier-version") or 0) < 60
    assert [n for n in os.listdir(store.dir) if n.startswith(layers.TRASH)] == []


async def test_a_layer_used_or_locked_meanwhile_stays(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    _layer(store, "cached-step", age_s=30 * DAY)
    assert await store.use("cached-step")  # a build found it cached: its use is marked
    assert not await store.use("never-made")
    _layer(store, "being-used", age_s=30 * DAY)
    holder = os.open(os.path.join(store.dir, ".lock-being-used"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)  # another installation's `use` or `making` holds it
        removed = await layer_gc.collect(store, [], set(), ttl_s=7 * DAY, mounted=_nothing_mounted)
    finally:
        os.close(holder)
    assert removed == []
    assert store.keys() == ["being-used", "cached-step"]
    # the check is made again under the lock: a mount that appears after the listing keeps it
    calls = []

    def mounted_later() -> set[str]:
        calls.append(1)
        return set() if len(calls) == 1 else {store.path("being-used")}

    assert await layer_gc.collect(store, [], set(), ttl_s=7 * DAY, mounted=mounted_later) == []
    assert "being-used" in store.keys() and len(calls) == 2
    assert [
        r.key for r in await layer_gc.collect(store, [], set(), ttl_s=7 * DAY, mounted=_nothing_mounted)
    ] == ["being-used"]


async def test_use_waits_for_a_make_in_progress_and_marks_the_layer(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    holder = os.open(os.path.join(store.dir, ".lock-being-made"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another installation is making it
    try:
        use = asyncio.ensure_future(store.use("being-made"))
        await asyncio.sleep(0.2)
        assert not use.done()
        _layer(store, "being-made", age_s=30 * DAY)
    finally:
        os.close(holder)
    assert await asyncio.wait_for(use, 10)
    assert time.time() - (store.last_used("being-made") or 0) < 60


def test_mark_used_touches_each_cached_layer_of_a_stack(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    a = _layer(store, "a", age_s=30 * DAY)
    b = _layer(store, "b", age_s=30 * DAY)
    legacy = tmp_path / "templates" / "0123" / "rootfs"  # an older version's layout: not the cache's
    legacy.mkdir(parents=True)
    layers.mark_used(f"{a}:{legacy}:{b}")
    for key in ("a", "b"):
        assert time.time() - (store.last_used(key) or 0) < 60
    assert not (legacy.parent / layers.USED).exists()


async def test_size_cap_removes_least_recently_used_first_never_a_fresh_one(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    _layer(store, "oldest", age_s=3 * DAY, size=400)
    _layer(store, "older", age_s=2 * DAY, size=400)
    _layer(store, "old", age_s=1 * DAY, size=400)
    _layer(store, "fresh", age_s=60, size=4000)
    removed = await layer_gc.collect(
        store, [], set(), ttl_s=7 * DAY, cap_bytes=4500, mounted=_nothing_mounted
    )
    assert [(r.key, r.why) for r in removed] == [("oldest", "cap"), ("older", "cap")]
    assert store.keys() == ["fresh", "old"]
    # over the cap with only a fresh layer left: it stays
    assert await layer_gc.collect(store, [], set(), ttl_s=7 * DAY, cap_bytes=1, mounted=_nothing_mounted) == [
        layer_gc.Removed("old", 400, round(DAY), "cap")
    ]
    assert store.keys() == ["fresh"]


async def test_debris_of_a_crash_is_removed_unless_a_make_holds_its_key(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    for name in (
        ".trash-gone-1-2",
        ".tmp-base-0123-999999",
        ".tmp-step-abc-999998",
        ".fetch-old",
        ".fetch-new",
    ):
        os.makedirs(os.path.join(store.dir, name, "fs"))
    os.utime(os.path.join(store.dir, ".fetch-old"), (time.time() - 2 * DAY,) * 2)
    holder = os.open(os.path.join(store.dir, ".lock-step-abc"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # a make of step-abc is in progress
        await layer_gc.collect(store, [], set(), ttl_s=7 * DAY, mounted=_nothing_mounted)
    finally:
        os.close(holder)
    assert sorted(n for n in os.listdir(store.dir) if not n.startswith(".lock-")) == [
        ".fetch-new",  # a download under way
        ".tmp-step-abc-999998",
    ]


def test_mountinfo_lower_dirs_are_parsed_with_escapes():
    sample = (
        "36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
        "512 28 0:61 / /home/atoll/sandboxes/sb-x/rootfs rw,relatime shared:300 - overlay overlay "
        "rw,lowerdir=/t/layers/k2/fs:/t/layers/base-1/fs:/t/with\\040space/fs:/t/with\\:colon/fs,"
        "upperdir=/home/atoll/sandboxes/sb-x/upper/upper,workdir=/home/atoll/sandboxes/sb-x/upper/work\n"
        "garbage line\n"
    )
    assert layer_gc.parse_mountinfo(sample) == {
        "/t/layers/k2/fs",
        "/t/layers/base-1/fs",
        "/t/with space/fs",
        "/t/with:colon/fs",
    }


def test_a_real_overlay_keeps_its_lower_layer(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    lower = _layer(store, "stacked", age_s=30 * DAY)
    assert lower not in layer_gc.mounted_lowers()  # nothing of this new cache is mounted
    upper, work, merged = (tmp_path / n for n in ("upper", "work", "merged"))
    for p in (upper, work, merged):
        p.mkdir()
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"no overlay mount here: {r.stderr.decode().strip()}")
    try:
        assert lower in layer_gc.mounted_lowers()
        assert asyncio.run(layer_gc.collect(store, [], set(), ttl_s=7 * DAY)) == []
        assert store.keys() == ["stacked"]
    finally:
        subprocess.run(["umount", str(merged)], check=True)
    # gone from this namespace (a sandbox started meanwhile by another test may hold a private copy
    # of the mount table that still names it: mounted_lowers rightly counts those too)
    with open("/proc/self/mountinfo") as f:
        assert str(merged) not in f.read()


def test_layer_cache_settings(tmp_path):
    from atoll.core import config
    from atoll.worker.service import settings

    home = {"ATOLL_HOME": str(tmp_path)}
    w = settings.load(home)
    assert (w.layer_cache_ttl_s, w.layer_cache_gb) == (7 * DAY, None)
    w = settings.load({**home, "ATOLL_LAYER_CACHE_TTL_S": "3600", "ATOLL_LAYER_CACHE_GB": "20"})
    assert (w.layer_cache_ttl_s, w.layer_cache_gb) == (3600, 20)
    for name, bad in (("ATOLL_LAYER_CACHE_TTL_S", "-1"), ("ATOLL_LAYER_CACHE_GB", "lots")):
        with pytest.raises(config.SettingsError, match=name):
            settings.load({**home, name: bad})
