"""Template layers in the object store: a sandbox archived on one worker comes back on another
that never built its template, on the very same bytes.

A layer (worker.images.layers, `<template_dir>/layers/<key>/fs`) is named by the content key of
the step that made it, but two workers that each ran the step hold different bytes under one key
(mmdebstrap and package installs are not byte-identical, and a restored sandbox's mapped files
must match what its memory saw). So every layer also has an *instance*: a random id in its
layer.json, given when it is made or first published. A stack is pinned as `[{key, instance}]`.

In the store a layer instance is two objects:
    layers/<key>/<instance>.tar.zst   GNU tar of its fs dir (numeric owners, xattrs such as the
                                      overlay's opaque marks, whiteout devices), zstd-compressed
    layers/<key>/<instance>.json      {sha256, size, ...} of that object — written last, so a
                                      layer exists in the store only once it is whole
`publish` uploads the instances a stack is missing (worker.runtimes.archiving, before an archive,
when the store can be shared; worker.images.buildpack, when a template build is ready). `fetch`
(worker.service.node's `adopt`, worker.images.buildpack) gives the local path of an instance: the
local layer when its instance matches, else the published one — downloaded, checked against its
sha256 (and the one the caller's ref pins, if any) and unpacked under the local key
`<key>@<instance>`. A separately built layer of the same key is never used in its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid

import zstandard

from atoll.worker.host import objectstore
from atoll.worker.images import layers as layers_mod
from atoll.worker.images.layers import LayerStore

log = logging.getLogger(__name__)

ZSTD_LEVEL = 3
CHUNK = 4 * 1024 * 1024
_KEY = re.compile(r"[A-Za-z0-9._-]{1,128}")
_INSTANCE = re.compile(r"[0-9a-f]{32}")
TAR_FLAGS = ("--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls", "--sparse")


class LayerUnavailable(Exception):
    """A pinned layer instance is neither here nor (whole, intact) in the store."""


def object_key(key: str, instance: str) -> str:
    return f"layers/{key}/{instance}.tar.zst"


def manifest_key(key: str, instance: str) -> str:
    return f"layers/{key}/{instance}.json"


def check_ref(ref: dict) -> tuple[str, str]:
    key, instance = str(ref.get("key", "")), str(ref.get("instance", ""))
    if not _KEY.fullmatch(key) or not _INSTANCE.fullmatch(instance):
        raise LayerUnavailable(f"malformed layer reference {ref!r}")
    return key, instance


# ---- this worker's layers -------------------------------------------------------------------------


def instance_of(layer_dir: str) -> str:
    """The instance id of the layer in `layer_dir` (`<layers>/<key>`): its layer.json's, or for a
    layer made before instances the one in its `instance` file, made now if missing (O_EXCL: two
    installations sharing the directory agree on the first)."""
    with open(os.path.join(layer_dir, "layer.json")) as f:
        inst = json.load(f).get("instance")
    if isinstance(inst, str) and _INSTANCE.fullmatch(inst):
        return inst
    side = os.path.join(layer_dir, "instance")
    with contextlib.suppress(FileExistsError):
        fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, uuid.uuid4().hex.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    for _ in range(50):
        with open(side) as f:
            inst = f.read().strip()
        if _INSTANCE.fullmatch(inst):
            return inst
        time.sleep(0.01)  # being written by its maker
    raise OSError(f"the instance file {side} is malformed")


def refs_of(lower: str) -> list[dict] | None:
    """The `[{key, instance}]` of a lowerdir stack (top first), or None when one of its entries is
    not a layer of a layer store (a root file system of an older version)."""
    out = []
    for path in lower.split(":"):
        if not path:
            continue
        fs = os.path.normpath(path)
        if os.path.basename(fs) != "fs":
            return None
        layer_dir = os.path.dirname(fs)
        key = os.path.basename(layer_dir).split("@", 1)[0]  # a fetched layer: `<key>@<instance>`
        if not _KEY.fullmatch(key) or not os.path.isfile(os.path.join(layer_dir, "layer.json")):
            return None
        out.append({"key": key, "instance": instance_of(layer_dir), "path": fs})
    return out


# ---- packing --------------------------------------------------------------------------------------


def pack_tree(fs: str, out: str, members: tuple[str, ...] = (".",)) -> tuple[str, int, int]:
    """tar | zstd of `members` of the directory `fs` into `out` (fsync'd): (sha256, size of the
    object, bytes before compression). Blocking. Layers, and named snapshots' kept directories
    (worker.runtimes.snapstore): trees with owners, xattrs and whiteout devices."""
    h = hashlib.sha256()
    raw = 0
    proc = subprocess.Popen(
        ["tar", *TAR_FLAGS, "-C", fs, "-cf", "-", *members],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        with open(out, "wb") as f:
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
            with cctx.stream_writer(f, closefd=False) as z:
                while chunk := proc.stdout.read(CHUNK):
                    raw += len(chunk)
                    z.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        err = proc.stderr.read().decode(errors="replace")
    finally:
        rc = proc.wait()
    if rc != 0:
        raise OSError(f"tar of layer {fs} failed ({rc}): {err.strip()[:500]}")
    with open(out, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest(), os.path.getsize(out), raw


def unpack_tree(obj: str, dest: str) -> None:
    """Unpack a `pack_tree` object into `dest` (checked first: `matches`). Blocking.
    LayerUnavailable when it is not a whole zstd tar."""
    proc = subprocess.Popen(
        ["tar", *TAR_FLAGS, "--same-permissions", "--same-owner", "-C", dest, "-xf", "-"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stderr is not None
    try:
        with open(obj, "rb") as f:
            dctx = zstandard.ZstdDecompressor()
            with dctx.stream_reader(f) as z:
                while chunk := z.read(CHUNK):
                    proc.stdin.write(chunk)
        proc.stdin.close()
    except (BrokenPipeError, zstandard.ZstdError) as e:
        proc.kill()
        proc.wait()
        raise LayerUnavailable(f"unpacking layer object failed: {e}") from None
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise LayerUnavailable(f"unpacking layer object failed: {err.strip()[:500]}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def matches(path: str, size: object, sha256: object) -> bool:
    """Whether a fetched object is the one its manifest names (size, then sha256). Blocking."""
    return os.path.getsize(path) == size and _sha256(path) == sha256


async def _exists(store: objectstore.ObjectStore, key: str) -> bool:
    try:
        await store.size(key)
        return True
    except objectstore.ObjectNotFound:
        return False


_publishing: dict[tuple[str, str, str], asyncio.Lock] = {}
"""One publication of a layer instance at a time in this worker: sandboxes archived at once (a
drain) share their template's layers, and two uploads of one object raced (the size check of one
saw the other's partial object, and its archive failed)."""


