"""worker.images.buildpack and Builder.publish/ensure: a ready build goes to a (local-directory)
object store as its layers (the archive tier's layer format) plus `builds/<id>.json` pinning their
sha256; a worker that lacks the build fetches it by id — its very layers, under their instances,
never a layer of the same key it made itself — once however many creates ask at the same time; a
build not in the store, a damaged layer, a manifest of another format are refused (409
build_unavailable), a store that fails is 503 (retryable)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from atoll.core import errors, ids
from atoll.core import worker_api as api
from atoll.worker.host import objectstore
from atoll.worker.images import buildpack, layerpack
from atoll.worker.images.builder import Build, Builder
from atoll.worker.images.layers import LayerStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layer owners need root")


def _layer(store: LayerStore, key: str, files: dict[str, str]) -> str:
    async def go() -> str:
        async with store.making(key) as fs:
            assert fs is not None
            for path, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(fs, path)), exist_ok=True)
                with open(os.path.join(fs, path), "w") as f:
                    f.write(text)
            store.commit(key, fs, "test")
        return store.path(key)

    return asyncio.run(go())


def _builder(home: str, layers: LayerStore, store: objectstore.ObjectStore | None, seen: list) -> Builder:
    """A Builder for the store's verbs only: building and snapshots are not exercised here."""
    b = Builder(
        home,
        layers,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        seen.append,
        build_network={},
        build_env={},
    )
    b.store, b.holder = store, "inst-a"
    return b


def _ready_build(builder: Builder, layers: LayerStore) -> Build:
    base = _layer(layers, "base-0123456789abcdef", {"etc/os-release": "base\n"})
    top = _layer(layers, "step-1", {"app/marker": "made-by-the-build\n"})
    b = Build(
        build_id=ids.new_build_id(),
        template="web",
        status="ready",
        progress="ready",
        env={"MODE": "dev"},
        workdir="/app",
        start="python3 -m http.server 8000",
        ready={"port": 8000},
        layers=[top, base],
        top_key="step-1",
        steps=1,
    )
    os.makedirs(os.path.join(builder.root, b.build_id))
    builder._builds[b.build_id] = b
    return b


def test_a_published_build_is_its_layers_and_a_manifest_pinning_them(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "store"))
    seen: list[api.BuildInfo] = []
    here = LayerStore(str(tmp_path / "a-layers"))
    builder = _builder(str(tmp_path / "a"), here, store, seen)
    b = _ready_build(builder, here)
    assert asyncio.run(builder.publish(b)) is True
    assert b.in_store and seen[-1].in_store and seen[-1].build_id == b.build_id
    with open(os.path.join(store.root, buildpack.manifest_key(b.build_id))) as f:
        man = json.load(f)
    assert man["format"] == buildpack.FORMAT and man["holder"] == "inst-a" and man["store"] == store.name
    assert [r["key"] for r in man["layers"]] == ["step-1", "base-0123456789abcdef"]  # top first
    assert (man["env"], man["workdir"], man["start"], man["top_key"]) == (
        {"MODE": "dev"},
        "/app",
        "python3 -m http.server 8000",
        "step-1",
    )
    for ref in man["layers"]:  # each pinned layer is the archive tier's object, with that sha256
        obj = os.path.join(store.root, layerpack.object_key(ref["key"], ref["instance"]))
        assert layerpack._sha256(obj) == ref["sha256"] and os.path.getsize(obj) == ref["size"]
    assert buildpack.BuildManifest.loads(json.dumps(man)).layers == man["layers"]
    with pytest.raises(buildpack.BuildDamaged, match="format"):
        buildpack.BuildManifest.loads(json.dumps({**man, "format": 99}))
    with pytest.raises(buildpack.BuildDamaged, match="malformed"):
        buildpack.BuildManifest.loads(json.dumps({**man, "layers": [{"key": "../x", "instance": "0" * 32}]}))
    asyncio.run(builder.delete(b.build_id))  # the template goes: no worker fetches it again
    assert not os.path.exists(os.path.join(store.root, buildpack.manifest_key(b.build_id)))


