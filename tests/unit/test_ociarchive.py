"""Image archives (worker.ociarchive): docker save and OCI layouts unpacked into a root file system,
with whiteouts, digests and the limits a hostile archive meets. Archives are built here in Python."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile

import pytest

from atoll.worker.images import ociarchive

IS_ROOT = os.geteuid() == 0
CONFIG = {
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=a=b c"],
    "WorkingDir": "/srv/app",
    "User": "1000:1000",
    "Cmd": ["python3", "-m", "app"],
    "Entrypoint": ["/entry.sh", "--flag"],
}


# --- building archives -------------------------------------------------------------------------


def f(name, data=b"", mode=0o644, uid=0, gid=0, mtime=1_700_000_000):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, gid, mtime
    return info, data


def d(name, mode=0o755, uid=0, gid=0):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, uid, gid
    return info, None


def sym(name, target):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


def hard(name, target):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info, None


def special(name, kind, major=0, minor=0):
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = kind, major, minor
    return info, None


def layer(*entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for info, data in entries:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_blob(layers: list[bytes], config: dict | None = None, arch: str = "amd64") -> bytes:
    return json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": config if config is not None else CONFIG,
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + sha(x) for x in layers]},
        }
    ).encode()


def outer(path, files: dict[str, bytes], compress: bool = False) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    path.write_bytes(gzip.compress(data) if compress else data)
    return str(path)


def docker_save(path, layers: list[bytes], config: dict | None = None, tags=("app:1",), **kw) -> str:
    cfg = config_blob(layers, config)
    files = {"manifest.json": b"", f"{sha(cfg)}.json": cfg}
    names = []
    for i, x in enumerate(layers):
        names.append(f"{i:064x}/layer.tar")
        files[names[-1]] = x
    manifest = [{"Config": f"{sha(cfg)}.json", "RepoTags": list(tags), "Layers": names}]
    files["manifest.json"] = json.dumps(manifest).encode()
    return outer(path, files, **kw)


def descriptor(media: str, data: bytes, **extra) -> dict:
    return {"mediaType": media, "digest": "sha256:" + sha(data), "size": len(data), **extra}


def oci_layout(path, images: dict[str, list[bytes]], *, gz=True, index=True, tamper=None) -> str:
    """An OCI layout tarball: index.json -> (an image index of `images`' platforms ->) manifests."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> bytes:
        blobs[f"blobs/sha256/{sha(data)}"] = data
        return data

    entries = []
    for arch, layers in images.items():
        stored = [blob(gzip.compress(x, mtime=0) if gz else x) for x in layers]
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else "")
        cfg = blob(config_blob(layers, arch=arch))
        manifest = blob(
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": descriptor("application/vnd.oci.image.config.v1+json", cfg),
                    "layers": [descriptor(media, x) for x in stored],
                }
            ).encode()
        )
        entries.append(
            descriptor(
                "application/vnd.oci.image.manifest.v1+json",
                manifest,
                platform={"architecture": arch, "os": "linux"},
            )
        )
    if index:
        image_index = blob(
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.oci.image.index.v1+json",
                    "manifests": entries,
                }
            ).encode()
        )
        top = [descriptor("application/vnd.oci.image.index.v1+json", image_index)]
    else:
        top = entries
    files = {
        "oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
        "index.json": json.dumps({"schemaVersion": 2, "manifests": top}).encode(),
        **blobs,
    }
    if tamper:
        tamper(files)
    return outer(path, files)


