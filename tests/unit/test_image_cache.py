"""worker.images.image_cache on files in a temporary directory: an image published by one home is
copied (never linked) into another, checked against its manifest's CRC first (a damaged entry is
dropped, not spread); two installations publishing one entry at once leave one whole entry; only
the KEEP most recently used entries stay."""

from __future__ import annotations

import json
import os
import threading

from atoll.worker.host import snapshots
from atoll.worker.images import image_cache

MIB = 1 << 20


def _image(home, bid="base-0123456789abcdef", key="fedcba9876543210", size=512) -> str:
    """An image laid out as worker.images.builder keeps it: `<N>m/`, `<N>m.upper/`, `<N>m.mode`."""
    dest = os.path.join(home, "builds", bid, "images", key, f"{size}m")
    os.makedirs(dest)
    img = os.path.join(dest, "checkpoint.img")
    with open(img, "wb") as f:
        f.write(os.urandom(MIB))
    digest, n = snapshots.checksum(img)
    man = snapshots.Manifest("sb-x", 1, "checkpoint.img", n, digest, snapshots.RUNSC_VERSION, 0.0)
    with open(os.path.join(dest, "manifest.json"), "w") as f:
        json.dump(man.__dict__, f)
    os.makedirs(os.path.join(dest + ".upper", "etc"))
    with open(os.path.join(dest + ".upper", "etc", "hostname"), "w") as f:
        f.write("sbx\n")
    with open(dest + ".mode", "w") as f:
        f.write("")
    return dest


def _dest(home, bid="base-0123456789abcdef", key="fedcba9876543210", size=512) -> str:
    return os.path.join(home, "builds", bid, "images", key, f"{size}m")


def test_an_image_one_home_published_is_copied_into_another(tmp_path):
    cache = str(tmp_path / "cache")
    src = _image(tmp_path / "a")
    assert image_cache.publish(cache, "base-0123456789abcdef", "fedcba9876543210", 512, src)
    assert not image_cache.publish(cache, "base-0123456789abcdef", "fedcba9876543210", 512, src)  # there
    dest = _dest(tmp_path / "b")
    assert image_cache.adopt(cache, "base-0123456789abcdef", "fedcba9876543210", 512, dest)
    for rel in ("checkpoint.img", "manifest.json"):
        a, b = os.path.join(src, rel), os.path.join(dest, rel)
        assert open(a, "rb").read() == open(b, "rb").read()
        assert os.stat(a).st_ino != os.stat(b).st_ino  # a copy: a test damaging it damages its own
    assert open(os.path.join(dest + ".upper", "etc", "hostname")).read() == "sbx\n"
    assert os.path.exists(dest + ".mode")
    # another size, runtime key or build is not there
    assert not image_cache.adopt(
        cache, "base-0123456789abcdef", "fedcba9876543210", 256, _dest(tmp_path / "c")
    )
    assert not image_cache.adopt(
        cache, "base-0123456789abcdef", "0000000000000000", 512, _dest(tmp_path / "c")
    )
    assert not os.path.exists(
        tmp_path / "c" / "builds" / "base-0123456789abcdef" / "images" / "0000000000000000" / "512m"
    )


def test_a_damaged_entry_is_dropped_and_not_copied(tmp_path):
    cache = str(tmp_path / "cache")
    image_cache.publish(cache, "base-0123456789abcdef", "fedcba9876543210", 512, _image(tmp_path / "a"))
    entry = os.path.join(cache, "base-0123456789abcdef", "fedcba9876543210", "512m")
    with open(os.path.join(entry, "image", "checkpoint.img"), "r+b") as f:
        f.write(b"\0" * 4096)
    dest = _dest(tmp_path / "b")
    assert not image_cache.adopt(cache, "base-0123456789abcdef", "fedcba9876543210", 512, dest)
    assert not os.path.exists(dest) and not os.path.exists(entry)
    assert os.listdir(os.path.dirname(dest)) == []  # no half-copied leftovers in the home


def test_concurrent_publishers_leave_one_whole_entry(tmp_path):
    cache = str(tmp_path / "cache")
    sources = [_image(tmp_path / f"h{i}") for i in range(4)]
    results: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda s=s: results.append(
                image_cache.publish(cache, "base-0123456789abcdef", "fedcba9876543210", 512, s)
            )
        )
        for s in sources
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1
    assert not [n for n in os.listdir(cache) if n.startswith(".tmp-")]
    assert image_cache.adopt(cache, "base-0123456789abcdef", "fedcba9876543210", 512, _dest(tmp_path / "b"))


def test_only_the_most_recently_used_entries_are_kept(tmp_path):
    cache = str(tmp_path / "cache")
    bid = "base-0123456789abcdef"
    keys = [f"{i:016x}" for i in range(image_cache.KEEP + 2)]
    for n, key in enumerate(keys[: image_cache.KEEP]):
        image_cache.publish(cache, bid, key, 512, _image(tmp_path / f"h{n}", key=key))
        os.utime(os.path.join(cache, bid, key, "512m"), (1000.0 + n, 1000.0 + n))
    # the oldest is used again: it stays, and the next two oldest go when two more come
    assert image_cache.adopt(cache, bid, keys[0], 512, _dest(tmp_path / "u", key=keys[0]))
    for n, key in enumerate(keys[image_cache.KEEP :]):
        image_cache.publish(cache, bid, key, 512, _image(tmp_path / f"new{n}", key=key))
    kept = sorted(os.listdir(os.path.join(cache, bid)))
    assert kept == sorted([keys[0], *keys[3:]]), kept
