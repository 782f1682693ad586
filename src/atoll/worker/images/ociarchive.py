"""Image archives: unpack a `docker save` tarball or an OCI image-layout tarball into a root filesystem.

A template may start `FROM oci-archive:/path/on/the/worker.tar`. `inspect` reads such an archive's
image config (and checks that every blob it names is there) without unpacking; `unpack` applies the
image's layers in order into a plain directory, the bottom read-only layer of the template's
overlayfs; `content_digest` is the archive's cache identity. Called by worker.templates when a
template starts FROM oci-archive.

Formats: `docker save` (top-level manifest.json; preferred when an archive is both, as newer docker
save archives are) and the OCI image layout (oci-layout + index.json, as `skopeo copy ...
oci-archive:` or `docker buildx --output type=oci` write it). An image index picks the host's
platform (linux/amd64 on x86_64, linux/arm64 on aarch64), else its first image. Layers may be plain
tar, gzip, bzip2, xz or (when the `zstandard` module is installed) zstd, told apart by magic bytes.

The archive is untrusted and this runs as root on the host, so while unpacking:
- member paths lose leading "/" and "./" (Docker's behaviour) and any `..` component is refused;
- no symlink in `dest` is ever followed: every parent directory is opened with O_NOFOLLOW relative
  to its parent's descriptor, so a member (or a hard link's target, or a whiteout) reached through
  a symlink is refused, wherever that symlink points;
- device nodes and FIFOs are skipped (the sandbox's mounts are nodev anyway);
- file modes, setuid/setgid bits included, and numeric ownership are kept as in the tar (the mount
  is nosuid; ownership only when running as root), mtimes are set;
- the bytes of regular files written are capped by `max_bytes`;
- OCI blobs are checked against their digests and sizes, and every layer's uncompressed stream
  against the config's rootfs.diff_ids (so `content_digest`, which covers the config, identifies
  the unpacked tree for docker save archives too).
Whiteouts follow the OCI image spec: `.wh.NAME` deletes NAME from lower layers, `.wh..wh..opq`
empties its directory of lower layers' entries; neither is written.

Errors: a malformed, damaged or hostile archive raises CorruptArchive (code invalid_request; its
subclass ImageTooLarge for `max_bytes`). Until the path is known to hold an image archive (a
regular file, readable, a tar with manifest.json or index.json at its top) every failure is the
same NoArchive, whatever the cause — a missing path, a directory, a file the worker cannot read,
any other file —, so that a caller learns nothing about which host paths exist; the cause is its
`detail` (logged, never sent). a host failure while writing (disk full, I/O error) raises
errors.RuntimeFailure. A failed unpack leaves `dest` partly filled: the caller unpacks into a
temporary directory and removes it.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import json
import logging
import lzma
import os
import platform
import posixpath
import re
import shutil
import stat
import tarfile
import time
import typing
import zlib
from dataclasses import dataclass

from atoll.core import errors

log = logging.getLogger(__name__)

HOW_TO_MAKE = "make it with `docker save IMAGE -o FILE` or `skopeo copy docker-daemon:IMAGE oci-archive:FILE`"
DEFAULT_MAX_BYTES = 16 * 2**30
MAX_JSON_BYTES = 16 * 2**20  # manifest, index and config documents are read whole
MAX_TRAILING_BYTES = 2**20  # after a layer's end-of-archive marker (tar writers pad to 10 KiB)
MAX_PATH_BYTES = 4096  # PATH_MAX: a longer member path could not be used inside the sandbox
MAX_LINK_HOPS = 16  # symlinks inside the outer archive (docker save links duplicate layers)
MAX_INDEX_DEPTH = 4
IDENTITY_VERSION = b"atoll-ociarchive-1"  # part of content_digest: bump when unpacking changes

INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_DIGEST = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$")
_BLOB_PATH = re.compile(r"^blobs/(sha256|sha512)/([0-9a-f]{64}|[0-9a-f]{128})$")
_LEGACY_CONFIG = re.compile(r"^([0-9a-f]{64})\.json$")  # docker save's <image id>.json
_HOST_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM, errno.EMFILE, errno.ENFILE}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


class CorruptArchive(errors.InvalidRequest):
    """The image archive is malformed, damaged, unsupported or hostile; retrying will not help."""

    code = "invalid_request"

    def __init__(self, archive: str, problem: str, *, fix: str = HOW_TO_MAKE, detail: str | None = None):
        self.archive = archive
        self.problem = problem
        super().__init__(f"image archive {archive}: {problem}; {fix}", detail=detail)


class ImageTooLarge(CorruptArchive):
    """The image unpacks to more than `max_bytes` of file data."""


class NoArchive(CorruptArchive):
    """No image archive can be read at the path: one answer for every cause (`detail` has it)."""

    def __init__(self, archive: str, cause: str):
        super().__init__(
            archive,
            "no docker save or OCI image archive can be read at this path on the worker. A missing "
            "path, one the worker cannot read, and a file that is not such an archive (or is "
            "truncated, or compressed with zstd) all get this same answer, which tells nothing "
            "about the worker's files; the worker's log has the cause",
            fix="copy the archive to the worker (`docker save IMAGE -o FILE` or `skopeo copy "
            "docker-daemon:IMAGE oci-archive:FILE`; a plain, gzip, bzip2 or xz tar) and give its "
            "absolute path",
            detail=f"{archive}: {cause}",
        )


@dataclass(frozen=True)
class ImageConfig:
    env: tuple[tuple[str, str], ...] = ()  # config.Env, "K=V" strings split at the first "="
    workdir: str | None = None  # config.WorkingDir ("" counts as unset)
    user: str | None = None  # config.User ("" counts as unset)
    cmd: tuple[str, ...] = ()  # config.Cmd
    entrypoint: tuple[str, ...] = ()  # config.Entrypoint
    digest: str = ""  # content_digest(archive): sha256 hex over the chosen manifest and config blob


@dataclass(frozen=True)
class _Layer:
    name: str  # member of the outer archive
    digest: str | None  # "sha256:<hex>" the blob must hash to (None: a legacy docker save layer)
    size: int | None  # the blob's size, from its OCI descriptor
    diff_id: str  # "sha256:<hex>" of the uncompressed tar, from the config's rootfs.diff_ids


@dataclass(frozen=True)
class _Image:
    config: ImageConfig
    layers: tuple[_Layer, ...]


def inspect(archive: str) -> ImageConfig:
    """The image's config; checks the archive's structure and that every layer blob is present."""
    with _Outer(archive) as outer:
        return _load(outer).config


def content_digest(archive: str) -> str:
    """A stable identity of the archive's image for caching unpacked trees: sha256 hex over the
    chosen manifest (without RepoTags) and the config blob, not over the whole file."""
    return inspect(archive).digest


def unpack(archive: str, dest: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> ImageConfig:
    """Apply the image's layers in order into `dest` (created, or an existing empty directory)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    started = time.monotonic()
    with _Outer(archive) as outer:
        image = _load(outer)
        try:
            os.makedirs(dest, mode=0o755, exist_ok=True)
            root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise errors.RuntimeFailure(
                f"cannot unpack image archive {archive}: its destination is unusable ({e.strerror})",
                detail=f"{dest}: {e}",
            ) from e
        try:
            if os.listdir(root_fd):
                raise ValueError(f"unpack destination {dest} is not empty; unpack into a new directory")
            os.fchmod(root_fd, 0o755)  # a root file system; a layer's "./" entry may say otherwise
            unpacker = _Unpacker(archive, dest, root_fd, max_bytes)
            for n, layer in enumerate(image.layers, 1):
                unpacker.apply(outer, layer, n)
        finally:
            os.close(root_fd)
    log.info(
        "image archive %s unpacked: %d layers, %d bytes, %d entries skipped, %.1fs",
        archive,
        len(image.layers),
        unpacker.total,
        unpacker.skipped,
        time.monotonic() - started,
    )
    return image.config


