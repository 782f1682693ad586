"""The archive tier of one sandbox: a checkpointed sandbox moved to the object store and back.

archive (phase checkpointed): unmount the root filesystem and the upper image (the writable layer
must be at rest to be copied), `begin_archive` (durable), pack + upload + verify (worker.host.archive),
`commit_archive` (durable), and only then drop the local snapshot and upper image. The object store
failing (down, refusing) leaves everything on disk: the layers are mounted again, `abort_archive`,
and the caller is told why (the sandbox stays in the disk tier; the policy tries again later).
unarchive (phase archived): download, verify and unpack (nothing is moved into place unless every
checksum matches), mount the layers again, `unarchived` (durable): the sandbox is checkpointed on
disk again, and the normal disk restore follows; only once the sandbox runs are its stale archive
objects removed (`drop_stale`, under the sandbox's lock, so never racing a new upload; a store that
fails leaves the removal in worker.runtimes.archive_gc's journal): a worker killed mid-restore
leaves the archive whole in the store, for another worker to adopt — unless the resume asked to
keep them anyway (`keep_archive`: the control plane's `on_worker_lost: "restore"` comes back from
there on another worker; `archive_kept` on the runtime, until its next archive or its delete). A damaged or missing archive fails the runtime with the cause (never restored with bad memory); an
unreachable store is a ResumeFailed (the sandbox stays archived, a retry may work).
`reattach` finishes what a killed worker left: archiving -> checkpointed (the disk copy was kept),
archived -> local leftovers dropped (the archive is whole). Called by worker.tiers and
worker.recovery (and worker.node at delete: `remove`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import typing

from atoll.core import errors
from atoll.core.lifecycle import Phase, Step
from atoll.worker.host import archive, hostcmd, objectstore, runsc, snapshots, storage
from atoll.worker.images import layerpack, layers
from atoll.worker.runtimes import archive_gc
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore

log = logging.getLogger(__name__)

RUNTIME_FIELDS = ("memory_mb", "cpus", "env", "disk_mb", "user", "workdir", "network", "trust_pem")
"""What an archive's manifest carries of its runtime record, for a worker that adopts it."""
UNMOUNT_TRIES = 50  # x 0.1 s: the discarded container's gofer may hold the root filesystem briefly


def disk_bytes(path: str) -> int:
    """Bytes a file or tree really takes on disk (allocated blocks; holes do not count)."""
    if os.path.isfile(path):
        return os.stat(path).st_blocks * 512
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


