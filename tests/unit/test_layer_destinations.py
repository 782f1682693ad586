"""A files step (the JSON `files`, a Dockerfile COPY) writes each path where the template's root
file system has it, the way Docker resolves a COPY destination: the links of its parent
directories are followed inside the image's root, over the layers below the step. Debian's merged
/usr (`/bin -> usr/bin`) used to be hidden by a real `bin/` in the new layer, so the template's
/bin held only the copied file and `/bin/sh` was gone.

The lower layer here is a fake image root with Debian's links, plus links that are absolute,
climb with `..` past the root, dangle, loop, or name a host directory; a second layer has a
whiteout and an opaque directory, as a run step's layer can."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from atoll.core import errors, templatespec
from atoll.worker.images import layers

IS_ROOT = os.geteuid() == 0


def _image(root, victim) -> str:
    """A fake bottom layer: Debian's merged-/usr links and some awkward ones."""
    fs = root / "image"
    for d in (
        "usr/bin",
        "usr/sbin",
        "usr/lib",
        "usr/lib64",
        "usr/share/data",
        "etc",
        "opt",
        "srv",
        "var/app",
    ):
        (fs / d).mkdir(parents=True)
    (fs / "usr/bin/sh").write_text("#!shell\n")
    (fs / "usr/share/zoneinfo").mkdir()
    (fs / "usr/share/zoneinfo/UTC").write_text("utc\n")
    (fs / "tmp").mkdir(mode=0o1777)
    os.chmod(fs / "tmp", 0o1777)
    (fs / "root").mkdir()
    os.chmod(fs / "root", 0o700)
    for name, target in (
        ("bin", "usr/bin"),
        ("sbin", "usr/sbin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ):
        os.symlink(target, fs / name)
    os.symlink("/usr/share/zoneinfo/UTC", fs / "etc/localtime")  # a link to a file
    os.symlink("/usr/share/data", fs / "srv/abs")  # absolute: from the image's root
    os.symlink("../../../../../usr/share", fs / "srv/up")  # `..` past the root stops at it
    os.symlink("/nowhere/deep", fs / "srv/dangling")
    os.symlink("loop2", fs / "srv/loop1")
    os.symlink("loop1", fs / "srv/loop2")
    os.symlink(str(victim), fs / "srv/host")  # a host directory's path: the image's, never the host's
    (fs / "srv/plain").write_text("a file\n")
    os.symlink("/" + "/".join(["w" * 250] * 15), fs / "srv/wide")  # a long target: 3765 bytes
    os.symlink("./" * 1500 + "dots", fs / "srv/dots")  # 1500 components a turn, each turn a link
    os.symlink("/usr/bin", fs / "opt/tools")  # hidden by a whiteout in the run layer
    os.symlink("/usr/lib", fs / "var/app/current")  # hidden by an opaque var/app in the run layer
    return str(fs)


def _run_layer(root) -> str:
    """A run step's layer over the image: `rm /opt/tools` (a whiteout) and `rm -rf /var/app &&
    mkdir /var/app` (an opaque directory)."""
    fs = root / "run"
    (fs / "opt").mkdir(parents=True)
    os.mknod(fs / "opt/tools", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    (fs / "var/app").mkdir(parents=True)
    os.setxattr(fs / "var/app", "trusted.overlay.opaque", b"y")
    return str(fs)


@pytest.fixture
def stack(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    lower = [_image(tmp_path, victim)]
    if IS_ROOT:
        lower.insert(0, _run_layer(tmp_path))
    return lower, victim, layers.LayerStore(str(tmp_path / "templates"))


def _write(store, lower, items, key="k"):
    """files_layer into a fresh layer: (what it returned, {relative path: kind, link target or
    data} of the layer, its directories' modes)."""

    async def go():
        async with store.making(key) as fs:
            assert fs is not None
            moved = await store.files_layer(fs, items, lower)
            tree, modes = {}, {}
            for dirpath, dirs, files in os.walk(fs):
                for n in dirs + files:
                    p = os.path.join(dirpath, n)
                    rel = os.path.relpath(p, fs)
                    if os.path.islink(p):
                        tree[rel] = ("link", os.readlink(p))
                    elif os.path.isdir(p):
                        modes[rel] = stat.S_IMODE(os.lstat(p).st_mode)
                    else:
                        with open(p, "rb") as f:
                            tree[rel] = ("file", f.read())
            return moved, tree, modes

    return asyncio.run(go())


def _file(path, data=b"x"):
    return templatespec.FileItem(path, data, 0o755)


@pytest.mark.parametrize(
    "path, real",
    [
        ("/bin/tool2", "usr/bin/tool2"),  # the defect: a real bin/ in the layer hid /bin -> usr/bin
        ("/sbin/s", "usr/sbin/s"),
        ("/lib/x86_64-linux-gnu/libx.so", "usr/lib/x86_64-linux-gnu/libx.so"),
        ("/lib64/ld-x.so", "usr/lib64/ld-x.so"),
        ("/srv/abs/f", "usr/share/data/f"),  # an absolute target starts at the image's root
        ("/srv/up/f", "usr/share/f"),  # `..` stops at the root
        ("/srv/dangling/f", "nowhere/deep/f"),  # a dangling link's target is made, as Docker does
        ("/usr/bin/plain", "usr/bin/plain"),
        ("/etc/localtime", "etc/localtime"),  # a link to a file is replaced by the file, not followed
    ],
)
def test_a_path_is_written_where_the_image_has_it(stack, path, real):
    lower, _victim, store = stack
    moved, tree, _modes = _write(store, lower, [_file(path, b"data")])
    assert tree == {real: ("file", b"data")}, tree
    assert moved == ([] if "/" + real == path else [(path, "/" + real)])


def test_the_layer_never_hides_the_merged_usr_links(stack):
    """What the tester saw: after `files {"/bin/tool2": ...}` the sandbox's /bin held only tool2."""
    lower, _victim, store = stack
    _moved, tree, _modes = _write(store, lower, [_file("/bin/tool2"), _file("/sbin/s"), _file("/lib/l")])
    assert sorted(tree) == ["usr/bin/tool2", "usr/lib/l", "usr/sbin/s"]
    assert not any(p.split("/")[0] in ("bin", "sbin", "lib", "lib64") for p in tree)


def test_a_link_to_a_host_directory_resolves_inside_the_image_and_the_host_is_untouched(stack):
    lower, victim, store = stack
    _moved, tree, _modes = _write(store, lower, [_file("/srv/host/planted", b"owned")])
    assert tree == {str(victim).lstrip("/") + "/planted": ("file", b"owned")}
    assert os.listdir(victim) == []


def test_a_link_item_lands_through_the_parent_links_and_keeps_its_target(stack):
    lower, _victim, store = stack
    item = templatespec.FileItem("/bin/python", b"", link="python3")
    _moved, tree, _modes = _write(store, lower, [item])
    assert tree == {"usr/bin/python": ("link", "python3")}


@pytest.mark.parametrize(
    "item, words",
    [
        (_file("/bin"), "/bin is a symbolic link to the directory /usr/bin"),
        (
            templatespec.FileItem("/lib64", b"", link="/somewhere"),
            "/lib64 is a symbolic link to the directory /usr/lib64",
        ),
        (_file("/etc"), "/etc is a directory in the template"),
        (_file("/srv/loop1/f"), "loop (at /srv/loop"),
        (_file("/srv/plain/f"), "/srv/plain/f is below /srv/plain, which is a file"),
        (_file(f"/srv/wide/{'z' * 250}/{'z' * 250}"), "longer than 4096 bytes"),  # bounded work
        (_file("/srv/dots/f"), "longer than 4096 bytes"),
    ],
)
def test_what_would_hide_a_directory_or_cannot_resolve_is_refused_naming_the_path(stack, item, words):
    lower, _victim, store = stack
    with pytest.raises(errors.InvalidRequest, match=r"files: ") as ei:
        _write(store, lower, [item])
    assert words in ei.value.message, ei.value.message
    assert not store.exists("k")


def test_directories_the_layer_makes_keep_the_image_s_modes(stack):
    """`files {"/tmp/x": ...}` used to make the sandbox's /tmp 0755 (and /root 0755)."""
    lower, _victim, store = stack
    _moved, _tree, modes = _write(store, lower, [_file("/tmp/x"), _file("/root/.profile"), _file("/new/d/f")])
    assert modes == {"tmp": 0o1777, "root": 0o700, "new": 0o755, "new/d": 0o755}, {
        k: oct(v) for k, v in modes.items()
    }


def test_two_paths_that_resolve_to_one_file_the_last_wins(stack):
    lower, _victim, store = stack
    _moved, tree, _modes = _write(store, lower, [_file("/bin/t", b"first"), _file("/usr/bin/t", b"second")])
    assert tree == {"usr/bin/t": ("file", b"second")}


@pytest.mark.skipif(not IS_ROOT, reason="whiteouts and trusted.* xattrs need root")
@pytest.mark.parametrize(
    "path, real",
    [
        ("/opt/tools/x", "opt/tools/x"),  # the link is whited out above: a new directory
        ("/var/app/current/x", "var/app/current/x"),  # below an opaque directory: the link is gone
    ],
)
def test_whiteouts_and_opaque_directories_hide_the_links_below_them(stack, path, real):
    lower, _victim, store = stack
    _moved, tree, _modes = _write(store, lower, [_file(path)])
    assert tree == {real: ("file", b"x")}


def test_without_lower_layers_paths_are_written_as_named(tmp_path):
    store = layers.LayerStore(str(tmp_path / "templates"))
    _moved, tree, _modes = _write(store, [], [_file("/bin/tool")])
    assert tree == {"bin/tool": ("file", b"x")}