# --- the outer archive -------------------------------------------------------------------------


class _Outer:
    """The archive's members by normalized name, read with random access; blobs are never
    extracted to disk."""

    def __init__(self, archive: str):
        self.archive = archive
        # Every failure until the path proves to hold an image archive is NoArchive (see the
        # module docstring): the answer must not tell a missing path from an existing file.
        try:
            st = os.stat(archive)
            if not stat.S_ISREG(st.st_mode):
                raise NoArchive(archive, f"not a regular file (mode {stat.filemode(st.st_mode)})")
            with open(archive, "rb") as f:
                head = f.read(6)
            if head.startswith(b"\x28\xb5\x2f\xfd"):
                raise NoArchive(archive, "zstd-compressed, which is not supported for the archive itself")
            self.tar = tarfile.open(archive, mode="r:*")
        except FileNotFoundError:
            raise NoArchive(archive, "does not exist") from None
        except PermissionError:
            raise NoArchive(archive, "cannot be read (permission denied)") from None
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as e:
            raise NoArchive(archive, f"not a tar archive ({e})") from None
        try:
            members = self.tar.getmembers()
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as e:
            self.tar.close()
            raise NoArchive(archive, f"not a readable tar archive, or truncated ({e})") from None
        self.members: dict[str, tarfile.TarInfo] = {}
        for m in members:
            name = _archive_name(m.name)
            if name:
                self.members[name] = m
        if not (self.has("manifest.json") or self.has("index.json")):
            self.tar.close()
            raise NoArchive(
                archive, "a tar with neither manifest.json (docker save) nor index.json (OCI) at its top"
            )
        compressed = head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00"))
        end = max((m.offset_data + m.size for m in members if m.isreg()), default=0)
        if not compressed and end > st.st_size:
            self.tar.close()
            raise self.corrupt(f"is truncated: it is {st.st_size} bytes, its members need {end}")

    def __enter__(self) -> _Outer:
        return self

    def __exit__(self, *exc) -> None:
        self.tar.close()

    def corrupt(self, problem: str, **kw) -> CorruptArchive:
        return CorruptArchive(self.archive, problem, **kw)

    def has(self, name: str) -> bool:
        return name in self.members

    def find(self, name: str, what: str) -> tarfile.TarInfo:
        """The regular-file member at `name`, following the archive's own (hard and sym) links."""
        path = _archive_name(name)
        for _ in range(MAX_LINK_HOPS):
            m = self.members.get(path) if path else None
            if m is None:
                raise self.corrupt(f"{what} {name!r} is missing from the archive")
            if m.isreg():
                return m
            if m.issym():
                path = _archive_name(posixpath.join(posixpath.dirname(path), m.linkname))
            elif m.islnk():
                path = _archive_name(m.linkname)
            else:
                raise self.corrupt(f"{what} {name!r} is not a regular file in the archive")
        raise self.corrupt(f"{what} {name!r} is a loop of links in the archive")

    def read(self, name: str, what: str, *, digest: str | None = None, size: int | None = None) -> bytes:
        m = self.find(name, what)
        if size is not None and m.size != size:
            raise self.corrupt(f"{what} {name!r} is {m.size} bytes, but its descriptor says {size}")
        if m.size > MAX_JSON_BYTES:
            raise self.corrupt(f"{what} {name!r} is {m.size} bytes, over the {MAX_JSON_BYTES} bytes allowed")
        try:
            data = self.open(m).read()
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as e:
            raise self.corrupt(f"{what} {name!r} cannot be read ({e})") from None
        if len(data) != m.size:
            raise self.corrupt(f"{what} {name!r} is truncated")
        if digest is not None:
            algorithm, want = digest.split(":", 1)
            got = hashlib.new(algorithm, data).hexdigest()
            if got != want:
                raise self.corrupt(f"{what} {name!r} has {algorithm} {got}, not the {want} its name says")
        return data

    def read_json(self, name: str, what: str, **kw) -> tuple[object, bytes]:
        data = self.read(name, what, **kw)
        try:
            return json.loads(data), data
        except (ValueError, RecursionError) as e:
            raise self.corrupt(f"{what} {name!r} is not valid JSON ({e})") from None

    def open(self, member: tarfile.TarInfo):
        f = self.tar.extractfile(member)
        assert f is not None  # find() returns regular files only
        return f


