"""The archive tier's format: one checkpointed sandbox as one zstd-compressed tar in an object store.

An archive holds a sandbox's committed disk-tier snapshot (`snapshot/`: runsc's image and its
manifest) and its writable layer (the ext4 image `upper.img`, unmounted by the caller first). The
upper image is sparse (its size is the disk quota, mostly holes), so only its data extents are
stored (member `upper.img.data`, found with SEEK_DATA/SEEK_HOLE) and the manifest lists where they
go; unpacking recreates the holes. The manifest (`ArchiveManifest`, JSON) pins the format version,
the sha256 and size of the compressed object and of every member, the runsc version, the runtime
key and template the memory was made under, the sizes, and — for another worker to adopt it — its
template's layer stack (published beside it) and its runtime settings.

Upload (`upload`): pack to a local file (hashing as it compresses), put it under a key unique to
the sandbox's generation, check the stored size, then write the manifest — locally (`archive.json`,
fsync'd) and to the store, last: an archive exists only once its manifest does, so an upload cut
short leaves at most an object no manifest names (removed by the next upload, or by
`drop_orphans` in the worker's garbage collection). `remove` deletes only what the caller owns:
the store may be shared by several workers.
Download (`download`): fetch the object into a regular file (runsc restores from a file, never a
stream; not fsync'd: it is read once and deleted), check its size and sha256 against the manifest
while it is unpacked into a staging directory (two threads; every member's sha256 checked too), and
only once both passed move the snapshot and the upper image into place. Any mismatch raises
`ArchiveDamaged`: nothing bad is ever restored.
Called by worker.runtimes.archiving (pause to and resume from the archive tier, delete) and
worker.runtimes.archive_gc (removals retried, orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
import typing
from dataclasses import asdict, dataclass, field

import zstandard

from atoll.worker.host import objectstore

FORMAT = 1
"""Raise it when the archive's layout changes; a worker refuses archives of a format it lacks."""
ZSTD_LEVEL = 3  # runsc images are compressed already: a higher level buys ~nothing (DESIGN.md)
CHUNK = 4 * 1024 * 1024
UPPER = "upper.img"
UPPER_DATA = "upper.img.data"
LOCAL_MANIFEST = "archive.json"
PACKING = "archive.out.tar.zst"
FETCHED = "archive.in.tar.zst"
UNPACKING = "archive.unpack"


class ArchiveDamaged(Exception):
    """The archived object does not match its manifest (size or checksum): never restored."""


class ArchiveMissing(Exception):
    """No archive (manifest or object) of this sandbox in the store."""


@dataclass
class ArchiveManifest:
    sandbox_id: str
    generation: int
    key: str
    """The object's key in the store."""
    size: int
    """Bytes of the compressed object."""
    sha256: str
    members: dict[str, dict] = field(default_factory=dict)
    """name -> {"size", "sha256"} of every tar member."""
    upper_size: int = 0
    """The upper image's apparent size (its disk quota)."""
    upper_extents: list[list[int]] = field(default_factory=list)
    """[offset, length] of the upper image's data extents, in the order `upper.img.data` holds them."""
    runsc: str = ""
    runtime_key: str = ""
    template: str = ""
    build_id: str = ""
    mounts: list[dict] = field(default_factory=list)
    """The volumes and drives the sandbox mounts (`{kind, name, path, read_only}`): they stay on
    their worker (or filer) while it is archived; its restore's bundle binds them again."""
    layers: list[dict] = field(default_factory=list)
    """The root file system's layer stack, top first, as `{key, instance}` published in the same
    store (worker.images.layerpack): another worker restores onto these very bytes. Empty when the
    store is this worker's own (the embedded local directory): it resumes only here."""
    runtime: dict = field(default_factory=dict)
    """What another worker needs to run it (worker.runtimes.runtime.Runtime's memory_mb, cpus,
    env, disk_mb, user, workdir, network, trust_pem)."""
    holder: str = ""
    """The installation id of the worker that holds the sandbox: the one that archived it, or the
    one that adopted it since (worker.runtimes.adoption rewrites the manifest). Only the holder
    removes the archive ("" in manifests of earlier versions: whoever's record names `key`)."""
    store: str = ""
    """The store the object was put in (ObjectStore.name): a worker restarted with another store
    refuses to look for it elsewhere (retryable) instead of calling it lost ("" in earlier ones)."""
    raw_bytes: int = 0
    """Bytes before compression (the members' sizes)."""
    created_at: float = 0.0
    format: int = FORMAT

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str | bytes) -> ArchiveManifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ArchiveDamaged(
                f"archive format {data.get('format')!r} is not {FORMAT} (made by another version)"
            )
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def prefix(sid: str) -> str:
    return f"sandboxes/{sid}/"