async def publish(store: objectstore.ObjectStore, refs: list[dict], tmp_dir: str) -> int:
    """Upload the instances of `refs` (from `refs_of`) the store lacks; returns how many were
    uploaded. StoreError when the store fails (nothing is named by a manifest then)."""
    uploaded = 0
    for ref in refs:
        key, instance = check_ref(ref)
        async with _publishing.setdefault((store.name, key, instance), asyncio.Lock()):
            uploaded += await _publish_one(store, ref, key, instance, tmp_dir)
    return uploaded


async def _publish_one(
    store: objectstore.ObjectStore, ref: dict, key: str, instance: str, tmp_dir: str
) -> int:
    """Publish one instance unless the store has it (1 when uploaded); under its `_publishing` lock."""
    if await _exists(store, manifest_key(key, instance)):
        return 0
    t0 = time.perf_counter()
    out = os.path.join(tmp_dir, f"layer-{key}-{instance}.tar.zst")
    meta_path = out + ".json"
    try:
        sha, size, raw = await asyncio.to_thread(pack_tree, ref["path"], out)
        await objectstore.put_checked(store, object_key(key, instance), out, size)
        with open(meta_path, "w") as f:
            json.dump(
                {
                    "key": key,
                    "instance": instance,
                    "sha256": sha,
                    "size": size,
                    "raw_bytes": raw,
                    "published_at": time.time(),
                },
                f,
            )
        await store.put_file(manifest_key(key, instance), meta_path)
    finally:
        for p in (out, meta_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    log.info(
        "layer %s (instance %s) published: %d bytes (%d before compression) in %.0f ms",
        key,
        instance,
        size,
        raw,
        (time.perf_counter() - t0) * 1000,
    )
    return 1


# ---- fetching -------------------------------------------------------------------------------------


def local_path(layers: LayerStore, key: str, instance: str) -> str | None:
    """This worker's copy of the instance, or None."""
    for local_key in (key, f"{key}@{instance}"):
        if layers.exists(local_key):
            try:
                if instance_of(os.path.join(layers.dir, local_key)) == instance:
                    return layers.path(local_key)
            except (OSError, ValueError):
                continue
    return None


async def fetch(store: objectstore.ObjectStore, layers: LayerStore, ref: dict) -> str:
    """The local fs path of the layer instance `ref`, downloaded from the store if needed.
    LayerUnavailable when it is in neither place or damaged; StoreError when the store fails."""
    key, instance = check_ref(ref)
    found = local_path(layers, key, instance)
    if found:
        layers_mod.mark_used(found)  # the layer cache's garbage collection keeps it from now on
        return found
    local_key = f"{key}@{instance}"
    async with layers.making(local_key) as fs:
        if fs is None:  # fetched meanwhile
            found = local_path(layers, key, instance)
            if found:
                return found
            raise LayerUnavailable(f"layer {local_key} exists here with another instance")
        t0 = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=".fetch-", dir=layers.dir)
        try:
            meta_file = os.path.join(tmp, "meta.json")
            obj = os.path.join(tmp, "layer.tar.zst")
            try:
                await store.get_file(manifest_key(key, instance), meta_file)
                with open(meta_file) as f:
                    meta = json.load(f)
                await store.get_file(object_key(key, instance), obj)
            except objectstore.ObjectNotFound:
                raise LayerUnavailable(
                    f"layer {key} (instance {instance}) is not in {store.name}: the worker that built "
                    "it did not publish it (its archive tier is private to it)"
                ) from None
            except ValueError as e:
                raise LayerUnavailable(f"the manifest of layer {key} is unreadable: {e}") from None
            if ref.get("sha256") and meta.get("sha256") != ref["sha256"]:
                raise LayerUnavailable(
                    f"layer {key} (instance {instance}) in {store.name} is not the one pinned "
                    f"(sha256 {str(meta.get('sha256'))[:16]}…, pinned {str(ref['sha256'])[:16]}…)"
                )
            if not await asyncio.to_thread(matches, obj, meta.get("size"), meta.get("sha256")):
                raise LayerUnavailable(
                    f"layer {key} (instance {instance}) in {store.name} does not match its checksum"
                )
            await asyncio.to_thread(unpack_tree, obj, fs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        layers.commit(local_key, fs, f"fetched from {store.name} (layer {key})", instance=instance)
        log.info(
            "layer %s (instance %s) fetched in %.0f ms", key, instance, (time.perf_counter() - t0) * 1000
        )
        return layers.path(local_key)
