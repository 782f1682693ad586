"""Volumes and drives below the API: the rules for names, sizes and mount paths (core.mounts), the
host-side file calls that never follow a sandbox's symlinks (worker.host.treeio), the chrooted tar
import/export (worker.host.treetar) and the ext4 images themselves (worker.host.stores, root only)."""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import shutil
import subprocess
import tarfile

import pytest

from atoll.core import errors, mounts
from atoll.worker.host import storage, stores, treeio

ROOT = os.geteuid() == 0


# ---- core.mounts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "a/b", "../x", ".hidden", "x" * 65, "a b", "é", None, 3])
def test_bad_names_are_refused_with_the_value(name):
    with pytest.raises(errors.InvalidRequest) as e:
        mounts.check_name("volume", name)
    assert repr(name)[:20] in e.value.message


@pytest.mark.parametrize("size", [0, -1, 7, 2 * 1024 * 1024, True, 1.5, "64", None])
def test_bad_sizes_are_refused(size):
    with pytest.raises(errors.InvalidRequest) as e:
        mounts.check_size("volume", size)
    assert "size_mb" in e.value.message


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "relative",
        "/proc",
        "/dev",
        "/sys/x",
        "/opt/atoll",
        "/run",
        "/run/atoll/x",
        "/etc",
        "/tmp",
        "/a/../b",
        "/a\x00",
    ],
)
def test_paths_that_would_hide_the_sandboxs_own_are_refused(path):
    with pytest.raises(errors.InvalidPath):
        mounts.check_path("volume", "v", path)


def test_a_good_create_parses_and_overlaps_duplicates_and_too_many_are_refused():
    got = mounts.parse(
        [{"name": "v", "path": "/data/"}], [{"name": "d", "path": "/shared", "read_only": True}]
    )
    assert got == (mounts.Mount("volume", "v", "/data"), mounts.Mount("drive", "d", "/shared", True))
    with pytest.raises(errors.InvalidPath, match="overlap"):
        mounts.parse([{"name": "v", "path": "/data"}], [{"name": "d", "path": "/data/sub"}])
    with pytest.raises(errors.InvalidRequest, match="named twice"):
        mounts.parse([{"name": "v", "path": "/a"}, {"name": "v", "path": "/b"}], None)
    with pytest.raises(errors.InvalidRequest, match="at most"):
        mounts.parse([{"name": f"v{i}", "path": f"/m{i}"} for i in range(mounts.SLOTS + 1)], None)
    with pytest.raises(errors.InvalidRequest, match="unknown field"):
        mounts.parse([{"name": "v", "path": "/a", "size": 3}], None)


# ---- worker.host.treeio --------------------------------------------------------------------------
def test_file_calls_stay_inside_the_tree_whatever_links_it_holds(tmp_path):
    root = tmp_path / "tree"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("host")
    os.symlink(outside, root / "link")
    os.symlink(outside / "secret", root / "file-link")
    for call in (
        lambda: treeio.open_read(str(root), "/link/secret"),
        lambda: treeio.open_read(str(root), "/file-link"),
        lambda: treeio.Writer(str(root), "/link/new"),
        lambda: treeio.list_dir(str(root), "/link"),
        lambda: treeio.remove(str(root), "/link/secret"),
        lambda: treeio.list_tree(str(root), "/link", 2),
        lambda: treeio.stat_entry(str(root), "/link/secret"),
        lambda: treeio.make_dir(str(root), "/link/d", True, None, None, None),
        lambda: treeio.set_attrs(str(root), "/link/secret", 0o777, None, None),
        lambda: treeio.set_attrs(str(root), "/file-link", 0o777, None, None),
    ):
        with pytest.raises(errors.InvalidPath, match="symbolic link"):
            call()
    with pytest.raises(errors.InvalidPath, match=r"\.\."):
        treeio.open_read(str(root), "/../outside/secret")
    with pytest.raises(errors.InvalidPath, match="absolute"):
        treeio.open_read(str(root), "relative")
    assert oct((outside / "secret").stat().st_mode & 0o777) != "0o777"  # no chmod went through a link
    # a deep listing shows links as themselves and never walks into them
    entries = treeio.list_tree(str(root), "/", 16)
    assert [(e.path, e.type, e.target) for e in entries] == [
        ("/file-link", "symlink", str(outside / "secret")),
        ("/link", "symlink", str(outside)),
    ]
    treeio.remove(str(root), "/link")  # the link itself goes; its target stays
    assert (outside / "secret").read_text() == "host"
    assert not (root / "link").exists() and (root / "file-link").is_symlink()


def test_a_write_is_atomic_and_makes_parents(tmp_path):
    w = treeio.Writer(str(tmp_path), "/a/b/c.txt")
    w.write(b"part")
    assert not (tmp_path / "a" / "b" / "c.txt").exists()  # not there until committed
    w.write(b" two")
    w.commit()
    assert (tmp_path / "a" / "b" / "c.txt").read_bytes() == b"part two"
    w = treeio.Writer(str(tmp_path), "/a/b/c.txt")
    w.write(b"half")
    w.abort()
    assert (tmp_path / "a" / "b" / "c.txt").read_bytes() == b"part two"
    assert os.listdir(tmp_path / "a" / "b") == ["c.txt"]  # no temporary file left
    [entry] = treeio.list_dir(str(tmp_path), "/a/b")
    assert (entry.name, entry.path, entry.type, entry.size) == ("c.txt", "/a/b/c.txt", "file", 8)