def object_key(sid: str, generation: int) -> str:
    return f"{prefix(sid)}{generation}.tar.zst"


def manifest_key(sid: str) -> str:
    return f"{prefix(sid)}manifest.json"


# ---- packing --------------------------------------------------------------------------------------


def data_extents(path: str) -> list[list[int]]:
    """[offset, length] of the parts of a (sparse) file that hold data."""
    out: list[list[int]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size
        pos = 0
        while pos < end:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            out.append([start, stop - start])
            pos = stop
    finally:
        os.close(fd)
    return out


class _Extents(io.RawIOBase):
    """Reads a file's listed extents back to back (the member `upper.img.data`), hashing them."""

    def __init__(self, path: str, extents: list[list[int]]):
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._todo = [list(e) for e in extents]
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: typing.Any) -> int:
        while self._todo and self._todo[0][1] == 0:
            self._todo.pop(0)
        if not self._todo:
            return 0
        off, left = self._todo[0]
        self._f.seek(off)
        data = self._f.read(min(len(b), left, CHUNK))
        if not data:
            raise ArchiveDamaged(f"{self._f.name} shrank while it was packed")
        b[: len(data)] = data
        self._todo[0] = [off + len(data), left - len(data)]
        self.sha.update(data)
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


class _Hashing(io.RawIOBase):
    def __init__(self, f: typing.BinaryIO):
        self._f = f
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: typing.Any) -> int:
        data = self._f.read(len(b))
        b[: len(data)] = data
        self.sha.update(data)
        return len(data)


class _HashingWriter:
    def __init__(self, f: typing.BinaryIO):
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._f.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self._f.flush()


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = size, 0o600, int(time.time())
    return ti


def pack(sandbox_dir: str, out: str, man: ArchiveManifest) -> ArchiveManifest:
    """Write `sandbox_dir`'s snapshot/ and upper.img (data extents) as one zstd tar to `out`, and
    fill `man`'s members, sizes and checksum. Blocking: run it in a thread."""
    snap = os.path.join(sandbox_dir, "snapshot")
    upper = os.path.join(sandbox_dir, UPPER)
    names = sorted(n for n in os.listdir(snap) if os.path.isfile(os.path.join(snap, n)))
    man.upper_size = os.path.getsize(upper)
    man.upper_extents = data_extents(upper)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
    with open(out, "wb") as raw:
        sink = _HashingWriter(raw)
        with cctx.stream_writer(sink, closefd=False) as z, tarfile.open(fileobj=z, mode="w|") as tar:
            for n in names:
                path = os.path.join(snap, n)
                with open(path, "rb") as f:
                    src = _Hashing(f)
                    size = os.fstat(f.fileno()).st_size
                    tar.addfile(_tarinfo(f"snapshot/{n}", size), io.BufferedReader(src, CHUNK))
                man.members[f"snapshot/{n}"] = {"size": size, "sha256": src.sha.hexdigest()}
            data_size = sum(length for _, length in man.upper_extents)
            ext = _Extents(upper, man.upper_extents)
            with ext:
                tar.addfile(_tarinfo(UPPER_DATA, data_size), io.BufferedReader(ext, CHUNK))
            man.members[UPPER_DATA] = {"size": data_size, "sha256": ext.sha.hexdigest()}
        raw.flush()
        os.fsync(raw.fileno())
    man.size, man.sha256 = sink.size, sink.sha.hexdigest()
    man.raw_bytes = sum(m["size"] for m in man.members.values())
    return man


# ---- unpacking ------------------------------------------------------------------------------------