def _archive_name(name: str) -> str:
    """A member name of the outer archive, normalized ("" for the top, or unreachable names)."""
    path = posixpath.normpath("/" + name.lstrip("/"))
    return path.lstrip("/")


# --- manifests and configs ---------------------------------------------------------------------


def _load(outer: _Outer) -> _Image:
    if outer.has("manifest.json"):
        return _load_docker(outer)
    if outer.has("index.json"):
        return _load_oci(outer)
    raise outer.corrupt(
        "has neither manifest.json (docker save) nor index.json (an OCI image layout) at its top"
    )


def _load_docker(outer: _Outer) -> _Image:
    entries, _ = outer.read_json("manifest.json", "manifest")
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise outer.corrupt("manifest.json is not a non-empty list of images")
    entry = entries[0]  # a save of several images: the first one
    config_name, layer_names = entry.get("Config"), entry.get("Layers")
    if not isinstance(config_name, str) or not isinstance(layer_names, list):
        raise outer.corrupt("manifest.json's first image has no Config name or no Layers list")
    if not all(isinstance(n, str) for n in layer_names):
        raise outer.corrupt("manifest.json's Layers are not all names of files in the archive")
    config_doc, config_bytes = outer.read_json(
        config_name, "image config", digest=_digest_of_name(config_name)
    )
    identity = json.dumps({"Config": config_name, "Layers": layer_names}, sort_keys=True).encode()
    config, diff_ids = _parse_config(outer, config_doc, _identity(b"docker", identity, config_bytes))
    if len(diff_ids) != len(layer_names):
        raise outer.corrupt(
            f"manifest.json names {len(layer_names)} layers, its config {len(diff_ids)} diff_ids"
        )
    layers = []
    for name, diff_id in zip(layer_names, diff_ids, strict=True):
        outer.find(name, "layer")
        layers.append(_Layer(name=name, digest=_digest_of_name(name), size=None, diff_id=diff_id))
    return _Image(config=config, layers=tuple(layers))