def test_mkdir_attrs_and_deep_listings_answer_owner_mode_and_times(tmp_path):
    root = str(tmp_path)
    with pytest.raises(errors.FileNotFound):
        treeio.make_dir(root, "/a/b", False, None, None, None)  # no parents without `parents`
    made = treeio.make_dir(root, "/a/b", True, 0o750, 1234, 5678)
    assert (made.path, made.type, made.mode, made.uid, made.gid) == ("/a/b", "dir", 0o750, 1234, 5678)
    assert treeio.make_dir(root, "/a/b", False, None, None, None).mode == 0o750  # kept as it was
    w = treeio.Writer(root, "/a/b/f.txt")
    w.write(b"12345")
    w.commit()
    with pytest.raises(errors.Conflict):
        treeio.make_dir(root, "/a/b/f.txt", False, None, None, None)
    st = treeio.set_attrs(root, "/a/b/f.txt", 0o600, None, 42)
    assert (st.mode, st.uid, st.gid, st.size) == (0o600, os.getuid(), 42, 5)
    assert os.stat(tmp_path / "a/b/f.txt").st_gid == 42 and st.ctime >= st.mtime > 0 and st.atime > 0
    assert [e.path for e in treeio.list_tree(root, "/", 1)] == ["/a"]
    assert [e.path for e in treeio.list_tree(root, "/", 3)] == ["/a", "/a/b", "/a/b/f.txt"]
    assert [e.path for e in treeio.list_tree(root, "/a", 16)] == ["/a/b", "/a/b/f.txt"]
    assert treeio.stat_entry(root, "/").type == "dir"
    for bad in (dict(mode=0o10000), dict(uid=-1), dict(gid=2**32)):
        args = {"mode": None, "uid": None, "gid": None, **bad}
        with pytest.raises(errors.InvalidRequest, match=next(iter(bad))):
            treeio.set_attrs(root, "/a", **args)
    with pytest.raises(errors.InvalidRequest, match="depth"):
        treeio.list_tree(root, "/", 17)


