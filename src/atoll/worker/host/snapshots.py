"""Where checkpoint images live, and how one is committed and verified (`SnapshotStore`).

A disk-tier standby is written in steps, so a crash at any point leaves either the old snapshot or
a complete new one: `runsc checkpoint` writes into `staging(...)` (`snapshot.tmp-<generation>/`,
with a `done` marker only on success); `commit` checksums the image (CRC-32), writes and fsyncs
`manifest.json`, renames the directory to `snapshot/` and only then drops the previous one. A
restore checks the size against the manifest first and the checksum while runsc reads the image.

The checksum is there to catch corruption (a bad disk, a truncated copy), not tampering: the
manifest sits beside the image, so anyone who could change one could change both. CRC-32 (zlib,
~4 GB/s here) does that job at a fifth of BLAKE2b's CPU (~0.9 GB/s), and the check runs on one of
the two cores while runsc restores on both: BLAKE2b's ~85 ms for a 75 MB image slowed the restore
by ~19 ms (measured). Snapshots written with BLAKE2b by earlier versions are still verified with it.

`LocalSnapshotStore` keeps them on the worker's disk under each sandbox's directory; an object
store or a shared filesystem (archive tier, cross-worker resume) is another implementation of the
same interface. Called by worker.tiers and worker.recovery.

`RuntimeKey` names what every checkpoint holds that the worker, not the template or the caller,
decides (the guest agent, the runsc sentry, the bundle's process): template images are kept under
it (worker.images.builder) and each runtime records the key its memory came from
(worker.runtimes.sandboxes), so a worker whose agent or runsc changed makes its template images
again and replaces the pool members made before.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
import typing
import zlib
from dataclasses import dataclass

from atoll.core import errors
from atoll.worker.host import agent_pack, bundle, netns, runsc

RUNSC_VERSION = "0.0~20221219.0"


SNAPSHOT_FORMAT = 1
"""Part of every runtime key: raise it when something the worker puts into a sandbox's memory
changes where `RuntimeKey` does not look (the agent's files, runsc and `bundle.render` it sees)."""


class RuntimeKey:
    """What a sandbox's memory holds that the worker decides, as a short key (16 hex digits): the
    guest agent it packs (`agent_pack.digest`: its sources and this interpreter's bytecode version),
    the runsc binary (the sentry is that program), runsc's flags, the OCI bundle a sandbox boots
    with (the agent's command line, address and port, the environment, mounts and capabilities:
    `bundle.render` of a fixed spec) and SNAPSHOT_FORMAT. A snapshot restores into a working
    sandbox only under the key it was made under: an old agent in memory may not speak this
    worker's protocol.

    The worker's own part is computed at the first call (the agent is packed once, at start-up);
    the runsc binary is looked at on every call, a few stat calls (a package upgrade may replace it
    under a running worker)."""

    def __init__(self) -> None:
        self._fixed = ""

    def __call__(self) -> str:
        if not self._fixed:
            canonical = bundle.BundleSpec(  # what every sandbox's bundle says apart from its own values
                sandbox_id="sbx",
                hostname="sbx",
                rootfs="/rootfs",
                agent_dir="/agent",
                netns_path="/netns",
                cgroup_path="/cgroup",
                memory_mb=512,
                cpus=None,
                env={},
                agent_entry=agent_pack.COMPILED,
                visible_cpus=1.0,
                agent_host=netns.SANDBOX_IP,
            )
            self._fixed = json.dumps(
                {
                    "format": SNAPSHOT_FORMAT,
                    "agent": agent_pack.digest(agent_pack.SOURCE_DIR),
                    "flags": runsc.base_flags("/root")[1:],
                    "bundle": bundle.render(canonical),
                },
                sort_keys=True,
            )
        h = hashlib.blake2b(self._fixed.encode(), digest_size=8)
        h.update(runsc.binary_identity().encode())
        return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    sandbox_id: str
    generation: int
    image: str
    size: int
    digest: str
    runsc: str
    created_at: float
    algorithm: str = "crc32"


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot: the directory runsc restores from, and its manifest."""

    dir: str
    manifest: Manifest

    @property
    def image(self) -> str:
        return os.path.join(self.dir, self.manifest.image)


class SnapshotStore(typing.Protocol):
    def staging_path(self, sid: str, generation: int) -> str: ...

    def staging(self, sid: str, generation: int) -> str: ...

    def staged_complete(self, staging_dir: str) -> bool: ...

    async def commit(self, sid: str, generation: int, staging_dir: str) -> Snapshot: ...

    def committed(self, sid: str) -> Snapshot | None: ...

    def checked(self, sid: str) -> Snapshot: ...

    async def verify(self, snap: Snapshot) -> None: ...

    async def discard(self, sid: str) -> None: ...

    def drop_staging(self, staging_dir: str) -> None: ...


def checksum(path: str, algorithm: str = "crc32") -> tuple[str, int]:
    """(digest, size) of a file: CRC-32 by default, BLAKE2b-160 for snapshots of earlier versions."""
    size = 0
    with open(path, "rb") as f:
        if algorithm == "crc32":
            crc = 0
            while chunk := f.read(4 * 1024 * 1024):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
            return f"{crc:08x}", size
        h = hashlib.blake2b(digest_size=20)
        while chunk := f.read(4 * 1024 * 1024):
            h.update(chunk)
            size += len(chunk)
        return h.hexdigest(), size


def _manifest(data: dict) -> Manifest:
    if "blake2b" in data:  # written by an earlier version
        data = dict(data)
        data["digest"], data["algorithm"] = data.pop("blake2b"), "blake2b"
    return Manifest(**data)


class LocalSnapshotStore:
    """Snapshots in `<sandboxes>/<id>/snapshot/` on the worker's own disk."""

    def __init__(self, sandboxes_root: str):
        self.root = sandboxes_root

    def _p(self, sid: str, *parts: str) -> str:
        return os.path.join(self.root, sid, *parts)

    def staging_path(self, sid: str, generation: int) -> str:
        return self._p(sid, f"snapshot.tmp-{generation}")

    def staging(self, sid: str, generation: int) -> str:
        """A fresh path for `runsc checkpoint --image-path` of `generation` (runsc creates it)."""
        tmp = self.staging_path(sid, generation)
        shutil.rmtree(tmp, ignore_errors=True)
        return tmp

    def staged_complete(self, staging_dir: str) -> bool:
        return os.path.exists(os.path.join(staging_dir, "done"))

    def drop_staging(self, staging_dir: str) -> None:
        shutil.rmtree(staging_dir, ignore_errors=True)

    async def commit(self, sid: str, generation: int, staging_dir: str) -> Snapshot:
        img = os.path.join(staging_dir, "checkpoint.img")
        digest, size = await asyncio.to_thread(checksum, img)
        man = Manifest(sid, generation, "checkpoint.img", size, digest, RUNSC_VERSION, time.time(), "crc32")
        with open(os.path.join(staging_dir, "manifest.json"), "w") as f:
            json.dump(man.__dict__, f)
            f.flush()
            os.fsync(f.fileno())  # the rename below must never expose a manifest that is not on disk
        final, old = self._p(sid, "snapshot"), self._p(sid, "snapshot.old")
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(staging_dir, final)
        shutil.rmtree(old, ignore_errors=True)
        return Snapshot(final, man)

    def committed(self, sid: str) -> Snapshot | None:
        final = self._p(sid, "snapshot")
        try:
            with open(os.path.join(final, "manifest.json")) as f:
                return Snapshot(final, _manifest(json.load(f)))
        except (FileNotFoundError, TypeError, ValueError):
            return None

    def checked(self, sid: str) -> Snapshot:
        """The committed snapshot, its image's size checked against the manifest."""
        snap = self.committed(sid)
        if snap is None:
            raise errors.RuntimeFailure(f"sandbox {sid} has no committed snapshot to restore")
        try:
            size = os.path.getsize(snap.image)
        except FileNotFoundError:
            size = -1
        if size != snap.manifest.size:
            raise errors.RuntimeFailure(
                f"snapshot of {sid} is damaged: its image has {size} bytes, the manifest says "
                f"{snap.manifest.size}",
                detail=snap.image,
            )
        return snap

    async def verify(self, snap: Snapshot) -> None:
        digest, _ = await asyncio.to_thread(checksum, snap.image, snap.manifest.algorithm)
        if digest != snap.manifest.digest:
            raise errors.RuntimeFailure(
                f"snapshot of {snap.manifest.sandbox_id} is damaged: its {snap.manifest.algorithm} checksum "
                f"{digest} differs from the committed {snap.manifest.digest}"
            )

    async def discard(self, sid: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self._p(sid, "snapshot"), True)
