"""The runtime key (worker.host.snapshots.RuntimeKey): what a sandbox's memory holds that the worker
decides — the packed guest agent, the runsc binary, the bundle's process — and which runtime key a
sandbox records when it starts (worker.runtimes.sandboxes): this worker's at a cold boot, the
image's at a restore, this worker's again when a failed restore falls back to a cold boot; a
worker's inventory marks the sandboxes of another key, and its claim refuses them."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from atoll.core import errors
from atoll.core.lifecycle import Phase, Step
from atoll.worker.host import agent_pack, bundle, netns, runsc, snapshots, storage
from atoll.worker.runtimes import sandboxes as sandboxes_mod
from atoll.worker.runtimes.runtime import RuntimeStore
from atoll.worker.runtimes.sandboxes import Sandboxes
from atoll.worker.service.node import Node
from atoll.worker.service.settings import WorkerSettings


@pytest.fixture
def agent_dir(tmp_path):
    d = tmp_path / "agent"
    d.mkdir()
    agent_pack.build(str(d))
    return str(d)


@pytest.fixture
def fake_runsc(tmp_path, monkeypatch):
    path = tmp_path / "runsc"
    path.write_bytes(b"#!/bin/sh\n# runsc 1\n")
    path.chmod(0o755)
    monkeypatch.setattr(runsc, "RUNSC", str(path))
    return path


@pytest.fixture
def agent_sources(tmp_path, monkeypatch):
    """A copy of the guest agent's sources that the worker packs (a test may change them)."""
    copy = tmp_path / "agent-src"
    shutil.copytree(agent_pack.SOURCE_DIR, copy)
    monkeypatch.setattr(agent_pack, "SOURCE_DIR", str(copy))
    return copy


def test_the_key_is_stable_across_calls_and_worker_restarts(agent_sources, fake_runsc, agent_dir):
    key = snapshots.RuntimeKey()
    first = key()
    assert len(first) == 16 and first == key()
    agent_pack.build(agent_dir)  # every worker start packs the agent again
    assert snapshots.RuntimeKey()() == first  # a restarted worker with the same agent and runsc


def test_a_changed_agent_changes_the_key(agent_sources, fake_runsc):
    before = snapshots.RuntimeKey()()
    module = agent_sources / "routing.py"
    module.write_text(module.read_text() + "\n# a later version\n")
    assert snapshots.RuntimeKey()() != before
    (agent_sources / "routing.py").unlink()  # a module less is another agent too
    assert snapshots.RuntimeKey()() != before


def test_a_replaced_runsc_changes_the_key_even_under_a_running_worker(agent_sources, fake_runsc):
    key = snapshots.RuntimeKey()
    before = key()
    fake_runsc.write_bytes(b"#!/bin/sh\n# runsc 2, a longer build\n")
    assert key() != before


def test_what_the_bundle_puts_in_memory_is_in_the_key(agent_sources, fake_runsc, monkeypatch):
    before = snapshots.RuntimeKey()()
    for module, name, value in (
        (bundle, "AGENT_PORT", bundle.AGENT_PORT + 1),
        (netns, "SANDBOX_IP", "10.99.0.3"),
        (snapshots, "SNAPSHOT_FORMAT", snapshots.SNAPSHOT_FORMAT + 1),
    ):
        old = getattr(module, name)
        monkeypatch.setattr(module, name, value)
        assert snapshots.RuntimeKey()() != before, name
        monkeypatch.setattr(module, name, old)
    assert snapshots.RuntimeKey()() == before


def test_the_agent_digest_does_not_depend_on_the_packing_process(agent_sources, tmp_path):
    """The .pyc's bytes may differ between two packs in one process (marshal's references follow
    the process's state); what the key names — the sources — does not."""
    first = agent_pack.digest(str(agent_sources))
    agent_pack.build(str(tmp_path))
    snapshots.RuntimeKey()()  # work in between that touches many interned strings
    agent_pack.build(str(tmp_path))
    assert agent_pack.digest(str(agent_sources)) == first


# ---- which key a starting sandbox records ---------------------------------------------------------


class StubGuest:
    def __init__(self):
        self.identify_error: errors.AtollError | None = None

    async def wait_ready(self, sid, timeout, log_path):
        pass

    async def identify(self, sid, generation, *, hostname, env, cpus, workdir):
        if hostname is not None and self.identify_error is not None:
            raise self.identify_error
        return hostname

    async def close(self, sid):
        pass