# ---- worker.host.stores (ext4 images, loop mounts: root) ----------------------------------------
@pytest.mark.skipif(not ROOT, reason="loop mounts need root")
def test_a_store_limits_its_size_clones_exports_and_imports(tmp_path):
    async def main():
        s = stores.Stores(str(tmp_path))
        try:
            info = await s.create("volume", "v1", 16)
            assert (info.size_mb, info.kind) == (16, "volume")
            with pytest.raises(errors.Conflict) as e:
                await s.create("volume", "v1", 16)
            assert e.value.code == "volume_exists"
            root = s.fs("volume", "v1")
            assert os.stat(root).st_mode & 0o777 == 0o777 and os.listdir(root) == []
            (tmp_path / "stores" / "volume" / "v1" / "fs" / "a.txt").write_text("one")
            with pytest.raises(OSError) as full:
                with open(os.path.join(root, "big"), "wb") as f:
                    for _ in range(32):
                        f.write(b"\0" * 1024 * 1024)
                        f.flush()
                        os.fsync(f.fileno())
            assert full.value.errno == 28  # ENOSPC: the size holds
            os.unlink(os.path.join(root, "big"))
            copy = await s.clone("volume", "v1", "v2")
            assert copy.name == "v2" and open(os.path.join(s.fs("volume", "v2"), "a.txt")).read() == "one"
            chunks = [c async for c in stores.export_tar(root)]
            with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as t:
                assert t.getnames() == ["a.txt"]  # relative to the root

            async def body(data: bytes):
                yield data

            def tar_of(*members: tuple[str, bytes]) -> bytes:
                buf = io.BytesIO()
                with tarfile.open(fileobj=buf, mode="w") as t:
                    for name, data in members:
                        ti = tarfile.TarInfo(name)
                        ti.size = len(data)
                        t.addfile(ti, io.BytesIO(data))
                return buf.getvalue()

            # an absolute symbolic link (a venv's bin/python3) round-trips; a member written "through"
            # one lands inside the tree (the import is chrooted), never on the host
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as t:
                for name, target in (("venv/bin/python3", "/usr/bin/python3"), ("etc", "/etc")):
                    ti = tarfile.TarInfo(name)
                    ti.type, ti.linkname = tarfile.SYMTYPE, target
                    t.addfile(ti)
                ti = tarfile.TarInfo("etc/planted")
                ti.size = 2
                t.addfile(ti, io.BytesIO(b"pl"))
            v2 = s.fs("volume", "v2")
            try:
                await stores.import_tar(v2, body(buf.getvalue()))
            except errors.InvalidRequest:
                pass  # refusing the member written through the link is fine too
            assert os.readlink(os.path.join(v2, "venv/bin/python3")) == "/usr/bin/python3"
            assert not os.path.exists("/etc/planted")
            again = b"".join([c async for c in stores.export_tar(v2)])
            with tarfile.open(fileobj=io.BytesIO(again)) as t:
                assert t.getmember("venv/bin/python3").linkname == "/usr/bin/python3"
            os.unlink(os.path.join(v2, "etc"))
            shutil.rmtree(os.path.join(v2, "venv"))
            counts = await stores.import_tar(s.fs("volume", "v2"), body(tar_of(("x/y.txt", b"yy"))))
            assert counts["files"] == 1 and open(os.path.join(s.fs("volume", "v2"), "x/y.txt")).read() == "yy"
            for bad in ("../escape", "/abs"):
                with pytest.raises(errors.InvalidRequest, match="refused"):
                    await stores.import_tar(s.fs("volume", "v2"), body(tar_of((bad, b"no"))))
            assert not (tmp_path / "stores" / "volume" / "escape").exists()
            v2 = s.fs("volume", "v2")
            before = sorted(os.listdir(v2))
            for bad in (b"garbage" * 100, b"", gzip.compress(b"garbage" * 100), b'{"not": "a tar"}'):
                with pytest.raises(
                    errors.InvalidRequest, match="not a tar archive.*send a tar.*nothing was written"
                ):
                    await stores.import_tar(v2, body(bad))
            assert sorted(os.listdir(v2)) == before  # nothing changed
            whole = gzip.compress(tar_of(("a.txt", b"a" * 600), ("b.txt", os.urandom(40_000))))
            with pytest.raises(errors.InvalidRequest, match="damaged after 1 file"):
                await stores.import_tar(v2, body(whole[: len(whole) // 2]))
            assert open(os.path.join(v2, "a.txt")).read() == "a" * 600 and not os.path.exists(
                os.path.join(v2, "b.txt")
            )  # the cut file removed
            with pytest.raises(errors.InsufficientStorage) as e:
                await stores.import_tar(
                    s.fs("volume", "v2"), body(tar_of(("huge", b"\0" * 20 * 1024 * 1024)))
                )
            assert e.value.code == "store_full"
            assert not os.path.exists(os.path.join(s.fs("volume", "v2"), "huge"))  # not left half-written
            await s.delete("volume", "v1")
            with pytest.raises(errors.NotFound):
                s.fs("volume", "v1")
        finally:
            for mp in storage.mounts_under(str(tmp_path)):
                await storage.unmount(mp)

    asyncio.run(main())


@pytest.mark.skipif(not ROOT or not shutil.which("gcc"), reason="needs root (chroot) and gcc")
def test_an_export_never_loads_code_a_sandbox_planted_in_the_tree(tmp_path):
    """A tree holding /etc/nsswitch.conf and the NSS module it names: glibc would dlopen it as root
    for tarfile's owner-name lookups after the chroot (and root leaves a chroot)."""
    tree = tmp_path / "tree"
    marker = tmp_path / "pwned"
    (tree / "etc").mkdir(parents=True)
    (tree / "lib").mkdir()
    src = tmp_path / "evil.c"
    src.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void run(void) {\n"
        '  FILE *f = fopen("/marker-in-tree", "w"); if (f) fclose(f);\n'
        "}\n"
    )
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(tree / "lib" / "libnss_evil.so.2"), str(src)], check=True
    )
    (tree / "etc" / "nsswitch.conf").write_text("passwd: evil\ngroup: evil\n")
    (tree / "owned-by-someone").write_text("x")
    os.chown(tree / "owned-by-someone", 4321, 4321)
    # a module a lazy import would look for under the interpreter's own path, inside the tree
    planted = tree / os.path.relpath(os.path.dirname(tarfile.__file__), "/")
    planted.mkdir(parents=True)
    (planted / "antigravity.py").write_text("open('/marker-py', 'w').close()\n")

    async def main():
        return b"".join([c async for c in stores.export_tar(str(tree))])

    data = asyncio.run(main())
    assert not (tree / "marker-in-tree").exists() and not (tree / "marker-py").exists()
    assert not marker.exists()
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        m = t.getmember("owned-by-someone")
        assert (m.uid, m.uname) == (4321, "")  # numeric owners only
        assert "etc/nsswitch.conf" in t.getnames()


def test_a_write_over_a_directory_or_with_a_long_name_is_a_clear_400(tmp_path):
    treeio.Writer(str(tmp_path), "/dd/x").commit()
    w = treeio.Writer(str(tmp_path), "/dd")
    w.write(b"data")
    with pytest.raises(errors.InvalidPath, match="directory"):
        w.commit()
    assert os.listdir(tmp_path) == ["dd"]  # no temporary file left
    for call in (
        lambda: treeio.Writer(str(tmp_path), "/" + "a" * 300),
        lambda: treeio.list_dir(str(tmp_path), "/" + "a" * 300),
    ):
        with pytest.raises(errors.InvalidPath, match="255"):
            call()