def _load_oci(outer: _Outer) -> _Image:
    doc, _ = outer.read_json("index.json", "index")
    where = "index.json"
    for _ in range(MAX_INDEX_DEPTH):
        digest, size, media = _descriptor(outer, _choose(outer, doc, where), where)
        where = _blob_name(digest)
        doc, blob = outer.read_json(where, "manifest", digest=digest, size=size)
        if media in INDEX_TYPES or (media is None and isinstance(doc, dict) and "manifests" in doc):
            continue
        break
    else:
        raise outer.corrupt(f"image indexes are nested more than {MAX_INDEX_DEPTH} deep")
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list):
        raise outer.corrupt(f"manifest {where} has no layers list")
    digest, size, _ = _descriptor(outer, doc.get("config"), f"{where} config")
    config_doc, config_bytes = outer.read_json(_blob_name(digest), "image config", digest=digest, size=size)
    config, diff_ids = _parse_config(outer, config_doc, _identity(b"oci", blob, config_bytes))
    if len(diff_ids) != len(doc["layers"]):
        raise outer.corrupt(
            f"manifest {where} names {len(doc['layers'])} layers, its config {len(diff_ids)} diff_ids"
        )
    layers = []
    for n, (desc, diff_id) in enumerate(zip(doc["layers"], diff_ids, strict=True), 1):
        digest, size, _ = _descriptor(outer, desc, f"{where} layer {n}")
        m = outer.find(_blob_name(digest), "layer")
        if m.size != size:
            raise outer.corrupt(f"layer {n} ({digest}) is {m.size} bytes, but its descriptor says {size}")
        layers.append(_Layer(name=_blob_name(digest), digest=digest, size=size, diff_id=diff_id))
    return _Image(config=config, layers=tuple(layers))