def file_sha256(path: str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def verify_object(path: str, man: ArchiveManifest) -> None:
    """The fetched object's size and sha256 against the manifest (before anything is unpacked)."""
    digest, size = file_sha256(path)
    if size != man.size or digest != man.sha256:
        raise ArchiveDamaged(
            f"the archive of sandbox {man.sandbox_id} ({man.key}) is damaged: {size} bytes with sha256 "
            f"{digest[:16]}…, its manifest says {man.size} bytes with sha256 {man.sha256[:16]}…"
        )


def unpack(path: str, dest: str, man: ArchiveManifest) -> None:
    """Unpack a verified object into `dest` (snapshot/ and a sparse upper.img), checking every
    member against the manifest. Blocking: run it in a thread."""
    os.makedirs(os.path.join(dest, "snapshot"), mode=0o700, exist_ok=True)
    seen: set[str] = set()
    with open(path, "rb") as raw:
        z = zstandard.ZstdDecompressor().stream_reader(raw)
        with tarfile.open(fileobj=z, mode="r|") as tar:
            for ti in tar:
                want = man.members.get(ti.name)
                if want is None or not ti.isfile() or ti.name in seen or ti.size != want["size"]:
                    raise ArchiveDamaged(
                        f"the archive of sandbox {man.sandbox_id} has an unexpected member {ti.name!r}"
                    )
                seen.add(ti.name)
                src = tar.extractfile(ti)
                assert src is not None
                h = hashlib.sha256()
                if ti.name == UPPER_DATA:
                    _write_extents(src, os.path.join(dest, UPPER), man, h)
                else:
                    target = os.path.join(dest, "snapshot", os.path.basename(ti.name))
                    with open(target, "wb") as out:
                        while chunk := src.read(CHUNK):
                            h.update(chunk)
                            out.write(chunk)
                if h.hexdigest() != want["sha256"]:
                    raise ArchiveDamaged(
                        f"member {ti.name} of the archive of sandbox {man.sandbox_id} does not match its sha256"
                    )
    if seen != set(man.members):
        raise ArchiveDamaged(
            f"the archive of sandbox {man.sandbox_id} lacks {', '.join(sorted(set(man.members) - seen))}"
        )


def _write_extents(src: typing.BinaryIO, target: str, man: ArchiveManifest, h: typing.Any) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.truncate(man.upper_size)  # all holes, then the data where it was
        for off, length in man.upper_extents:
            out.seek(off)
            while length:
                chunk = src.read(min(CHUNK, length))
                if not chunk:
                    raise ArchiveDamaged(
                        f"the upper image in the archive of sandbox {man.sandbox_id} is short"
                    )
                h.update(chunk)
                out.write(chunk)
                length -= len(chunk)


# ---- the store ------------------------------------------------------------------------------------


def _write_json(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_local_manifest(sandbox_dir: str, man: ArchiveManifest) -> None:
    """Keep `man` in `sandbox_dir` (fsync'd): an adopted sandbox's resume reads it from here."""
    _write_json(os.path.join(sandbox_dir, LOCAL_MANIFEST), man.dumps())


async def claim(
    store: objectstore.ObjectStore, sandbox_dir: str, man: ArchiveManifest, holder: str
) -> ArchiveManifest:
    """Name `holder` (an installation id) in the sandbox's manifest, in the store and in
    `sandbox_dir`: the worker that adopted the sandbox takes its archive over, and the worker it
    came from (should it come back with a stale record) no longer removes any of it."""
    man = dataclasses.replace(man, holder=holder)
    new = os.path.join(sandbox_dir, LOCAL_MANIFEST + ".new")
    _write_json(new, man.dumps())
    try:
        await store.put_file(manifest_key(man.sandbox_id), new)
        os.replace(new, os.path.join(sandbox_dir, LOCAL_MANIFEST))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(new)
    return man


def local_manifest(sandbox_dir: str) -> ArchiveManifest | None:
    """The manifest this worker wrote when it archived the sandbox (None if it did not)."""
    try:
        with open(os.path.join(sandbox_dir, LOCAL_MANIFEST)) as f:
            return ArchiveManifest.loads(f.read())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ArchiveDamaged(f"the archive manifest in {sandbox_dir} is unreadable: {e}") from None


async def upload(store: objectstore.ObjectStore, sandbox_dir: str, man: ArchiveManifest) -> ArchiveManifest:
    """Pack and upload; returns the manifest once the object is stored, checked and named by a
    manifest in the store (and in `sandbox_dir`). StoreError/StoreUnavailable when it is not."""
    out = os.path.join(sandbox_dir, PACKING)
    try:
        man = await asyncio.to_thread(pack, sandbox_dir, out, man)
        await objectstore.put_checked(store, man.key, out, man.size)
        _write_json(os.path.join(sandbox_dir, LOCAL_MANIFEST + ".new"), man.dumps())
        await store.put_file(manifest_key(man.sandbox_id), os.path.join(sandbox_dir, LOCAL_MANIFEST + ".new"))
        os.replace(
            os.path.join(sandbox_dir, LOCAL_MANIFEST + ".new"), os.path.join(sandbox_dir, LOCAL_MANIFEST)
        )
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(sandbox_dir, LOCAL_MANIFEST + ".new"))
    # objects of earlier archives of this sandbox (an upload cut short, an older generation)
    for key in await store.list(prefix(man.sandbox_id)):
        if key not in (man.key, manifest_key(man.sandbox_id)):
            await store.delete(key)
    return man


async def fetch_manifest(store: objectstore.ObjectStore, sid: str, tmp_dir: str) -> ArchiveManifest:
    path = os.path.join(tmp_dir, "manifest.fetched.json")
    try:
        await store.get_file(manifest_key(sid), path)
        with open(path) as f:
            return ArchiveManifest.loads(f.read())
    except objectstore.ObjectNotFound:
        raise ArchiveMissing(f"sandbox {sid} has no archive in {store.name}") from None
    except (ValueError, TypeError) as e:
        raise ArchiveDamaged(
            f"the archive manifest of sandbox {sid} in {store.name} is unreadable: {e}"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def download(
    store: objectstore.ObjectStore, sandbox_dir: str, man: ArchiveManifest
) -> dict[str, float]:
    """Fetch, verify and unpack the archive into `sandbox_dir` (snapshot/ and upper.img replaced
    only after every check passed). ArchiveDamaged on any mismatch; StoreError when unreachable.
    Returns how long each part took (ms: `fetch`, `verify_unpack`, `move`), for the caller's log."""
    fetched = os.path.join(sandbox_dir, FETCHED)
    staging = os.path.join(sandbox_dir, UNPACKING)
    shutil.rmtree(staging, ignore_errors=True)
    parts: dict[str, float] = {}
    t = time.perf_counter()
    try:
        try:
            # read once and deleted below: no fsync (a crash before the unpack fetches it again)
            await store.get_file(man.key, fetched, durable=False)
        except objectstore.ObjectNotFound:
            raise ArchiveMissing(
                f"the archive object {man.key} of sandbox {man.sandbox_id} is gone from {store.name}"
            ) from None
        parts["fetch"], t = (time.perf_counter() - t) * 1000, time.perf_counter()
        await _verify_and_unpack(fetched, staging, man)
        parts["verify_unpack"], t = (time.perf_counter() - t) * 1000, time.perf_counter()
        final_snap = os.path.join(sandbox_dir, "snapshot")
        shutil.rmtree(final_snap, ignore_errors=True)
        os.replace(os.path.join(staging, UPPER), os.path.join(sandbox_dir, UPPER))
        os.replace(os.path.join(staging, "snapshot"), final_snap)
        parts["move"] = (time.perf_counter() - t) * 1000
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fetched)
        shutil.rmtree(staging, ignore_errors=True)
    return parts


async def _verify_and_unpack(fetched: str, staging: str, man: ArchiveManifest) -> None:
    """The object's size and sha256 checked (`verify_object`) while it is unpacked into
    `staging` (`unpack`, which checks every member): two threads reading the same file, as the
    disk-tier restore checks its image beside `runsc restore`. The object's verdict comes first:
    a damaged object is refused as such even when its unpacking failed on the damage; the caller
    moves nothing into place unless both passed."""
    verify = asyncio.ensure_future(asyncio.to_thread(verify_object, fetched, man))
    try:
        await asyncio.to_thread(unpack, fetched, staging, man)
    except BaseException:
        await asyncio.wait([verify])
        damaged = None if verify.cancelled() else verify.exception()
        if isinstance(damaged, ArchiveDamaged):
            raise damaged from None
        raise
    await verify


def drop_leftovers(sandbox_dir: str) -> list[str]:
    """Remove what an archive or download cut short left in `sandbox_dir` (a restarted worker):
    the packed or fetched object and their temporary files, the unpacking directory."""
    out = []
    prefixes = (PACKING, FETCHED, UNPACKING, LOCAL_MANIFEST + ".new", "manifest.fetched.json")
    for name in os.listdir(sandbox_dir):
        if not name.startswith(prefixes):
            continue
        path = os.path.join(sandbox_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        out.append(path)
    return out


async def _store_manifest(store: objectstore.ObjectStore, sid: str) -> ArchiveManifest | None:
    """The manifest the store holds for `sid` (None when it has none). ArchiveDamaged when it
    is unreadable; StoreError when the store fails."""
    with tempfile.TemporaryDirectory(prefix="atoll-manifest-") as tmp:
        try:
            return await fetch_manifest(store, sid, tmp)
        except ArchiveMissing:
            return None


def _is_callers(man: ArchiveManifest | None, key: str, holder: str | None) -> bool:
    """Whether the store's manifest is the caller's own: it names the caller's object, and no
    other worker has claimed the sandbox since (adopted it)."""
    return man is not None and man.key == key and not (holder and man.holder and man.holder != holder)


async def remove(
    store: objectstore.ObjectStore, sid: str, key: str | None = None, holder: str | None = None
) -> int:
    """Delete the sandbox's archive; returns how many objects were deleted.

    With `key` (the object the caller's own manifest names, `Runtime.archive_key`) only what the
    caller owns goes. The store may be shared by several workers, and another one may have adopted
    the sandbox since (its manifest then names that worker as `holder`) or archived it anew (its
    manifest names another object): what that worker's manifest names is left to it. So: when the
    store's manifest is the caller's (it names `key`, and `holder` — the caller's installation id —
    unless it names none), the objects of uploads cut short under the prefix, the manifest and then
    `key` go (the manifest before the object it names: no half archive is ever named); when another
    worker holds `key`, nothing; else (another object named, or no manifest) `key` alone. Without
    `key`, every object under the sandbox's prefix goes (a store only this caller uses). StoreError
    when the store fails (what is left is still consistent: a retry deletes the rest)."""
    if key is None:
        keys = await store.list(prefix(sid))
        keys.sort(key=lambda k: k != manifest_key(sid))
        for k in keys:
            await store.delete(k)
        return len(keys)
    objectstore.check_key(key)
    if not key.startswith(prefix(sid)) or key == manifest_key(sid):
        raise ValueError(f"{key!r} is not an archive object of sandbox {sid}")
    n = 0
    try:
        man = await _store_manifest(store, sid)
    except ArchiveDamaged:
        return 0  # unreadable: whose the archive is cannot be told, so all of it stays
    if man is not None and man.key == key and not _is_callers(man, key, holder):
        return 0  # adopted by another worker: its archive now
    if _is_callers(man, key, holder):
        n += len(await drop_orphans(store, sid, key, holder, man))
        await store.delete(manifest_key(sid))
        n += 1
    try:
        await store.size(key)
    except objectstore.ObjectNotFound:
        return n
    await store.delete(key)
    return n + 1


async def drop_orphans(
    store: objectstore.ObjectStore,
    sid: str,
    key: str,
    holder: str | None = None,
    man: ArchiveManifest | None = None,
) -> list[str]:
    """Objects under the sandbox's prefix that its manifest does not name (an upload cut short),
    removed, when the store's manifest (`man`, read from the store when not given) is the caller's:
    it names `key` and no other holder than `holder`. Nothing is removed when the manifest names
    another object or holder, or is missing or unreadable (the sandbox may be another worker's
    now). Returns the keys removed."""
    if man is None:
        try:
            man = await _store_manifest(store, sid)
        except ArchiveDamaged:
            return []
    if not _is_callers(man, key, holder):
        return []
    out = []
    for k in await store.list(prefix(sid)):
        if k not in (key, manifest_key(sid)):
            await store.delete(k)
            out.append(k)
    return out