class StubLiveness:
    def watch(self, rt):
        pass

    def unwatch(self, sid):
        pass

    def exited(self, sid):
        return asyncio.Event()


class StubEdge:
    async def attach(self, rt):
        pass


class StubHost:
    install_id = "abc123"
    runsc_root = "/nonexistent"


@pytest.fixture
def booting(tmp_path, agent_dir, fake_runsc, monkeypatch):
    """Sandboxes over stubs for the host (mounts, namespaces, runsc, cgroups): what ran, in order."""
    ran: list[str] = []

    async def create_upper(img, upper, disk_mb):
        os.makedirs(os.path.join(upper, "upper"), exist_ok=True)

    async def mount_rootfs(lower, upper, rootfs):
        os.makedirs(os.path.join(rootfs, "etc"), exist_ok=True)

    async def nothing(*args, **kwargs):
        pass

    async def run(root, bundle_dir, cid, log_path):
        ran.append(f"run {cid}")

    async def restore(root, bundle_dir, cid, image, log_path):
        ran.append(f"restore {cid}")

    monkeypatch.setattr(storage, "create_upper", create_upper)
    monkeypatch.setattr(storage, "mount_rootfs", mount_rootfs)
    monkeypatch.setattr(netns, "create", nothing)
    monkeypatch.setattr(netns, "readdress", nothing)
    monkeypatch.setattr(runsc, "run", run)
    monkeypatch.setattr(runsc, "restore", restore)
    monkeypatch.setattr(runsc, "delete", nothing)
    monkeypatch.setattr(runsc, "sandbox_pid", lambda root, cid: 4242)
    monkeypatch.setattr(sandboxes_mod.cgroups, "set_cpu_limit", lambda cg, cpus: None)
    monkeypatch.setattr(sandboxes_mod.cgroups, "remove", lambda cg: None)
    store = RuntimeStore(str(tmp_path / "home"), "abc123")
    guest = StubGuest()
    sb = Sandboxes(store, guest, StubLiveness(), StubHost(), agent_dir, StubEdge())  # type: ignore[arg-type]
    return sb, store, guest, ran


def _new(store, sid, runtime_key=""):
    return store.new(sid, template="base", memory_mb=512, cpus=1, env={}, disk_mb=64, runtime_key=runtime_key)


async def test_a_cold_boot_records_the_worker_s_key_and_a_restore_the_image_s(booting):
    sb, store, guest, ran = booting
    cold = _new(store, "sb-0000000000000001", runtime_key="left-by-a-caller")
    assert await sb.start(cold, "/lower", None) == "cold boot"
    assert cold.runtime_key == sb.runtime_key()
    assert store.load(cold.sandbox_id).runtime_key == sb.runtime_key()  # on disk: a restart reads it

    restored = _new(store, "sb-0000000000000002", runtime_key="0123456789abcdef")
    assert await sb.start(restored, "/lower", "/image") == "template image"
    assert restored.runtime_key == "0123456789abcdef"  # its memory is the image's
    assert ran == [f"run {cold.cid}", f"restore {restored.name}-0"]


async def test_a_failed_restore_boots_cold_and_records_the_worker_s_key(booting):
    sb, store, guest, ran = booting
    guest.identify_error = errors.RuntimeFailure("the restored agent does not answer /identity")
    rt = _new(store, "sb-0000000000000003", runtime_key="0123456789abcdef")
    assert await sb.start(rt, "/lower", "/image") == "cold boot"
    assert rt.runtime_key == sb.runtime_key()
    assert ran == [f"restore {rt.name}-0", f"run {rt.name}-1"]


# ---- what a worker tells of, and hands out --------------------------------------------------------


async def test_the_inventory_marks_and_claim_refuses_a_sandbox_of_another_key(tmp_path, fake_runsc):
    node = Node(WorkerSettings(home=str(tmp_path / "home")))
    now = node.sandboxes.runtime_key()
    made = {
        "sb-0000000000000011": now,  # made under this worker's agent and runsc
        "sb-0000000000000012": "0123456789abcdef",  # before they changed
        "sb-0000000000000013": "",  # by a version that did not record it
    }
    for sid, key in made.items():
        rt = _new(node.runtimes, sid, runtime_key=key)
        node.runtimes.advance(rt, Step.BOOTED)
        node.runtimes.advance(rt, Step.FREEZE)
    inventory = await node.inventory()
    assert {r.sandbox_id: r.stale_runtime for r in inventory.runtimes} == {
        "sb-0000000000000011": False,
        "sb-0000000000000012": True,
        "sb-0000000000000013": True,
    }
    for sid in ("sb-0000000000000012", "sb-0000000000000013"):
        with pytest.raises(errors.Conflict) as e:
            await node.claim(sid, {"WHO": "me"}, 1.0)
        assert "not handed out" in e.value.message
        assert node.runtimes.get(sid).phase == Phase.FROZEN  # refused before any thaw