def _choose(outer: _Outer, index: object, where: str) -> object:
    """An index's entry for this host's platform, else its first image (attestations skipped)."""
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not manifests:
        raise outer.corrupt(f"{where} lists no manifests")
    arch = host_architecture()
    for m in manifests:
        p = m.get("platform") if isinstance(m, dict) else None
        if isinstance(p, dict) and p.get("os") == "linux" and p.get("architecture") == arch:
            return m
    for m in manifests:
        p = m.get("platform") if isinstance(m, dict) else None
        annotations = m.get("annotations") if isinstance(m, dict) else None
        if (
            isinstance(annotations, dict)
            and annotations.get("vnd.docker.reference.type") == "attestation-manifest"
        ):
            continue
        if isinstance(p, dict) and p.get("architecture") == "unknown":
            continue
        if isinstance(p, dict) and len(manifests) > 1:
            log.warning(
                "image archive %s: %s has no linux/%s image; taking %s", outer.archive, where, arch, p
            )
        return m
    return manifests[0]


def host_architecture() -> str:
    """The host's architecture as OCI platforms name it."""
    machine = platform.machine().lower()
    return {
        "x86_64": "amd64",
        "amd64": "amd64",
        "aarch64": "arm64",
        "arm64": "arm64",
        "i386": "386",
        "i686": "386",
        "armv7l": "arm",
    }.get(machine, machine)


def _descriptor(outer: _Outer, desc: object, where: str) -> tuple[str, int, str | None]:
    if not isinstance(desc, dict):
        raise outer.corrupt(f"{where} has no descriptor (a JSON object with digest and size)")
    digest, size, media = desc.get("digest"), desc.get("size"), desc.get("mediaType")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise outer.corrupt(f"{where} has a descriptor whose digest {digest!r} is not sha256:<64 hex>")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise outer.corrupt(f"{where} has a descriptor whose size {size!r} is not a byte count")
    if media is not None and not isinstance(media, str):
        raise outer.corrupt(f"{where} has a descriptor whose mediaType {media!r} is not a string")
    return digest, size, media


def _blob_name(digest: str) -> str:
    algorithm, hexdigest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hexdigest}"


def _digest_of_name(name: str) -> str | None:
    """The digest a docker save member's name promises (blobs/sha256/<hex>, <image id>.json)."""
    path = _archive_name(name)
    if m := _BLOB_PATH.match(path):
        return f"{m.group(1)}:{m.group(2)}"
    if m := _LEGACY_CONFIG.match(path):
        return f"sha256:{m.group(1)}"
    return None


def _identity(kind: bytes, manifest: bytes, config: bytes) -> str:
    h = hashlib.sha256(IDENTITY_VERSION + b"\0" + kind + b"\0")
    h.update(hashlib.sha256(manifest).digest())
    h.update(hashlib.sha256(config).digest())
    return h.hexdigest()


def _parse_config(outer: _Outer, doc: object, digest: str) -> tuple[ImageConfig, list[str]]:
    if not isinstance(doc, dict):
        raise outer.corrupt("the image config is not a JSON object")
    c = doc.get("config") or {}
    if not isinstance(c, dict):
        raise outer.corrupt("the image config's config is not a JSON object")

    def strings(key: str) -> tuple[str, ...]:
        value = c.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise outer.corrupt(f"the image config's {key} is not a list of strings")
        return tuple(value)

    def optional(key: str) -> str | None:
        value = c.get(key)
        if value is not None and not isinstance(value, str):
            raise outer.corrupt(f"the image config's {key} is not a string")
        return value or None

    env = tuple((k, v) for k, _, v in (e.partition("=") for e in strings("Env")))
    rootfs = doc.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) and _DIGEST.match(d) for d in diff_ids):
        raise outer.corrupt("the image config has no rootfs.diff_ids list of sha256 digests")
    config = ImageConfig(
        env=env,
        workdir=optional("WorkingDir"),
        user=optional("User"),
        cmd=strings("Cmd"),
        entrypoint=strings("Entrypoint"),
        digest=digest,
    )
    return config, diff_ids


# --- applying layers ---------------------------------------------------------------------------


