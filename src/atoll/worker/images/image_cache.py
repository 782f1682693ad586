"""Built-in templates' start-up snapshots shared by the installations of one host, for test suites
(ATOLL_TEST_IMAGE_CACHE): each test home would otherwise boot, gate and checkpoint `base` again
(~4-10 s of every `atoll up` start in atoll's own suite). Called by worker.images.builder
(`prepare_builtin`) when the worker's `image_cache` is set; nothing else reads it.

    <cache>/<build id>/<runtime key>/<memory>m/image/   the checkpoint and its manifest
    <cache>/<build id>/<runtime key>/<memory>m/upper/   the snapshot's writable layer
    <cache>/<build id>/<runtime key>/<memory>m/mode     its start mode

The key is exactly what keys the image inside a home (worker.images.builder): the build id (a
digest of the template's layer) and the runtime key (agent, runsc, flags, bundle:
worker.host.snapshots.RuntimeKey), so an entry is only ever used where the worker would restore
the image it made itself. Nothing in it is the installation's own: a template image's sandbox gets
the installation CA, its id and its env after the restore (worker.host.trust), as it does from an
image made in its own home.

No state is shared: an installation copies an entry into its home (`adopt`, the checkpoint's CRC
checked against its manifest first, so a damaged entry is dropped, never spread) and publishes a
copy of the image it made (`publish`: written under a temporary name and renamed into place in one
step, so readers see a whole entry or none; when two installations publish the same entry at once,
the second rename fails and its copy is dropped). A test that damages its home's image damages its
copy only. An entry is touched when it is used; `publish` keeps the KEEP most recently used entries
(a runtime key changes with every edit of the guest agent) and drops the others, renamed away
before they are removed so an installation copying one sees it gone, not half-gone (its copy then
fails and it makes its own image).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import subprocess
import time
import uuid

from atoll.worker.host import snapshots, storage

log = logging.getLogger(__name__)

KEEP = 6
"""Entries kept (the most recently used); older ones are removed when an entry is published."""
STALE_TMP_S = 3600.0
"""A temporary copy this old was left by a process that died while publishing: removed."""


def _entry(cache: str, build_id: str, runtime_key: str, memory_mb: int) -> str:
    return os.path.join(cache, build_id, runtime_key, f"{memory_mb}m")


def _complete(image_dir: str) -> bool:
    """The image's manifest is there and its checkpoint has the bytes and the checksum it names."""
    try:
        snap = snapshots.Snapshot(image_dir, snapshots._manifest(_read_json(image_dir)))
        digest, size = snapshots.checksum(snap.image, snap.manifest.algorithm)
    except (OSError, ValueError, TypeError):
        return False
    return size == snap.manifest.size and digest == snap.manifest.digest


def _read_json(image_dir: str) -> dict:
    with open(os.path.join(image_dir, "manifest.json")) as f:
        return json.load(f)


def _cp(src: str, dst: str) -> None:
    """`cp -a`: the writable layer holds overlay whiteouts (device nodes) and xattrs."""
    r = subprocess.run(["cp", "-a", "--", src, dst], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"cp -a {src} {dst}: {r.stderr.strip()[:300]}")


def _copy_set(src_image: str, src_upper: str, src_mode: str, image: str, upper: str, mode: str) -> None:
    """Copy an image, its writable layer and its mode."""
    _cp(src_image, image)
    if os.path.isdir(src_upper):
        _cp(src_upper, upper)
    else:
        os.makedirs(upper)
    try:
        shutil.copy2(src_mode, mode)
    except FileNotFoundError:
        with open(mode, "w"):
            pass


def adopt(cache: str, build_id: str, runtime_key: str, memory_mb: int, dest: str) -> bool:
    """Copy the cached image of (build, runtime key, size) to `dest` (the home's image directory,
    laid out as worker.images.builder keeps it: `dest/`, `dest.upper/`, `dest.mode`); False when
    there is none (or it is damaged, or went while it was copied): the caller makes its own."""
    entry = _entry(cache, build_id, runtime_key, memory_mb)
    if not os.path.exists(os.path.join(entry, "image", "manifest.json")):
        return False
    staged = f"{dest}.adopt-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        _copy_set(
            os.path.join(entry, "image"),
            os.path.join(entry, "upper"),
            os.path.join(entry, "mode"),
            staged,
            staged + ".upper",
            staged + ".mode",
        )
        if not _complete(staged):
            log.warning(
                "shared template image %s is damaged: removed; this installation makes its own", entry
            )
            _drop(entry)
            raise OSError("damaged")
        shutil.rmtree(dest + ".upper", ignore_errors=True)
        os.replace(staged + ".upper", dest + ".upper")
        os.replace(staged + ".mode", dest + ".mode")
        os.replace(staged, dest)  # last: the manifest appearing at `dest` is what makes it an image
    except OSError:
        for p in (staged, staged + ".upper"):
            shutil.rmtree(p, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged + ".mode")
        return False
    with contextlib.suppress(OSError):
        os.utime(entry)
    log.info("template image %s copied from the shared image cache %s", dest, cache)
    return True


def publish(cache: str, build_id: str, runtime_key: str, memory_mb: int, src: str) -> bool:
    """Put a copy of the home's image `src` (with `src.upper`, `src.mode`) into the cache unless
    the entry is there already; then keep the KEEP most recently used entries. True if added."""
    entry = _entry(cache, build_id, runtime_key, memory_mb)
    storage.private_dir(cache)
    added = False
    if not os.path.exists(entry):
        tmp = os.path.join(cache, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(tmp)
            _copy_set(
                src,
                src + ".upper",
                src + ".mode",
                os.path.join(tmp, "image"),
                os.path.join(tmp, "upper"),
                os.path.join(tmp, "mode"),
            )
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            os.rename(tmp, entry)  # fails if another installation published it meanwhile
            added = True
        except OSError as e:
            if not os.path.exists(entry):
                log.warning("template image %s not published to the shared image cache: %s", src, e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(cache)
    return added


def _drop(path: str) -> None:
    trash = os.path.join(os.path.dirname(path), f".trash-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _prune(cache: str) -> None:
    entries = glob.glob(os.path.join(cache, "*", "*", "*m"))

    def used(p: str) -> float:
        try:
            return os.stat(p).st_mtime
        except FileNotFoundError:
            return 0.0

    for old in sorted(entries, key=used, reverse=True)[KEEP:]:
        _drop(old)
    now = time.time()
    for leftover in glob.glob(os.path.join(cache, ".tmp-*")) + glob.glob(
        os.path.join(cache, "*", "*", ".trash-*")
    ):
        if now - used(leftover) > STALE_TMP_S:
            shutil.rmtree(leftover, ignore_errors=True)
    for d in glob.glob(os.path.join(cache, "*", "*")) + glob.glob(os.path.join(cache, "*")):
        with contextlib.suppress(OSError):
            os.rmdir(d)  # only when empty