def tree(root) -> dict[str, str]:
    """Every path under root with a short description of what it is."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "-> " + os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            else:
                with open(p, "rb") as fh:
                    out[rel] = fh.read().decode()
    return out


OTHER_ARCH = "arm64" if ociarchive.host_architecture() != "arm64" else "amd64"


# --- formats -----------------------------------------------------------------------------------


def test_docker_save_two_layers_with_whiteout_and_opaque_directory(tmp_path):
    lower = layer(
        d("etc"),
        f("etc/passwd", b"root:x:0:0::/root:/bin/sh\n"),
        f("etc/gone", b"deleted by layer 2"),
        d("opt"),
        f("opt/old", b"hidden by the opaque marker"),
        d("opt/sub"),
        f("opt/sub/old2", b"hidden too"),
        d("opt/sub2"),
        f("opt/sub2/lower", b"hidden: sub2 is rewritten in layer 2"),
    )
    upper = layer(
        f("etc/.wh.gone"),
        f("etc/new", b"added"),
        d("opt"),
        f("opt/kept", b"written before the marker, same layer"),
        f("opt/.wh..wh..opq"),
        f("opt/fresh", b"written after the marker"),
        f("opt/sub2/upper", b"this layer's"),
    )
    archive = docker_save(tmp_path / "img.tar", [lower, upper])
    dest = tmp_path / "rootfs"
    config = ociarchive.unpack(archive, str(dest))
    assert tree(dest) == {
        "etc": "dir",
        "etc/passwd": "root:x:0:0::/root:/bin/sh\n",
        "etc/new": "added",
        "opt": "dir",
        "opt/kept": "written before the marker, same layer",
        "opt/fresh": "written after the marker",
        "opt/sub2": "dir",
        "opt/sub2/upper": "this layer's",
    }
    assert config.cmd == ("python3", "-m", "app")
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o755


def test_config_is_read_by_inspect_and_unpack_alike(tmp_path):
    archive = docker_save(tmp_path / "img.tar", [layer(f("a", b"x"))])
    config = ociarchive.inspect(archive)
    assert config.env == (("PATH", "/usr/local/bin:/usr/bin:/bin"), ("GREETING", "a=b c"))
    assert config.workdir == "/srv/app"
    assert config.user == "1000:1000"
    assert config.cmd == ("python3", "-m", "app")
    assert config.entrypoint == ("/entry.sh", "--flag")
    assert len(config.digest) == 64
    assert ociarchive.unpack(archive, str(tmp_path / "rootfs")) == config


def test_empty_config_fields_are_defaults(tmp_path):
    config = {"Env": None, "WorkingDir": "", "User": "", "Cmd": None}
    archive = docker_save(tmp_path / "img.tar", [layer(f("a"))], config=config)
    got = ociarchive.inspect(archive)
    assert (got.env, got.workdir, got.user, got.cmd, got.entrypoint) == ((), None, None, (), ())


def test_oci_layout_with_gzip_layers_picks_the_hosts_platform(tmp_path):
    host = ociarchive.host_architecture()
    images = {
        OTHER_ARCH: [layer(f("arch", b"other"))],
        host: [layer(d("usr"), f("usr/arch", b"host")), layer(f("usr/second", b"2"))],
    }
    archive = oci_layout(tmp_path / "img.tar", images)
    dest = tmp_path / "rootfs"
    ociarchive.unpack(archive, str(dest))
    assert tree(dest) == {"usr": "dir", "usr/arch": "host", "usr/second": "2"}


def test_oci_layout_without_an_image_index_takes_its_first_manifest(tmp_path):
    archive = oci_layout(tmp_path / "img.tar", {"amd64": [layer(f("x", b"1"))]}, gz=False, index=False)
    ociarchive.unpack(archive, str(tmp_path / "rootfs"))
    assert (tmp_path / "rootfs" / "x").read_bytes() == b"1"


def test_an_archive_that_is_both_formats_is_read_as_docker_save(tmp_path):
    lower = layer(f("from-manifest-json", b"yes"))
    cfg = config_blob([lower])
    files = {
        "oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
        "index.json": b'{"manifests": "not even a list"}',
        "manifest.json": json.dumps(
            [{"Config": f"blobs/sha256/{sha(cfg)}", "Layers": [f"blobs/sha256/{sha(lower)}"]}]
        ).encode(),
        f"blobs/sha256/{sha(cfg)}": cfg,
        f"blobs/sha256/{sha(lower)}": lower,
    }
    archive = outer(tmp_path / "img.tar", files)
    ociarchive.unpack(archive, str(tmp_path / "rootfs"))
    assert tree(tmp_path / "rootfs") == {"from-manifest-json": "yes"}


def test_gzip_compressed_archive(tmp_path):
    archive = docker_save(tmp_path / "img.tar.gz", [layer(f("a", b"gz"))], compress=True)
    ociarchive.unpack(archive, str(tmp_path / "rootfs"))
    assert (tmp_path / "rootfs" / "a").read_bytes() == b"gz"


def test_ownership_modes_mtimes_links_and_skipped_special_files(tmp_path):
    lower = layer(
        d("bin", mode=0o711, uid=7, gid=8),
        f("bin/su", b"#!", mode=0o4755, uid=0, gid=0),
        f("bin/tool", b"tool", mode=0o2750, uid=1234, gid=5678),
        f("bin/same", b"hard-linked", mode=0o600),
        hard("bin/alias", "bin/same"),
        hard("bin/tool2", "bin/tool"),
        sym("bin/sh", "/usr/bin/dash"),
        special("dev-null", tarfile.CHRTYPE, 1, 3),
        special("whiteout-style", tarfile.CHRTYPE, 0, 0),
        special("disk", tarfile.BLKTYPE, 8, 0),
        special("fifo", tarfile.FIFOTYPE),
    )
    archive = docker_save(tmp_path / "img.tar", [lower, layer(hard("bin/later", "bin/tool"))])
    dest = tmp_path / "rootfs"
    ociarchive.unpack(archive, str(dest))
    assert sorted(os.listdir(dest)) == ["bin"]
    su, tool = os.stat(dest / "bin/su"), os.stat(dest / "bin/tool")
    assert stat.S_IMODE(su.st_mode) == 0o4755
    assert stat.S_IMODE(tool.st_mode) == 0o2750
    assert stat.S_IMODE(os.stat(dest / "bin").st_mode) == 0o711
    assert tool.st_mtime == 1_700_000_000
    assert os.readlink(dest / "bin/sh") == "/usr/bin/dash"
    assert os.stat(dest / "bin/alias").st_ino == os.stat(dest / "bin/same").st_ino
    assert os.stat(dest / "bin/later").st_ino == tool.st_ino
    if IS_ROOT:
        assert (tool.st_uid, tool.st_gid) == (1234, 5678)
        assert (os.stat(dest / "bin").st_uid, os.stat(dest / "bin").st_gid) == (7, 8)


def test_later_layers_replace_directories_files_and_symlinks(tmp_path):
    lower = layer(d("a"), f("a/inner", b"x"), f("b", b"file"), sym("c", "elsewhere"))
    upper = layer(f("a", b"now a file"), d("b"), f("b/inner", b"y"), d("c"))
    archive = docker_save(tmp_path / "img.tar", [lower, upper])
    ociarchive.unpack(archive, str(tmp_path / "rootfs"))
    assert tree(tmp_path / "rootfs") == {"a": "now a file", "b": "dir", "b/inner": "y", "c": "dir"}


def test_absolute_member_paths_are_stripped_into_dest(tmp_path):
    entries = [d("./", mode=0o750), f("/etc/abs", b"inside"), f("//./rel", b"r")]
    archive = docker_save(tmp_path / "img.tar", [layer(*entries)])
    dest = tmp_path / "rootfs"
    ociarchive.unpack(archive, str(dest))
    assert tree(dest) == {"etc": "dir", "etc/abs": "inside", "rel": "r"}
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o750  # the layer's "./" entry is the root's


# --- hostile archives --------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["ABSOLUTE", "../../../../../../../../ESCAPE"])
@pytest.mark.parametrize("same_layer", [False, True])
def test_a_symlink_in_the_image_never_leads_outside_dest(tmp_path, target, same_layer):
    outside = tmp_path / "outside-test-dir"
    outside.mkdir()
    dest = tmp_path / "a" / "b" / "rootfs"
    link = str(outside) if target == "ABSOLUTE" else target.replace("ESCAPE", str(outside).lstrip("/"))
    evil, pwned = sym("evil", link), f("evil/pwned", b"owned")
    layers = [layer(evil, pwned)] if same_layer else [layer(evil), layer(pwned)]
    archive = docker_save(tmp_path / "img.tar", layers)
    with pytest.raises(ociarchive.CorruptArchive, match="through the symlink 'evil'"):
        ociarchive.unpack(archive, str(dest))
    assert os.listdir(outside) == []


def test_whiteouts_and_hard_links_never_reach_through_a_symlink(tmp_path):
    outside = tmp_path / "outside-test-dir"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    for n, second in enumerate([f("evil/.wh.keep"), f("evil/.wh..wh..opq"), hard("stolen", "evil/keep")]):
        archive = docker_save(tmp_path / f"img{n}.tar", [layer(sym("evil", str(outside))), layer(second)])
        with pytest.raises(ociarchive.CorruptArchive, match="symlink"):
            ociarchive.unpack(archive, str(tmp_path / f"rootfs{n}"))
        assert (outside / "keep").read_text() == "precious"
        assert os.stat(outside / "keep").st_nlink == 1


@pytest.mark.parametrize(
    "entry",
    [f("../escape", b"x"), f("a/../../escape", b"x"), hard("link", "../../etc/passwd"), f(".wh...")],
    ids=["dotdot", "nested-dotdot", "hardlink-dotdot", "whiteout-dotdot"],
)
def test_dotdot_members_are_refused(tmp_path, entry):
    archive = docker_save(tmp_path / "img.tar", [layer(entry)])
    with pytest.raises(ociarchive.CorruptArchive, match=r"`\.\.`|no name"):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))
    assert not (tmp_path / "escape").exists()


def test_hard_link_to_a_file_not_yet_unpacked_is_refused(tmp_path):
    archive = docker_save(tmp_path / "img.tar", [layer(hard("a", "not/there"), f("not/there"))])
    with pytest.raises(ociarchive.CorruptArchive, match="not unpacked before it"):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))


def test_max_bytes_is_enforced(tmp_path):
    archive = docker_save(tmp_path / "img.tar", [layer(f("a", b"x" * 1000)), layer(f("b", b"y" * 1000))])
    with pytest.raises(ociarchive.ImageTooLarge, match="larger than max_bytes=1500") as caught:
        ociarchive.unpack(archive, str(tmp_path / "rootfs"), max_bytes=1500)
    assert isinstance(caught.value, ociarchive.CorruptArchive)
    ociarchive.unpack(archive, str(tmp_path / "rootfs2"), max_bytes=2000)


# --- damaged archives --------------------------------------------------------------------------


def test_errors_are_invalid_requests_naming_the_archive_and_the_fix(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not a tar file\n" * 100)
    with pytest.raises(ociarchive.CorruptArchive) as caught:
        ociarchive.inspect(str(path))
    e = caught.value
    assert (e.code, e.status, e.retryable) == ("invalid_request", 400, False)
    assert str(path) in e.message and "no docker save or OCI image archive can be read" in e.message
    assert "docker save IMAGE -o FILE" in e.message and "oci-archive:FILE" in e.message
    assert "not a tar archive" in e.detail  # the cause: logged by the worker, never sent


def _no_archive(path) -> ociarchive.NoArchive:
    with pytest.raises(ociarchive.NoArchive) as caught:
        ociarchive.inspect(str(path))
    with pytest.raises(ociarchive.NoArchive):
        ociarchive.unpack(str(path), str(path) + ".rootfs")
    return caught.value


def test_no_answer_tells_a_missing_path_from_an_existing_file(tmp_path):
    """A caller names any host path: what it gets back must not say whether the path exists or
    what it holds. The message is the same (but for the path it names); only `detail` differs."""
    d = tmp_path / "d"
    d.mkdir()
    paths = {
        "missing": d / "nope.tar",
        "directory": d,
        "text": d / "passwd",
        "empty": d / "empty",
        "zstd": d / "img.tar.zst",
        "gzip garbage": d / "x.gz",
        "tar without manifest": d / "backup.tar",
        "below a file": d / "passwd" / "x",
    }
    paths["text"].write_text("root:x:0:0:root:/root:/bin/bash\n")
    paths["empty"].write_bytes(b"")
    paths["zstd"].write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(200))
    paths["gzip garbage"].write_bytes(b"\x1f\x8b" + os.urandom(200))
    outer(paths["tar without manifest"], {"etc/shadow": b"root:*:1:0:99999:7:::\n"})
    seen = {}
    for what, path in paths.items():
        e = _no_archive(path)
        seen[what] = e.message.replace(str(path), "PATH")
        assert str(path) in e.message and str(path) in e.detail, (what, e.message)
    assert len(set(seen.values())) == 1, seen
    assert "does not exist" in _no_archive(paths["missing"]).detail
    assert "not a regular file" in _no_archive(paths["directory"]).detail
    assert "zstd" in _no_archive(paths["zstd"]).detail
    assert "neither manifest.json" in _no_archive(paths["tar without manifest"]).detail


def test_an_image_archive_gets_its_own_problem_named(tmp_path):
    """Past the point where the path holds an image archive (the file the caller put there), its
    problems are named: the caller can fix them."""
    files = {"manifest.json": b"[not json"}
    with pytest.raises(ociarchive.CorruptArchive) as caught:
        ociarchive.inspect(outer(tmp_path / "img.tar", files))
    assert not isinstance(caught.value, ociarchive.NoArchive)
    assert "manifest 'manifest.json' is not valid JSON" in caught.value.message


def test_truncated_archive(tmp_path):
    big = os.urandom(200_000)
    archive = docker_save(tmp_path / "img.tar", [layer(f("big", big))])
    data = (tmp_path / "img.tar").read_bytes()
    (tmp_path / "img.tar").write_bytes(data[: len(data) * 6 // 10])
    # cut before its manifest was listed, it is no recognisable archive; after, it is named truncated
    with pytest.raises(ociarchive.CorruptArchive) as caught:
        ociarchive.inspect(archive)
    assert "truncated" in (caught.value.detail or caught.value.message), caught.value
    with pytest.raises(ociarchive.CorruptArchive):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))


def test_truncated_layer_is_caught_by_its_diff_id(tmp_path):
    whole = layer(f("a", b"1"), f("b", b"2"))
    cut = layer(f("a", b"1"))[:1024]  # the first member only, no end-of-archive marker
    cfg = config_blob([whole])
    files = {
        "manifest.json": json.dumps([{"Config": f"{sha(cfg)}.json", "Layers": ["l.tar"]}]).encode(),
        f"{sha(cfg)}.json": cfg,
        "l.tar": cut,
    }
    archive = outer(tmp_path / "cut.tar", files)
    with pytest.raises(ociarchive.CorruptArchive, match="rootfs.diff_ids"):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))


def test_garbled_json(tmp_path):
    archive = outer(tmp_path / "img.tar", {"manifest.json": b"[{not json"})
    with pytest.raises(ociarchive.CorruptArchive, match="manifest.json' is not valid JSON"):
        ociarchive.inspect(archive)
    archive = outer(tmp_path / "img2.tar", {"manifest.json": b'{"Config": "x"}'})
    with pytest.raises(ociarchive.CorruptArchive, match="not a non-empty list"):
        ociarchive.inspect(archive)
    archive = outer(tmp_path / "img3.tar", {"README": b"hello"})
    with pytest.raises(ociarchive.NoArchive) as caught:  # any tar: no more said than for no file
        ociarchive.inspect(archive)
    assert "neither manifest.json" in caught.value.detail


def test_missing_blob(tmp_path):
    lost = layer(f("lost", b"gone"))

    def drop(files):
        del files[f"blobs/sha256/{sha(gzip.compress(lost, mtime=0))}"]

    archive = oci_layout(tmp_path / "img.tar", {ociarchive.host_architecture(): [lost]}, tamper=drop)
    with pytest.raises(ociarchive.CorruptArchive, match="layer 'blobs/sha256/[0-9a-f]{64}' is missing"):
        ociarchive.inspect(archive)


def test_layer_digest_mismatch(tmp_path):
    good = layer(f("file", b"original"))

    def swap(files):
        files[f"blobs/sha256/{sha(good)}"] = layer(f("file", b"tampered"))  # same size, other bytes

    archive = oci_layout(
        tmp_path / "img.tar", {ociarchive.host_architecture(): [good]}, gz=False, tamper=swap
    )
    ociarchive.inspect(archive)  # the structure is intact: only reading the blob shows it
    with pytest.raises(ociarchive.CorruptArchive, match="has digest sha256:[0-9a-f]{64}, not the"):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))


def test_config_digest_mismatch(tmp_path):
    def swap_config(files):
        for name, data in files.items():
            if b'"rootfs"' in data:
                files[name] = data.replace(b"/srv/app", b"/srv/xxx")

    archive = oci_layout(tmp_path / "img.tar", {"amd64": [layer(f("a"))]}, tamper=swap_config)
    with pytest.raises(ociarchive.CorruptArchive, match="image config .* has sha256"):
        ociarchive.inspect(archive)


def test_docker_save_layer_must_match_the_configs_diff_id(tmp_path):
    good, evil = layer(f("a", b"good")), layer(f("a", b"evil"))
    cfg = config_blob([good])
    files = {
        "manifest.json": json.dumps([{"Config": f"{sha(cfg)}.json", "Layers": ["x/layer.tar"]}]).encode(),
        f"{sha(cfg)}.json": cfg,
        "x/layer.tar": evil,
    }
    archive = outer(tmp_path / "img.tar", files)
    with pytest.raises(ociarchive.CorruptArchive, match="uncompressed content has digest"):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))


def test_zstd_layers(tmp_path):
    zstd_like = b"\x28\xb5\x2f\xfd" + b"\0" * 100
    cfg = config_blob([zstd_like])
    files = {
        "manifest.json": json.dumps([{"Config": f"{sha(cfg)}.json", "Layers": ["l"]}]).encode(),
        f"{sha(cfg)}.json": cfg,
        "l": zstd_like,
    }
    archive = outer(tmp_path / "img.tar", files)
    try:
        import zstandard  # noqa: F401
    except ImportError:
        match = "zstd layers are not supported here"
    else:
        match = "not a readable tar"
    with pytest.raises(ociarchive.CorruptArchive, match=match):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))


def test_dest_must_be_empty(tmp_path):
    archive = docker_save(tmp_path / "img.tar", [layer(f("a"))])
    (tmp_path / "rootfs").mkdir()
    (tmp_path / "rootfs" / "junk").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        ociarchive.unpack(archive, str(tmp_path / "rootfs"))


# --- identity ----------------------------------------------------------------------------------


def test_content_digest_is_stable_and_follows_the_content(tmp_path):
    one = docker_save(tmp_path / "one.tar", [layer(f("a", b"1"))])
    retagged = docker_save(tmp_path / "retagged.tar", [layer(f("a", b"1"))], tags=("other:2",))
    other = docker_save(tmp_path / "other.tar", [layer(f("a", b"2"))])
    digest = ociarchive.content_digest(one)
    assert digest == ociarchive.content_digest(one) == ociarchive.inspect(one).digest
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert ociarchive.content_digest(retagged) == digest
    assert ociarchive.content_digest(other) != digest
    oci = oci_layout(tmp_path / "oci.tar", {"amd64": [layer(f("a", b"1"))]})
    assert ociarchive.content_digest(oci) not in (digest, ociarchive.content_digest(other))