class _Hashing:
    """A reader that hashes and counts what passes through it."""

    def __init__(self, f, digest: str | None):
        self.f = f
        self.algorithm = digest.split(":", 1)[0] if digest else "sha256"
        self.hash = hashlib.new(self.algorithm)
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.hash.update(data)
        self.count += len(data)
        return data

    def readable(self) -> bool:
        return True

    def digest(self) -> str:
        return f"{self.algorithm}:{self.hash.hexdigest()}"


def _decompressed(archive: str, raw, n: int):
    head = raw.peek(6)[:6]
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(raw)
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw)
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        try:
            import zstandard
        except ImportError:
            raise CorruptArchive(
                archive,
                f"layer {n} is zstd-compressed, and zstd layers are not supported here",
                fix="re-export the image with gzip or uncompressed layers",
            ) from None
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw


def _member_parts(archive: str, name: str) -> tuple[str, ...]:
    """A layer member's path inside the image, as components; `..` anywhere is refused."""
    if len(name.encode(errors="surrogateescape")) > MAX_PATH_BYTES:
        raise CorruptArchive(
            archive, f"a layer member's path is over {MAX_PATH_BYTES} bytes", fix="rebuild the image"
        )
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise CorruptArchive(
            archive,
            f"layer member {name!r} has a `..` component (it would land outside the root file system)",
            fix="the image is malformed or hostile: rebuild it from a trusted source",
        )
    return parts