async def test_a_sandbox_trusting_other_certificates_than_a_new_one_is_marked_and_refused(
    tmp_path, fake_runsc
):
    """The CA certificates a sandbox is made with (the installation's root, which `set_authority`
    gives, and ATOLL_SANDBOX_CA_FILE's) are in its files and environment: a pool member made before
    a restart with another file, or under another root, is not what a create makes now."""
    from atoll.core import pki
    from atoll.core import worker_api as api
    from atoll.worker.host import trust

    home = str(tmp_path / "home")
    root, other_root = pki.new_root_ca("installation")[0].decode(), pki.new_root_ca("again")[0].decode()
    files = {}
    for name in ("proxy-1", "proxy-2"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(pki.new_root_ca(name)[0])

    async def worker(ca_file, root_pem) -> Node:  # a worker (re)started with these
        node = Node(WorkerSettings(home=home, sandbox_ca_file=str(ca_file) if ca_file else None))
        await node.set_authority(api.Authority(root_pem=root_pem, cert_pem="", key_pem=""))
        return node

    node = await worker(files["proxy-1"], root)
    member = "sb-0000000000000021"
    rt = _new(node.runtimes, member, runtime_key=node.sandboxes.runtime_key())
    rt.trust_pem = trust.combine(root, trust.certificates(files["proxy-1"].read_text()))  # as create does
    node.runtimes.advance(rt, Step.BOOTED)
    node.runtimes.advance(rt, Step.FREEZE)
    assert [r.stale_runtime for r in (await node.inventory()).runtimes] == [False]

    for ca_file, root_pem, stale in (
        (files["proxy-1"], root, False),  # the same file and root after a restart: kept
        (files["proxy-2"], root, True),  # another ATOLL_SANDBOX_CA_FILE
        (None, root, True),  # none any more
        (files["proxy-1"], other_root, True),  # the installation's CA was made again
    ):
        node = await worker(ca_file, root_pem)
        node.runtimes.get(member)  # reattached from its record
        assert [r.stale_runtime for r in (await node.inventory()).runtimes] == [stale], (ca_file, stale)
        if stale:
            with pytest.raises(errors.Conflict) as e:
                await node.claim(member, {"WHO": "me"}, 1.0)
            assert "trusting other CA certificates" in e.value.message and "not handed out" in e.value.message
            assert node.runtimes.get(member).phase == Phase.FROZEN  # refused before any thaw


async def test_a_base_sandbox_of_an_older_base_layer_is_marked_and_refused(tmp_path, fake_runsc):
    """`base`'s layer changes with atoll itself (its recipe, the shim, the login profile): a pool
    member made from the layer before an upgrade is not what a create makes now."""
    from atoll.worker.images.builder import Build

    node = Node(WorkerSettings(home=str(tmp_path / "home")))
    current = Build(
        build_id="base-0123456789abcdef",
        template="base",
        status="ready",
        progress="ready",
        layers=["/layers/base-new/fs"],
        top_key="base-new",
        memory_mb=512,
    )
    made = {"sb-0000000000000031": current.lower, "sb-0000000000000032": "/layers/base-old/fs"}
    for sid, lower in made.items():
        rt = _new(node.runtimes, sid, runtime_key=node.sandboxes.runtime_key())
        rt.lower = lower
        node.runtimes.advance(rt, Step.BOOTED)
        node.runtimes.advance(rt, Step.FREEZE)
    # before the worker knows its base build, nothing is judged by the layer
    assert not any(r.stale_runtime for r in (await node.inventory()).runtimes)
    node.builder._builtins["base"] = current
    inventory = await node.inventory()
    assert {r.sandbox_id: r.stale_runtime for r in inventory.runtimes} == {
        "sb-0000000000000031": False,
        "sb-0000000000000032": True,
    }
    with pytest.raises(errors.Conflict) as e:
        await node.claim("sb-0000000000000032", {"WHO": "me"}, 1.0)
    assert "older layer" in e.value.message and "not handed out" in e.value.message
    assert node.runtimes.get("sb-0000000000000032").phase == Phase.FROZEN