def test_a_worker_that_lacks_a_build_fetches_it_once_and_never_uses_its_own_layer(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "store"))
    here = LayerStore(str(tmp_path / "a-layers"))
    b = _ready_build(_builder(str(tmp_path / "a"), here, store, []), here)
    maker = _builder(str(tmp_path / "a"), here, store, [])
    maker._builds[b.build_id] = b
    assert asyncio.run(maker.publish(b))
    there = LayerStore(str(tmp_path / "b-layers"))
    # this worker built `base` itself: same key, other bytes, another instance
    own_base = _layer(there, "base-0123456789abcdef", {"etc/os-release": "built separately\n"})
    seen: list[api.BuildInfo] = []
    other = _builder(str(tmp_path / "b"), there, store, seen)
    fetches = []
    real = buildpack.fetch_manifest

    async def counting(*a, **k):
        fetches.append(1)
        return await real(*a, **k)

    buildpack.fetch_manifest = counting
    try:

        async def many() -> list[Build]:
            return await asyncio.gather(*(other.ensure(b.build_id) for _ in range(4)))

        got = asyncio.run(many())
    finally:
        buildpack.fetch_manifest = real
    assert len(fetches) == 1 and all(g is got[0] for g in got)
    f = got[0]
    assert (f.status, f.fetched, f.in_store, f.env, f.workdir, f.start) == (
        "ready",
        True,
        True,
        {"MODE": "dev"},
        "/app",
        "python3 -m http.server 8000",
    )
    assert own_base not in f.layers and all("@" in os.path.basename(os.path.dirname(p)) for p in f.layers)
    with open(os.path.join(f.layers[0], "app/marker")) as fh:
        assert fh.read() == "made-by-the-build\n"
    with open(os.path.join(f.layers[1], "etc/os-release")) as fh:
        assert fh.read() == "base\n"  # the builder's base, not this worker's
    assert seen and seen[-1].build_id == b.build_id and seen[-1].status == "ready"
    # a restarted worker finds the fetched build on disk
    again = _builder(str(tmp_path / "b"), there, store, [])
    assert again.get(b.build_id).layers == f.layers


def test_a_build_not_in_the_store_or_damaged_is_refused_with_409(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "store"))
    here = LayerStore(str(tmp_path / "a-layers"))
    maker = _builder(str(tmp_path / "a"), here, store, [])
    b = _ready_build(maker, here)
    other = _builder(str(tmp_path / "b"), LayerStore(str(tmp_path / "b-layers")), store, [])
    with pytest.raises(errors.BuildUnavailable, match="neither on this worker nor in the object store"):
        asyncio.run(other.ensure(b.build_id))
    assert not os.path.exists(os.path.join(other.root, b.build_id))
    assert asyncio.run(maker.publish(b))
    with open(os.path.join(store.root, buildpack.manifest_key(b.build_id))) as f:
        man = json.load(f)
    top = man["layers"][0]
    obj = os.path.join(store.root, layerpack.object_key(top["key"], top["instance"]))
    with open(obj, "r+b") as f:
        f.seek(40)
        f.write(b"\xff" * 8)
    with pytest.raises(errors.BuildUnavailable, match="cannot be used.*checksum"):
        asyncio.run(other.ensure(b.build_id))
    assert b.build_id not in other._builds
    # a layer manifest swapped for another object's: the build's pin refuses it
    man["layers"][0]["sha256"] = "0" * 64
    with open(os.path.join(store.root, buildpack.manifest_key(b.build_id)), "w") as f:
        json.dump(man, f)
    with pytest.raises(errors.BuildUnavailable, match="not the one pinned"):
        asyncio.run(other.ensure(b.build_id))


def test_a_store_that_fails_is_retryable_and_a_private_store_never_fetches(tmp_path):
    class Down(objectstore.LocalStore):
        async def get_file(self, key: str, path: str) -> int:
            raise objectstore.StoreUnavailable("connection refused")

    other = _builder(
        str(tmp_path / "b"), LayerStore(str(tmp_path / "b-layers")), Down(str(tmp_path / "s")), []
    )
    bid = ids.new_build_id()
    with pytest.raises(errors.Unavailable) as e:
        asyncio.run(other.ensure(bid))
    assert e.value.retryable and "connection refused" in e.value.message
    private = _builder(str(tmp_path / "c"), LayerStore(str(tmp_path / "c-layers")), None, [])
    with pytest.raises(errors.TemplateNotFound, match="unknown on this worker"):
        asyncio.run(private.ensure(bid))


def test_ready_builds_not_in_the_store_are_published_at_start_up(tmp_path):
    """Builds made before the store was shared (or whose publication was cut short) go there when
    the worker starts with a shared store; fetched ones and those in the store already do not."""
    here = LayerStore(str(tmp_path / "a-layers"))
    first = _builder(str(tmp_path / "a"), here, None, [])
    b = _ready_build(first, here)
    first._save(b)
    assert first.publish_pending() == 0  # no shared store: nothing to do
    store = objectstore.LocalStore(str(tmp_path / "store"))
    restarted = _builder(str(tmp_path / "a"), here, store, [])

    async def go() -> int:
        n = restarted.publish_pending()
        await asyncio.gather(*restarted._publishing)
        return n

    assert asyncio.run(go()) == 1
    assert os.path.exists(os.path.join(store.root, buildpack.manifest_key(b.build_id)))
    assert restarted.get(b.build_id).in_store and restarted.publish_pending() == 0
