"""User template builds in the object store: a create from a template may run on a worker that
never built it, on the very bytes the build made (never on a separately built root file system:
mmdebstrap and package installs are not byte-identical, and a template's snapshot maps its files).

A build is its layer stack plus what a boot of it needs (env, workdir, user, start command, ready
check). Its layers are published in the archive tier's layer format (worker.images.layerpack:
`layers/<key>/<instance>.tar.zst` + `.json`, shared with archived sandboxes, uploaded once per
instance); the build itself is one manifest written after all of them:

    builds/<build_id>.json   BuildManifest: format, the layer stack top first as
                             [{key, instance, sha256, size}], the boot settings, who published it

So a build is in the store only once its manifest is, and the manifest pins every layer's sha256:
`fetch` downloads each instance the worker lacks, checks it against that sha256 (and the layer's
own manifest) before unpacking, and caches it in the layer cache under `<key>@<instance>` like the
archive tier's adoptions. Snapshots are not published: they are bound to the guest agent and runsc
they were made under (worker.host.snapshots.RuntimeKey), so the fetching worker's first create
boots cold on the fetched layers and its own snapshot is made from them in the background.

Called by worker.images.builder (publish after a build is ready, fetch on a create or a build FROM
a build this worker lacks, forget on delete).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field

from atoll.worker.host import objectstore
from atoll.worker.images import layerpack
from atoll.worker.images.layers import LayerStore

FORMAT = 1
"""Raise it when the manifest's meaning changes; a worker refuses manifests of a format it lacks."""


class BuildMissing(Exception):
    """No manifest of this build in the store (never published, or deleted with its template)."""


class BuildDamaged(Exception):
    """The build's manifest or one of its layers does not match what was published."""


@dataclass
class BuildManifest:
    build_id: str
    template: str
    layers: list[dict]
    """The root file system's layer stack, top first: `{key, instance, sha256, size}`."""
    top_key: str = ""
    """The content key of its top step (builds FROM this template key their steps on it)."""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start: str | None = None
    ready: dict | None = None
    start_mode: str = ""
    start_reason: str = ""
    steps: int = 0
    cached_steps: int = 0
    size_bytes: int | None = None
    memory_mb: int = 512
    built_at: float | None = None
    holder: str = ""
    """The installation id of the worker that built and published it."""
    store: str = ""
    published_at: float = 0.0
    format: int = FORMAT

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str | bytes) -> BuildManifest:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise BuildDamaged(f"the build manifest is not JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else None
            raise BuildDamaged(f"build manifest format {got!r} is not {FORMAT} (made by another version)")
        known = set(cls.__dataclass_fields__)
        try:
            man = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise BuildDamaged(f"the build manifest lacks a field: {e}") from None
        if not isinstance(man.layers, list) or not man.layers:
            raise BuildDamaged(f"the manifest of build {man.build_id} names no layers")
        for ref in man.layers:
            if not isinstance(ref, dict) or not isinstance(ref.get("sha256"), str):
                raise BuildDamaged(f"the manifest of build {man.build_id} has a malformed layer {ref!r}")
            try:
                layerpack.check_ref(ref)
            except layerpack.LayerUnavailable as e:
                raise BuildDamaged(str(e)) from None
        return man


def manifest_key(build_id: str) -> str:
    return f"builds/{build_id}.json"


async def _layer_meta(store: objectstore.ObjectStore, key: str, instance: str, tmp_dir: str) -> dict:
    path = os.path.join(tmp_dir, f"layer-{key}-{instance}.meta.json")
    try:
        await store.get_file(layerpack.manifest_key(key, instance), path)
        with open(path) as f:
            return json.load(f)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def publish(
    store: objectstore.ObjectStore, man: BuildManifest, lower: str, tmp_dir: str
) -> BuildManifest:
    """Publish the layers of the stack `lower` (top first, an overlay lowerdir) the store lacks,
    then `man` with their refs and checksums (last: the build exists in the store only once whole).
    Returns the manifest as stored. BuildDamaged when the stack is not made of cached layers;
    StoreError when the store fails."""
    refs = layerpack.refs_of(lower)
    if not refs:
        raise BuildDamaged(
            f"build {man.build_id}: its root file system {lower} is not a stack of cached layers"
        )
    await layerpack.publish(store, refs, tmp_dir)
    pinned = []
    for ref in refs:
        meta = await _layer_meta(store, ref["key"], ref["instance"], tmp_dir)
        pinned.append(
            {"key": ref["key"], "instance": ref["instance"], "sha256": meta["sha256"], "size": meta["size"]}
        )
    man.layers, man.store, man.published_at = pinned, store.name, time.time()
    path = os.path.join(tmp_dir, f"build-{man.build_id}.json")
    with open(path, "w") as f:
        f.write(man.dumps())
    try:
        await store.put_file(manifest_key(man.build_id), path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return man


async def fetch_manifest(store: objectstore.ObjectStore, build_id: str, tmp_dir: str) -> BuildManifest:
    """The build's manifest in the store. BuildMissing / BuildDamaged; StoreError when it fails."""
    path = os.path.join(tmp_dir, f"build-{build_id}.fetched.json")
    try:
        await store.get_file(manifest_key(build_id), path)
        with open(path, "rb") as f:
            man = BuildManifest.loads(f.read())
    except objectstore.ObjectNotFound:
        raise BuildMissing(f"build {build_id} is not in {store.name}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if man.build_id != build_id:
        raise BuildDamaged(f"the manifest {manifest_key(build_id)} describes build {man.build_id}")
    return man


async def fetch_layers(store: objectstore.ObjectStore, layers: LayerStore, man: BuildManifest) -> list[str]:
    """The local fs paths of the build's layers (top first), each downloaded and checked against
    the sha256 the build's manifest pins unless this worker holds that very instance already.
    BuildDamaged when a layer is missing or does not match; StoreError when the store fails."""
    paths = []
    for ref in man.layers:
        try:
            paths.append(await layerpack.fetch(store, layers, ref))
        except layerpack.LayerUnavailable as e:
            raise BuildDamaged(f"build {man.build_id}: {e}") from None
    return paths


async def forget(store: objectstore.ObjectStore, build_id: str) -> None:
    """Remove the build's manifest (its layers stay: other builds and archives may share them)."""
    with contextlib.suppress(objectstore.ObjectNotFound):
        await store.delete(manifest_key(build_id))
