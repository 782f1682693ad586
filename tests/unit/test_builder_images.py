"""Template images (worker.images.builder) are kept per runtime key: a worker whose guest agent or
runsc changed never restores an image made under the old ones — a create finds none, and the build
is snapshotted again from its layers — and the images of other keys are swept at start-up. The
same for a user build and for the built-in `base`, whose build id no longer changes with the
agent. Real builder and runtime records; stubs for the sandbox it boots (its checkpoint is a file)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import types

import pytest

from atoll.worker.host import agent_pack, runsc, snapshots
from atoll.worker.images.builder import Build, Builder
from atoll.worker.runtimes.runtime import RuntimeStore


class StubSandboxes:
    """Boots nothing: records the boot and stamps the runtime key as a cold boot does."""

    def __init__(self):
        self.runtime_key = snapshots.RuntimeKey()
        self.boots: list[str] = []

    async def start(self, rt, lower, image, seed_upper=None):
        assert image is None  # the builder's sandboxes boot cold
        rt.runtime_key = self.runtime_key()
        self.boots.append(rt.runtime_key)
        return "cold boot"


class StubTiers:
    def __init__(self, runtimes):
        self.runtimes = runtimes

    async def checkpoint(self, rt):
        d = self.runtimes.path(rt.sandbox_id, "snapshot")
        os.makedirs(d)
        with open(os.path.join(d, "checkpoint.img"), "w") as f:
            f.write(f"memory made under {rt.runtime_key}")
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump({"runsc": rt.runtime_key}, f)


class StubGuest:
    async def gate(self, sid):
        return types.SimpleNamespace(ok=True, blockers=[])


class StubLayers:
    async def from_upper(self, dest, upper):
        pass


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A worker's home, its agent sources and runsc binary (both may be changed by a test), and a
    way to start its builder (again: a worker restart)."""
    sources = tmp_path / "agent-src"
    shutil.copytree(agent_pack.SOURCE_DIR, sources)
    monkeypatch.setattr(agent_pack, "SOURCE_DIR", str(sources))
    binary = tmp_path / "runsc"
    binary.write_bytes(b"#!/bin/sh\n# runsc 1\n")
    monkeypatch.setattr(runsc, "RUNSC", str(binary))
    base_fs = tmp_path / "layers" / "base-0000000000000001" / "fs"
    base_fs.mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()

    def start() -> tuple[Builder, StubSandboxes]:
        runtimes = RuntimeStore(str(home), "abc123")
        sandboxes = StubSandboxes()

        async def builtin_rootfs(name):
            return f"{name}-0000000000000001", str(base_fs)

        async def delete(sid):
            shutil.rmtree(runtimes.path(sid), ignore_errors=True)
            runtimes.forget(sid)

        builder = Builder(
            str(home),
            StubLayers(),  # type: ignore[arg-type]
            builtin_rootfs,
            runtimes,
            sandboxes,  # type: ignore[arg-type]
            StubTiers(runtimes),  # type: ignore[arg-type]
            StubGuest(),  # type: ignore[arg-type]
            delete,
            asyncio.ensure_future,
            lambda info: None,
            build_network={},
            build_env={},
        )
        return builder, sandboxes

    def upgrade_agent() -> None:
        module = sources / "routing.py"
        module.write_text(module.read_text() + "\n# the next version\n")

    def upgrade_runsc() -> None:
        binary.write_bytes(b"#!/bin/sh\n# runsc 2, another build\n")

    return types.SimpleNamespace(
        start=start, home=home, base_fs=str(base_fs), upgrade_agent=upgrade_agent, upgrade_runsc=upgrade_runsc
    )


def _user_build(builder: Builder, world) -> Build:
    b = Build(build_id="bld-00000000000000aa", template="app", status="ready", layers=[world.base_fs])
    os.makedirs(os.path.join(builder.root, b.build_id))
    builder._builds[b.build_id] = b
    builder._save(b)  # build.json: a restarted worker loads it
    return b


