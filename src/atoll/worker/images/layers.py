"""The one layer cache of templates: one directory per build step, named by the step's content
hash (core.templatespec.step_keys), stacked as overlayfs lower layers above a bottom layer (a
built-in template's root file system, itself a layer here under `<name>-<hash>` made by
worker.images.templates, or an OCI image archive unpacked).

    <template_dir>/layers/<key>/fs          what the step changed (an overlay upper dir: whiteouts
                                            are 0/0 character devices, opaque dirs an xattr)
    <template_dir>/layers/<key>/layer.json  what made it, its size, when, and its instance (a
                                            random id of these very bytes: worker.images.layerpack)

    <template_dir>/layers/<key>/used        touched when it is made and whenever a build, create or
                                            restore stacks it (its mtime is the layer's last use)

A layer is made in `.tmp-<key>-<pid>` and renamed into place when complete, so a crash never leaves
a half layer. Everything that decides about one key holds its flock (`.lock-<key>`): `making`
exclusively, `use` (a cached step, a built-in layer found made) shared while it marks the use.
Layers are shared by every build and every installation using the directory; `remove` (the
garbage collection of worker.images.layer_gc) takes the key's lock exclusively without waiting,
checks again that the layer may go, and renames it to `.trash-…` before deleting it, so a build
never sees half a layer. Called by worker.images.builder, worker.images.templates,
worker.images.layer_gc, and (`mark_used`) worker.runtimes.sandboxes and worker.runtimes.archiving.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
import typing
import uuid

from atoll.core import errors, templatespec
from atoll.worker.host import hostcmd
from atoll.worker.images import ociarchive, rootpath, shim

USED = "used"
TRASH = ".trash-"
FETCHING = ".fetch-"
FETCH_DEBRIS_S = 86400.0

MAX_LAYERS = 60
"""Layers in one stack (the overlay mount's option string must fit a page)."""

# Written into every sandbox's writable layer at create (worker.sandboxes), so a build step's
# copies of them are noise: they are dropped from its layer.
IDENTITY_FILES = ("etc/hosts", "etc/hostname", "etc/resolv.conf")


class LayerStore:
    def __init__(self, template_dir: str):
        self.dir = os.path.join(template_dir, "layers")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key, "fs")

    def exists(self, key: str) -> bool:
        return os.path.exists(os.path.join(self.dir, key, "layer.json"))

    def _lock_fd(self, key: str) -> int:
        return os.open(os.path.join(self.dir, f".lock-{key}"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)

    def keys(self) -> list[str]:
        """The keys of the complete layers in the cache."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if not n.startswith(".") and self.exists(n))

    async def use(self, key: str) -> bool:
        """Whether the layer exists, marking its use when it does (under the key's shared lock, so a
        garbage collection that holds it exclusively either saw this use or removed the layer first)."""
        fd = self._lock_fd(key)
        try:
            try:  # free almost always (a create of a built-in template asks every time): no thread
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # being made (or removed) now: wait for it
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_SH)
            if not self.exists(key):
                return False
            _touch(os.path.join(self.dir, key, USED))
            return True
        finally:
            os.close(fd)

    def last_used(self, key: str) -> float | None:
        """When the layer was last stacked: its `used` marker's mtime (None if the layer is gone). A
        layer without one was made by a version that did not record uses: its last use is unknown,
        so it gets a marker now and its idle time starts now (an upgrade never removes a layer
        that another installation may still be using)."""
        marker = os.path.join(self.dir, key, USED)
        for _ in range(2):
            try:
                return os.stat(marker).st_mtime
            except FileNotFoundError:
                if not self.exists(key):
                    return None
                _touch(marker)
        return None

    def size(self, key: str) -> int:
        try:
            with open(os.path.join(self.dir, key, "layer.json")) as f:
                return int(json.load(f).get("size_bytes") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            return 0

    def remove(self, key: str, may_go: typing.Callable[[], bool]) -> bool:
        """Remove the layer if its lock is free now and `may_go()` still says so under it: renamed to
        `.trash-<key>-…` (one rename: a build sees the whole layer or none), then deleted. Returns
        whether it was removed. Blocking: run it in a thread."""
        fd = self._lock_fd(key)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # being made or used right now
            if not self.exists(key) or not may_go():
                return False
            trash = os.path.join(self.dir, f"{TRASH}{key}-{os.getpid()}-{time.monotonic_ns()}")
            os.rename(os.path.join(self.dir, key), trash)
        finally:
            os.close(fd)  # `.lock-<key>` stays: unlinked, two holders could lock two different files
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def sweep_debris(self) -> list[str]:
        """Remove what a crash left: `.trash-*` directories (a removal cut short), `.tmp-<key>-<pid>`
        directories whose key's lock is free (no make of that key is in progress anywhere), and
        `.fetch-*` directories of layer downloads older than a day. Blocking: run it in a thread.
        Returns the paths removed."""
        out: list[str] = []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return out
        for name in names:
            path = os.path.join(self.dir, name)
            if name.startswith(TRASH):
                shutil.rmtree(path, ignore_errors=True)
                out.append(path)
            elif name.startswith(FETCHING) and _older_than(path, FETCH_DEBRIS_S):
                # a download of worker.images.layerpack cut short (one takes seconds)
                shutil.rmtree(path, ignore_errors=True)
                out.append(path)
            elif name.startswith(".tmp-") and "-" in name[5:]:
                fd = self._lock_fd(name[5:].rsplit("-", 1)[0])
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    shutil.rmtree(path, ignore_errors=True)  # under the lock: no make starts meanwhile
                    out.append(path)
                except BlockingIOError:
                    continue
                finally:
                    os.close(fd)
        return out

    @contextlib.asynccontextmanager
    async def making(self, key: str) -> typing.AsyncIterator[str | None]:
        """Hold the key's lock; yields a fresh temporary fs dir to fill, or None when the layer
        exists already (made meanwhile by another build; its use is marked). `commit` makes the
        filled dir the layer."""
        fd = self._lock_fd(key)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            if self.exists(key):
                _touch(os.path.join(self.dir, key, USED))
                yield None
                return
            tmp = os.path.join(self.dir, f".tmp-{key}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "fs"))
            os.chmod(os.path.join(tmp, "fs"), 0o755)
            try:
                yield os.path.join(tmp, "fs")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # a no-op once committed
        finally:
            os.close(fd)

    def commit(self, key: str, fs: str, what: str, instance: str | None = None) -> None:
        """Make the filled dir `fs` the layer `key`. `instance` names these very bytes (a new
        random one unless they were fetched: worker.images.layerpack)."""
        tmp = os.path.dirname(fs)
        _touch(os.path.join(tmp, USED))  # made is used
        with open(os.path.join(tmp, "layer.json"), "w") as f:
            json.dump(
                {
                    "key": key,
                    "what": what,
                    "size_bytes": _du(fs),
                    "made_at": time.time(),
                    "instance": instance or uuid.uuid4().hex,
                },
                f,
            )
        final = os.path.join(self.dir, key)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    async def bottom_from_archive(
        self, archive: str, log: typing.Callable[[str], None]
    ) -> tuple[str, str, ociarchive.ImageConfig]:
        """The bottom layer of a template FROM an OCI archive: (key, fs path, the image's config).
        Unpacked once per archive content; atoll's compatibility shim and mount point are added.
        A path that holds no readable image archive, whatever the reason, is ociarchive.NoArchive."""
        digest = await asyncio.to_thread(ociarchive.content_digest, archive)
        # the key names the shim too: a changed shim reaches templates built FROM an archive
        key = "oci-" + hashlib.sha256(f"{digest}/{shim.digest()}".encode()).hexdigest()[:24]
        config = await asyncio.to_thread(ociarchive.inspect, archive)
        async with self.making(key) as fs:
            if fs is not None:
                log(f"unpacking {archive} (image {digest[:12]})")
                await asyncio.to_thread(ociarchive.unpack, archive, fs)
                check_real_dirs(fs)  # before anything is written into it on the host
                await shim.install(fs)
                os.makedirs(os.path.join(fs, "opt/atoll"), exist_ok=True)
                self.commit(key, fs, f"FROM oci-archive:{archive}")
            else:
                log(f"CACHED unpacked image {digest[:12]}")
        return key, self.path(key), config

    async def files_layer(
        self, fs: str, items: typing.Sequence[templatespec.FileItem], lower: typing.Sequence[str]
    ) -> list[tuple[str, str]]:
        """Write a files step into the empty layer dir `fs` over the layers `lower` (host paths, top
        first). Each path is resolved first as Docker resolves a COPY destination
        (worker.images.rootpath): the links of its parent directories are followed inside the
        image's root, so `/bin/tool` over `/bin -> usr/bin` is written as `usr/bin/tool`; a path
        that is a directory of the image, or a link to one, is refused. Returns the (path, real
        path) of each item written elsewhere than its own path.

        Symbolic links are written as links and never followed on the host: each write opens its
        directory component by component with O_NOFOLLOW, and a link that replaces a directory atoll
        writes into (/etc, /usr, /opt) is refused. A directory the layer needs takes the mode and
        owner the image's has (`/tmp` stays 1777, `/root` 0700)."""

        def write() -> list[tuple[str, str]]:
            view = rootpath.View(fs, lower)
            moved = []
            for item in items:
                parent_parts, name = rootpath.destination(view, item.path)
                real = rootpath.show((*parent_parts, name))
                if real != item.path:
                    moved.append((item.path, real))
                parent = _make_dirs(fs, parent_parts, item.path, view.lower_dir)
                try:
                    try:  # what this step wrote there before (another path resolving here): the last wins
                        os.unlink(name, dir_fd=parent)
                    except FileNotFoundError:
                        pass
                    except IsADirectoryError:
                        raise errors.InvalidRequest(
                            f"files: {item.path} is a directory of an earlier file's path"
                        ) from None
                    if item.link is not None:
                        os.symlink(item.link, name, dir_fd=parent)
                        continue
                    fd = os.open(
                        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=parent
                    )
                    with os.fdopen(fd, "wb") as f:
                        f.write(item.data)
                        os.fchmod(f.fileno(), item.mode)
                finally:
                    os.close(parent)
            check_real_dirs(fs)
            return moved

        return await asyncio.to_thread(write)

    async def from_upper(self, fs: str, upper: str) -> None:
        """Copy a build sandbox's writable layer (an overlay upper dir, whiteouts and xattrs kept)
        into the empty layer dir `fs`, without the files every sandbox gets its own of.

        What the sandbox wrote is hostile: `cp -a` copies symlinks as symlinks (into a fresh
        directory, so nothing is written through one), and nothing here follows one afterwards —
        a step that replaced a directory atoll writes into (`/etc`, `/usr`, `/opt`) by a symlink
        is refused (it would point the next host-side write outside the layer)."""
        await hostcmd.run("cp", "-a", "--reflink=auto", upper + "/.", fs + "/", timeout=3600)
        check_real_dirs(fs)
        etc = open_dir(fs, "etc")
        if etc is not None:
            try:
                for rel in IDENTITY_FILES:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(rel.split("/", 1)[1], dir_fd=etc)
            finally:
                os.close(etc)


# Directories atoll itself writes into, on the host, in a layer or a sandbox's root file system
# (identity files, the CA, the compatibility shim, the agent's mount point): never symlinks.
REAL_DIRS = (
    "etc",
    "usr",
    "usr/lib",
    "usr/lib/atoll",
    "opt",
    "opt/atoll",
    "etc/atoll",
    "etc/ssl",
    "etc/ssl/certs",
)


def _make_dirs(
    root: str,
    parts: typing.Sequence[str],
    what: str,
    below: typing.Callable[[tuple[str, ...]], rootpath.Entry | None],
) -> int:
    """A descriptor of `root/parts`, its missing directories made, walked component by component
    without following a symlink (mkdir -p would write through one). A directory made takes the mode
    and owner of the one `below` shows at its path (the image's), else 0755 root."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    for i, part in enumerate(parts):
        try:
            made = False
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
                made = True
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as e:
            os.close(fd)
            raise errors.InvalidRequest(
                f"files: {what} is below {part!r}, which is a symbolic link or a file in this step's "
                f"layer ({e.strerror}); nothing is written through a link on the host"
            ) from None
        os.close(fd)
        fd = nxt
        if made:
            image = below(tuple(parts[: i + 1]))
            st = os.fstat(fd)
            if image is not None and (image.uid, image.gid) != (st.st_uid, st.st_gid):
                os.fchown(fd, image.uid, image.gid)  # before the mode: a chown may drop set-id bits
            os.fchmod(fd, image.mode if image is not None else 0o755)
    return fd


def open_dir(root: str, rel: str) -> int | None:
    """A descriptor of `root/rel` opened without following any symlink on the way, or None when
    it does not exist. Raises BadLayer when a component is a symlink or not a directory."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in rel.split("/"):
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                return None
            except (NotADirectoryError, OSError) as e:
                os.close(fd)
                raise BadLayer(f"/{rel} is a symlink or not a directory ({e.strerror})") from None
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def check_real_dirs(root: str) -> None:
    """Refuse a layer in which a directory atoll writes into is a symlink (or a file)."""
    for rel in REAL_DIRS:
        fd = open_dir(root, rel)
        if fd is not None:
            os.close(fd)


class BadLayer(errors.InvalidRequest):
    """A build step or an image made a directory atoll writes into a symlink."""

    def __init__(self, what: str):
        super().__init__(
            f"the template's {what}; atoll writes files there (identity, CA, its compatibility "
            "library) and needs real directories — keep them directories (a symlink inside them is fine)"
        )


def stack(layers_top_first: typing.Sequence[str]) -> str:
    """The overlay `lowerdir=` value: the top layer first."""
    if len(layers_top_first) > MAX_LAYERS:
        raise errors.InvalidRequest(
            f"the template has {len(layers_top_first)} layers, more than {MAX_LAYERS}; merge steps "
            "(several commands in one run step, one files step)"
        )
    return ":".join(layers_top_first)


def find_file(layers_top_first: typing.Sequence[str], rel: str) -> str | None:
    """The host path of `rel` as the stack shows it (the topmost layer holding it), or None. Only
    whiteouts of the file itself are honoured (enough for the few files asked about)."""
    for layer in layers_top_first:
        p = os.path.join(layer, rel)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            return None
        return p
    return None


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime > seconds
    except FileNotFoundError:
        return False


def _touch(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # a layer removed meanwhile: nothing to mark
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def mark_used(lower: str) -> None:
    """Mark the use of every cached layer in an overlay `lowerdir=` stack (host paths, top first):
    called whenever a sandbox's root file system is mounted (create, restore, unarchive, build)."""
    for p in lower.split(":"):
        if os.path.basename(p) == "fs" and os.path.exists(os.path.join(os.path.dirname(p), "layer.json")):
            _touch(os.path.join(os.path.dirname(p), USED))


def _du(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(dirpath, fn)).st_size
            except OSError:
                pass
    return total