class _Unpacker:
    def __init__(self, archive: str, dest: str, root_fd: int, max_bytes: int):
        self.archive, self.dest, self.root_fd, self.max_bytes = archive, dest, root_fd, max_bytes
        self.total = 0  # bytes of regular files written, all layers
        self.skipped = 0  # device nodes, FIFOs, unknown member types
        self.chown = os.geteuid() == 0
        self.member = ""

    def corrupt(self, problem: str, **kw) -> CorruptArchive:
        return CorruptArchive(self.archive, problem, **kw)

    def apply(self, outer: _Outer, layer: _Layer, n: int) -> None:
        self.member = ""
        self.written: set[str] = set()  # this layer's paths and their parents: opaque dirs keep them
        self.dir_times: list[tuple[tuple[str, ...], float]] = []
        try:
            # The blob's hash sees the bytes as stored, the stream's what the decompressor makes of them.
            blob = _Hashing(outer.open(outer.find(layer.name, "layer")), layer.digest)
            stream = _Hashing(_decompressed(self.archive, _Peekable(blob), n), layer.diff_id)
            tar = tarfile.open(fileobj=typing.cast(typing.IO[bytes], stream), mode="r|")
            while (m := tar.next()) is not None:
                tar.members = []  # type: ignore[attr-defined]  # stream mode would keep every TarInfo
                self.member = m.name
                self._member(tar, m)
            self.member = ""
            if _drain(stream, MAX_TRAILING_BYTES) > MAX_TRAILING_BYTES:
                raise self.corrupt(f"layer {n} has over {MAX_TRAILING_BYTES} bytes after its tar's end")
            _drain(blob, None)
        except errors.AtollError:
            raise
        except ValueError as e:  # an embedded NUL, an out-of-range uid
            raise self.corrupt(self._where(n) + f"cannot be unpacked ({e})") from None
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, RecursionError, OverflowError) as e:
            raise self.corrupt(self._where(n) + f"is not a readable tar, or is truncated ({e})") from None
        except OSError as e:
            if e.errno in _HOST_ERRNOS:
                raise errors.RuntimeFailure(
                    f"unpacking image archive {self.archive} failed on the worker ({e.strerror}); "
                    "free space on the worker or use a smaller image",
                    detail=f"{self.dest}: layer {n} member {self.member!r}: {e}",
                ) from e
            raise self.corrupt(self._where(n) + f"cannot be unpacked ({e})") from None
        if layer.digest is not None and blob.digest() != layer.digest:
            raise self.corrupt(f"layer {n} has digest {blob.digest()}, not the {layer.digest} its name says")
        if layer.size is not None and blob.count != layer.size:
            raise self.corrupt(f"layer {n} is {blob.count} bytes, not the {layer.size} its descriptor says")
        if stream.digest() != layer.diff_id:
            raise self.corrupt(
                f"layer {n}'s uncompressed content has digest {stream.digest()}, "
                f"not the {layer.diff_id} the config's rootfs.diff_ids says"
            )
        for parts, mtime in reversed(self.dir_times):  # children's creation changed them
            fd = self._open_existing(parts)
            if fd is not None:
                try:
                    _set_mtime(mtime, fd)
                finally:
                    os.close(fd)

    def _where(self, n: int) -> str:
        return f"layer {n} member {self.member!r} " if self.member else f"layer {n} "

    def _member(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = _member_parts(self.archive, m.name)
        if not parts:
            if not m.isdir():
                raise self.corrupt(f"layer member {m.name!r} is the root but not a directory")
            self._owner_mode(self.root_fd, m)
            self.dir_times.append(((), m.mtime))
            return
        base = parts[-1]
        if base.startswith(".wh."):
            self._whiteout(parts)
            return
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            self.skipped += 1  # device nodes (a 0/0 char device is an overlay whiteout), FIFOs, others
            return
        if m.isreg() and self.total + m.size > self.max_bytes:
            raise self._too_large()
        parent = self._open_parents(parts, create=True)
        assert parent is not None
        try:
            if m.isdir():
                self._directory(parent, base, m, parts)
            elif m.isreg():
                self._file(tar, parent, base, m)
            elif m.issym():
                self._remove(parent, base)
                os.symlink(m.linkname, base, dir_fd=parent)
                if self.chown:
                    os.chown(base, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
                _set_mtime(m.mtime, base, dir_fd=parent)
            else:
                self._hardlink(parent, base, m, parts)
        finally:
            os.close(parent)
        for i in range(1, len(parts) + 1):
            self.written.add("/".join(parts[:i]))

    def _too_large(self) -> ImageTooLarge:
        return ImageTooLarge(
            self.archive,
            f"the image is larger than max_bytes={self.max_bytes} bytes of files unpacked",
            fix="use a smaller image, or raise the worker's limit on template images",
        )

    def _directory(self, parent: int, base: str, m: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        if not self._remove(parent, base, keep_dir=True):
            os.mkdir(base, 0o700, dir_fd=parent)
        fd = os.open(base, _DIR_FLAGS, dir_fd=parent)
        try:
            self._owner_mode(fd, m)
        finally:
            os.close(fd)
        self.dir_times.append((parts, m.mtime))

    def _file(self, tar: tarfile.TarFile, parent: int, base: str, m: tarfile.TarInfo) -> None:
        self._remove(parent, base)
        fd = os.open(
            base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent
        )
        with open(fd, "wb") as out:
            src = tar.extractfile(m)
            assert src is not None
            while chunk := src.read(_CHUNK):
                self.total += len(chunk)
                if self.total > self.max_bytes:
                    raise self._too_large()
                out.write(chunk)
            out.flush()
            self._owner_mode(fd, m)
            _set_mtime(m.mtime, fd)

    def _hardlink(self, parent: int, base: str, m: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        target = _member_parts(self.archive, m.linkname)
        if not target:
            raise self.corrupt(f"hard link {m.name!r} points at the root directory")
        if target == parts:
            return
        missing = self.corrupt(
            f"hard link {m.name!r} points at {m.linkname!r}, which is not unpacked before it",
            fix="the image is malformed: rebuild it",
        )
        target_parent = self._open_parents(target, create=False)
        if target_parent is None:
            raise missing
        try:
            try:
                st = os.stat(target[-1], dir_fd=target_parent, follow_symlinks=False)
            except FileNotFoundError:
                raise missing from None
            if stat.S_ISDIR(st.st_mode):
                raise self.corrupt(f"hard link {m.name!r} points at the directory {m.linkname!r}")
            self._remove(parent, base)
            os.link(target[-1], base, src_dir_fd=target_parent, dst_dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(target_parent)

    def _whiteout(self, parts: tuple[str, ...]) -> None:
        base = parts[-1]
        if base == ".wh..wh..opq":
            fd = self._open_parents(parts, create=False)
            if fd is not None:
                try:
                    self._prune(fd, "/".join(parts[:-1]))
                finally:
                    os.close(fd)
            return
        if base.startswith(".wh..wh."):
            return  # aufs bookkeeping (.wh..wh.plnk, .wh..wh.aufs), never part of the image
        name = base[len(".wh.") :]
        if name in ("", ".", ".."):
            raise self.corrupt(f"layer member {self.member!r} is a whiteout of no name")
        if "/".join((*parts[:-1], name)) in self.written:
            return  # whiteouts hide lower layers only
        fd = self._open_parents(parts, create=False)
        if fd is not None:
            try:
                self._remove(fd, name)
            finally:
                os.close(fd)

    def _prune(self, fd: int, prefix: str) -> None:
        """An opaque directory: remove what lower layers put in it, keep what this layer wrote."""
        for name in os.listdir(fd):
            path = f"{prefix}/{name}" if prefix else name
            if path not in self.written:
                self._remove(fd, name)
            elif stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    self._prune(sub, path)
                finally:
                    os.close(sub)

    def _open_parents(self, parts: tuple[str, ...], *, create: bool) -> int | None:
        """A descriptor of the directory holding `parts[-1]`, reached without following a symlink;
        None when it does not exist (and `create` is false). Missing parents are made 0755."""
        fd = os.dup(self.root_fd)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    os.mkdir(part, 0o755, dir_fd=fd)
                    sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    here = "/".join(parts[: i + 1])
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise self.corrupt(
                            f"layer member {self.member!r} would be written through the symlink {here!r}",
                            fix="the image is malformed or hostile (atoll never follows symlinks while unpacking)",
                        ) from None
                    raise self.corrupt(
                        f"layer member {self.member!r} needs {here!r} to be a directory, but it is a file",
                        fix="the image is malformed: rebuild it",
                    ) from None
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _open_existing(self, parts: tuple[str, ...]) -> int | None:
        fd = os.dup(self.root_fd)
        for part in parts:
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                os.close(fd)
                return None
            os.close(fd)
            fd = sub
        return fd

    def _remove(self, parent: int, name: str, *, keep_dir: bool = False) -> bool:
        """Remove `name` (a directory's whole tree; never through a symlink); whether a directory
        is left there (with `keep_dir`)."""
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return True
            shutil.rmtree(name, dir_fd=parent)  # fd-based on Linux: does not follow symlinks
        else:
            os.unlink(name, dir_fd=parent)
        return False

    def _owner_mode(self, fd: int, m: tarfile.TarInfo) -> None:
        if self.chown:
            os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears setuid and setgid


class _Peekable:
    """`_Hashing` with the `peek` that compression sniffing needs (it does not consume)."""

    def __init__(self, hashing: _Hashing):
        self.hashing = hashing
        self.buffer = b""

    def peek(self, n: int) -> bytes:
        while len(self.buffer) < n:
            data = self.hashing.read(n - len(self.buffer))
            if not data:
                break
            self.buffer += data
        return self.buffer

    def read(self, n: int = -1) -> bytes:
        if self.buffer:
            data = self.buffer if n < 0 else self.buffer[:n]
            self.buffer = self.buffer[len(data) :]
            return data
        return self.hashing.read(n)

    def readable(self) -> bool:
        return True


def _drain(reader, limit: int | None) -> int:
    n = 0
    while chunk := reader.read(_CHUNK):
        n += len(chunk)
        if limit is not None and n > limit:
            break
    return n


def _set_mtime(mtime: float, path: int | str, *, dir_fd: int | None = None) -> None:
    """Set atime and mtime; a time the file system cannot hold is left as it is (cosmetic)."""
    try:
        ns = int(mtime) * 10**9 if isinstance(mtime, int) else round(mtime * 1e9)
        if isinstance(path, int):
            os.utime(path, ns=(ns, ns))
        else:
            os.utime(path, ns=(ns, ns), dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, OverflowError, ValueError):
        pass