async def _made(builder: Builder, b: Build, memory_mb: int):
    """The image a create of that size finds, once the background snapshot it started is done."""
    if builder.image(b, memory_mb) is None:
        await asyncio.gather(*list(builder._image_tasks.values()))
    return builder.image(b, memory_mb)


def _memory(image) -> str:
    with open(os.path.join(image.dir, "checkpoint.img")) as f:
        return f.read()


@pytest.mark.parametrize("upgrade", ["upgrade_agent", "upgrade_runsc"])
async def test_a_user_build_is_snapshotted_again_after_the_agent_or_runsc_changed(world, upgrade):
    builder, sandboxes = world.start()
    b = _user_build(builder, world)
    await builder._snapshot(b, 512, lambda line: None)  # the build's own snapshot
    old = builder.image(b, 512)
    assert old is not None and old.runtime_key == sandboxes.runtime_key()
    assert _memory(old) == f"memory made under {old.runtime_key}"

    getattr(world, upgrade)()
    builder, sandboxes = world.start()  # the worker restarts with the new agent or runsc
    b = builder.get(b.build_id)
    assert sandboxes.runtime_key() != old.runtime_key
    # the old image is never handed to a create: that create boots cold, and the build is
    # snapshotted again from its layers in the background
    assert builder.image(b, 512) is None
    new = await _made(builder, b, 512)
    assert new is not None and new.dir != old.dir
    assert new.runtime_key == sandboxes.runtime_key() != old.runtime_key
    assert _memory(new) == f"memory made under {new.runtime_key}"
    assert sandboxes.boots == [new.runtime_key]  # one boot, under the new key

    # the old key's images go at start-up; the current key's stay
    removed = await builder.sweep_images()
    assert removed == [os.path.dirname(old.dir)]
    assert not os.path.exists(old.dir) and os.path.exists(os.path.join(new.dir, "manifest.json"))
    assert builder.image(b, 512) == new


async def test_an_unchanged_worker_restores_the_images_it_made(world):
    builder, _ = world.start()
    b = _user_build(builder, world)
    first = await _made(builder, b, 256)
    builder, sandboxes = world.start()  # restarted, same agent and runsc
    assert await builder.sweep_images() == []
    assert builder.image(builder.get(b.build_id), 256) == first
    assert sandboxes.boots == []  # nothing made again


async def test_base_keeps_its_build_and_remakes_its_images_under_a_new_agent(world):
    builder, sandboxes = world.start()
    await builder.prepare_builtin("base", 512)
    base = await builder.builtin("base", 512)
    old = builder.image(base, 512)
    assert old is not None and old.runtime_key == sandboxes.runtime_key()

    world.upgrade_agent()
    builder, sandboxes = world.start()
    await builder.prepare_builtin("base", 512)  # start-up: sweeps and makes the default size again
    again = await builder.builtin("base", 512)
    assert again.build_id == base.build_id  # one build per layer; its images are keyed inside it
    new = builder.image(again, 512)
    assert new is not None and new.runtime_key == sandboxes.runtime_key() != old.runtime_key
    assert os.listdir(os.path.join(builder.root, base.build_id, "images")) == [new.runtime_key]


async def test_the_sweep_removes_images_of_the_layout_before_keys(world):
    builder, sandboxes = world.start()
    b = _user_build(builder, world)
    images = os.path.join(builder.root, b.build_id, "images")
    for name in ("512m", "512m.upper", "512m.mode"):  # images/<memory>m: a version before keys
        if name.endswith(".mode"):
            with open(os.path.join(images, name), "w") as f:
                f.write("snapshot")
        else:
            os.makedirs(os.path.join(images, name), exist_ok=True)
    with open(os.path.join(images, "512m", "manifest.json"), "w") as f:
        f.write("{}")
    assert builder.image(b, 512) is None  # never restored
    await asyncio.gather(*list(builder._image_tasks.values()))
    await builder.sweep_images()
    assert os.listdir(images) == [sandboxes.runtime_key()]