class Archiver:
    def __init__(
        self,
        runtimes: RuntimeStore,
        store: objectstore.ObjectStore,
        pending: str | None = None,
        *,
        share_layers: bool = False,
    ):
        self.runtimes = runtimes
        self.store = store
        self.share_layers = share_layers
        self.store_info: typing.Callable[[str, str], typing.Any] | None = None
        """(kind, name) -> the store's StoreInfo: pinned in the manifest (set by the worker)."""
        """Whether the store may be read by other workers (S3, or an ATOLL_ARCHIVE_DIR set
        explicitly): each archive then publishes its template layers too, so another worker can
        adopt it (worker.images.layerpack)."""
        self.pending = archive_gc.PendingRemovals(
            pending or os.path.join(os.path.dirname(runtimes.root), archive_gc.JOURNAL)
        )
        """Removals the store refused, retried by worker.runtimes.archive_gc (`<home>/archive-removals.json`)."""
        self.holder = runtimes.install_id
        """This installation's id, named in the manifests of its archives: only the holder removes one."""
        self.store_failed = False
        """Whether the last archive failed because of the store (down, refusing): a caller that
        archives many in a row stops until later."""

    def _p(self, rt: Runtime, *parts: str) -> str:
        return self.runtimes.path(rt.sandbox_id, *parts)

    # ---- the layers ---------------------------------------------------------------------------
    async def _unmount_layers(self, rt: Runtime) -> None:
        """Unmount the root filesystem and the upper image, not lazily: the ext4 image must be
        written out and at rest before it is copied."""
        for mp in (self._p(rt, "rootfs"), self._p(rt, "upper")):
            for _ in range(UNMOUNT_TRIES):
                if not storage.is_mounted(mp):
                    break
                code, _, _ = await hostcmd.run("umount", mp, check=False)
                if code == 0:
                    break
                await asyncio.sleep(0.1)
            else:
                raise errors.SandboxBusy(
                    f"{mp} is still in use (the checkpointed container is being removed)"
                )
        # Unmounted here is not unmounted everywhere: a mount namespace runsc made (a private copy of
        # these mounts) may still hold the ext4 filesystem, unflushed, until its last process is
        # gone. The loop device (autoclear) is detached only once the filesystem is released.
        image = self._p(rt, "upper.img")
        for i in range(UNMOUNT_TRIES * 2):
            code, out, _ = await hostcmd.run("losetup", "-j", image, check=False)
            if code == 0 and not out.strip():
                if i:
                    log.info("the upper image was released %.1f s after its unmount", i * 0.1)
                return
            await asyncio.sleep(0.1)
        raise errors.SandboxBusy(f"{image} is still attached to a loop device (mounted in another namespace)")

    async def _mount_layers(self, rt: Runtime) -> None:
        await storage.create_upper(self._p(rt, "upper.img"), self._p(rt, "upper"), rt.disk_mb)
        layers.mark_used(rt.lower)
        await storage.mount_rootfs(rt.lower, self._p(rt, "upper"), self._p(rt, "rootfs"))

    # ---- archive ------------------------------------------------------------------------------
    async def archive(self, rt: Runtime) -> str | None:
        """Move a checkpointed sandbox to the store; None when archived, else why it stays on disk."""
        sid = rt.sandbox_id
        if not rt.lower:
            return "kept in the disk tier: the sandbox was made by an earlier atoll that did not record its layers"
        t0 = time.perf_counter()
        try:
            await self._unmount_layers(rt)
        except errors.SandboxBusy as e:
            await self._mount_layers(rt)
            return f"kept in the disk tier: {e.message}; the archive is tried again later"
        self.store_failed = False
        rt.archive_key = archive.object_key(sid, rt.generation)
        rt.archive_kept = False  # this archive is current; a kept older one is an orphan now
        self.pending.discard(sid, rt.archive_key)  # a removal owed for this very key must not follow
        self.runtimes.advance(rt, Step.BEGIN_ARCHIVE)
        before = disk_bytes(self._p(rt, "snapshot")) + disk_bytes(self._p(rt, "upper.img"))
        man = archive.ArchiveManifest(
            sandbox_id=sid,
            generation=rt.generation,
            key=rt.archive_key,
            size=0,
            sha256="",
            runsc=f"{snapshots.RUNSC_VERSION} {runsc.binary_identity()}",
            runtime_key=rt.runtime_key,
            template=rt.template,
            build_id=rt.build_id,
            mounts=[self._mount_state(m) for m in rt.mounts],
            runtime={k: getattr(rt, k) for k in RUNTIME_FIELDS},
            holder=self.holder,
            store=self.store.name,
            created_at=time.time(),
        )
        try:
            if self.share_layers:
                man.layers = await self._publish_layers(rt)
            man = await archive.upload(self.store, self.runtimes.dir(sid), man)
        except BaseException as e:
            # nothing is lost: the snapshot and the upper image are still here
            await asyncio.shield(self._abort(rt))
            if isinstance(e, objectstore.StoreError):
                self.store_failed = True
                log.warning("sandbox.archive.failed: %s", e, extra={"sandbox_id": sid})
                return f"kept in the disk tier: {e}; the archive is tried again later"
            raise
        self.runtimes.advance(rt, Step.COMMIT_ARCHIVE)
        self._drop_local(rt)
        log.info(
            "sandbox.archive.complete: %d bytes on disk freed, %d bytes stored (%d before compression) in %.0f ms",
            before,
            man.size,
            man.raw_bytes,
            (time.perf_counter() - t0) * 1000,
            extra={"sandbox_id": sid, "store": self.store.name},
        )
        return None

    def _mount_state(self, m: dict) -> dict:
        """A mount as the manifest pins it: with its store's state when archived (size, use,
        backend) — the volume itself stays where it is (worker.service.node sets `store_info`)."""
        out = dict(m)
        if self.store_info is not None:
            try:
                info = self.store_info(m["kind"], m["name"])
                out["state"] = {"size_mb": info.size_mb, "used_mb": info.used_mb, "backend": info.backend}
            except Exception as e:  # noqa: BLE001 - the pin is informative; the archive goes on
                out["state"] = {"error": str(e)[:200]}
        return out

    async def _publish_layers(self, rt: Runtime) -> list[dict]:
        """Publish the sandbox's template layers beside its archive: their `{key, instance}`, or []
        when they cannot be (it then resumes only on this worker). StoreError: the store failed."""
        try:
            refs = await asyncio.to_thread(layerpack.refs_of, rt.lower)
            if refs is None:
                log.warning(
                    "sandbox.archive: its root file system is not made of layers; only this worker can resume it",
                    extra={"sandbox_id": rt.sandbox_id},
                )
                return []
            await layerpack.publish(self.store, refs, self.runtimes.dir(rt.sandbox_id))
        except (OSError, layerpack.LayerUnavailable) as e:
            log.warning(
                "sandbox.archive: its layers could not be published (%s); only this worker can resume it",
                e,
                extra={"sandbox_id": rt.sandbox_id},
            )
            return []
        return [{"key": r["key"], "instance": r["instance"]} for r in refs]

    async def _abort(self, rt: Runtime) -> None:
        archive.drop_leftovers(self.runtimes.dir(rt.sandbox_id))
        await self._mount_layers(rt)
        self.runtimes.advance(rt, Step.ABORT_ARCHIVE)

    def _drop_local(self, rt: Runtime) -> None:
        shutil.rmtree(self._p(rt, "snapshot"), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._p(rt, "upper.img"))

    # ---- unarchive ----------------------------------------------------------------------------
    async def unarchive(self, rt: Runtime, keep_archive: bool = False) -> None:
        """Bring an archived sandbox back onto this disk (checkpointed); see the module doc.
        `keep_archive`: its archive stays in the store (the control plane's `on_worker_lost:
        "restore"` restores it from there elsewhere should this worker be lost)."""
        sid = rt.sandbox_id
        d = self.runtimes.dir(sid)
        t0 = time.perf_counter()
        parts: dict[str, float] = {}
        try:
            man = archive.local_manifest(d) or await archive.fetch_manifest(self.store, sid, d)
            parts["manifest"] = (time.perf_counter() - t0) * 1000
            if man.sandbox_id != sid:
                raise archive.ArchiveDamaged(f"the archive manifest of sandbox {sid} names {man.sandbox_id}")
            if man.store and man.store != self.store.name:
                raise errors.ResumeFailed(
                    f"sandbox {sid} was archived in {man.store}, and this worker's archive store is now "
                    f"{self.store.name}; start the worker with that store again (ATOLL_S3_* / "
                    "ATOLL_ARCHIVE_DIR) to resume it — it stays archived"
                )
            parts.update(await archive.download(self.store, d, man))
        except (archive.ArchiveDamaged, archive.ArchiveMissing) as e:
            cause = f"the archived snapshot of sandbox {sid} cannot be restored: {e}"
            log.error("sandbox.unarchive.failed: %s", cause, extra={"sandbox_id": sid})
            self.runtimes.fail(rt, cause)
            # the sandbox is failed (its memory is gone): 409 sandbox_failed, not a 5xx
            raise errors.SandboxDied(cause + "; delete the sandbox (its memory is not restored)") from None
        except objectstore.StoreError as e:
            raise errors.ResumeFailed(
                f"sandbox {sid} is archived and its object store failed: {e}; it stays archived, retry the call",
            ) from None
        t = time.perf_counter()
        await self._mount_layers(rt)
        self.runtimes.advance(rt, Step.UNARCHIVED)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(d, archive.LOCAL_MANIFEST))
        parts["layers"] = (time.perf_counter() - t) * 1000
        # the archive stays in the store until the sandbox runs again (`drop_stale`, after the
        # restore): a worker killed before that leaves a whole archive, the copy the control plane's
        # record (archive tier) names and another worker can adopt
        rt.archive_key = man.key
        rt.archive_kept = keep_archive
        self.runtimes.save(rt)
        log.info(
            "sandbox.unarchive.complete in %.0f ms (%d bytes; %s)",
            (time.perf_counter() - t0) * 1000,
            man.size,
            ", ".join(f"{k} {v:.0f}" for k, v in parts.items()),
            extra={"sandbox_id": sid},
        )

    async def drop_stale(self, rt: Runtime) -> None:
        """The sandbox runs again after an unarchive: its archive is stale (a later archive writes
        a new one) — unless the resume asked to keep it (`archive_kept`). Removed now, under the
        sandbox's lock, so that it can never race a new archive's upload; a store that fails here
        leaves the removal in the journal (retried by the garbage loop)."""
        if rt.archive_kept:
            return
        await self.remove(rt.sandbox_id, rt.archive_key)
        rt.archive_key = ""
        with contextlib.suppress(OSError):
            self.runtimes.save(rt)

    async def remove(self, sid: str, archive_key: str) -> bool:
        """Delete a sandbox's archive (its delete), if it ever had one: the object `archive_key`
        and the store's manifest if it names that object (archive.remove: never what another
        worker wrote since). A store that fails records the removal in the journal, which the
        garbage loop retries; returns whether it was done now. Called under the sandbox's lock."""
        if not archive_key:
            return True
        try:
            n = await archive.remove(self.store, sid, archive_key, self.holder)
        except objectstore.StoreError as e:
            self.pending.add(sid, archive_key)
            log.warning(
                "sandbox.archive.removal_pending: %s; retried until the store takes it",
                e,
                extra={"sandbox_id": sid, "key": archive_key},
            )
            return False
        self.pending.discard(sid, archive_key)
        if n:
            log.info("sandbox.archive.removed: %d object(s)", n, extra={"sandbox_id": sid})
        return True

    # ---- after a restart ----------------------------------------------------------------------
    async def reattach(self, rt: Runtime) -> str | None:
        d = self.runtimes.dir(rt.sandbox_id)
        if rt.phase == Phase.ARCHIVING:
            # the upload was cut short (or finished without its commit): the disk copy is whole
            await self._abort(rt)
            return "an archive cut short by the restart was abandoned; the sandbox stays on disk"
        if rt.phase == Phase.ARCHIVED:
            dropped = archive.drop_leftovers(d)
            await self._unmount_layers(rt)  # a download that had mounted them before the restart
            self._drop_local(rt)
            if archive.local_manifest(d) is None:
                return "archived (its manifest is read from the store at resume)"
            return "a download cut short by the restart was dropped" if dropped else None
        return None
