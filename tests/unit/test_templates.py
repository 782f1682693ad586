"""Template layer build step: the compatibility shim is compiled, installed, preloaded and hashed."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import pytest

from atoll.core import errors
from atoll.worker.images import templates

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (scripts/install-deps.sh)")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (scripts/install-deps.sh)")
    rootfs = tmp_path_factory.mktemp("rootfs")
    (rootfs / "etc").mkdir()
    lib = asyncio.run(templates.install_compat_shim(str(rootfs)))
    return rootfs, lib


def test_layer_hash_covers_the_shim_source(tmp_path, monkeypatch):
    before = templates.BASE.content_hash()
    assert before == templates.BASE.content_hash()
    changed = tmp_path / "atoll-compat.c"
    changed.write_bytes(open(templates.COMPAT_SOURCE, "rb").read() + b"/* changed */\n")
    monkeypatch.setattr(templates, "COMPAT_SOURCE", str(changed))
    assert templates.BASE.content_hash() != before


def test_shim_source_ships_with_the_package():
    assert os.path.isfile(templates.COMPAT_SOURCE)
    assert "atoll.worker" in open("pyproject.toml").read().split("[tool.setuptools.package-data]")[1]


def test_shim_installed_and_preloaded(shim):
    rootfs, lib = shim
    assert lib == str(rootfs / templates.COMPAT_LIBRARY.lstrip("/"))
    assert os.stat(lib).st_mode & 0o777 == 0o644
    assert (rootfs / "etc/ld.so.preload").read_text() == templates.COMPAT_LIBRARY + "\n"
    dyn = subprocess.run(
        ["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in dyn.splitlines()}
    assert {"statx", "fstatat", "fstatat64", "__fxstatat", "__fxstatat64", "syscall"} <= exported


def test_shim_keeps_libc_semantics(shim):
    # Return values and errno as glibc's own: success, a kernel error, getpid through syscall().
    script = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(512)
nr = {"x86_64": 332, "aarch64": 291}[os.uname().machine]
ok = libc.statx(-100, b"/", 0x800, 0xFFF, buf)
bad = libc.statx(-100, b"/nonexistent-atoll", 0x800, 0xFFF, buf), ctypes.get_errno()
ctypes.set_errno(0)
raw = libc.syscall(ctypes.c_long(nr), -100, b"/", 0x800, 0xFFF, buf)
nosys = libc.syscall(ctypes.c_long(100000)), ctypes.get_errno()
at = libc.fstatat(-100, b"/nonexistent-atoll", buf, 0x800), ctypes.get_errno()
print(ok, bad, raw, nosys, at, libc.syscall(ctypes.c_long(39)) == os.getpid())
"""
    _rootfs, lib = shim
    out = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "LD_PRELOAD": lib}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "0 (-1, 2) 0 (-1, 38) (-1, 2) True\n"


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_shim_clears_at_no_automount(shim, tmp_path):
    """The kernel underneath sees coreutils' statx without AT_NO_AUTOMOUNT, and the output is unchanged."""
    _rootfs, lib = shim
    listed = tmp_path / "listed"  # a directory nothing else changes (the host's / holds /proc)
    listed.mkdir()
    (listed / "file").write_text("x")
    (listed / "link").symlink_to("file")

    def traced(preload: bool) -> tuple[str, str]:
        log = tmp_path / f"trace-{preload}"
        env = {**os.environ, **({"LD_PRELOAD": lib} if preload else {})}
        cmd = ["strace", "-f", "-o", str(log), "-e", "trace=statx,newfstatat", "ls", "-la", str(listed)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        return out, log.read_text()

    plain_out, plain_trace = traced(False)
    shim_out, shim_trace = traced(True)
    assert "AT_NO_AUTOMOUNT" in plain_trace  # coreutils does pass it
    assert "statx(AT_FDCWD" in shim_trace and "AT_NO_AUTOMOUNT" not in shim_trace
    assert shim_out == plain_out


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(templates.shutil, "which", lambda name: None)
    with pytest.raises(errors.RuntimeFailure, match="gcc and libc6-dev"):
        asyncio.run(templates.install_compat_shim(str(tmp_path)))


@needs_gcc
def test_broken_source_fails_the_build(tmp_path):
    (tmp_path / "etc").mkdir()
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(errors.RuntimeFailure, match="gcc failed"):
        asyncio.run(templates.install_compat_shim(str(tmp_path), source=str(bad)))
    assert not (tmp_path / "etc/ld.so.preload").exists()


def test_the_base_layer_lives_in_the_one_layer_cache_and_an_older_layout_is_adopted(tmp_path):
    from atoll.worker.images import layers

    tdir = tmp_path / "templates"
    old = tdir / templates.BASE.content_hash()
    (old / "rootfs" / "usr" / "bin").mkdir(parents=True)
    (old / "rootfs" / "usr" / "bin" / "python3").write_text("#!")
    (old / "manifest.json").write_text("{}")
    cache = layers.LayerStore(str(tdir))
    store = templates.TemplateStore(str(tdir), "http://127.0.0.1:9/debian", cache)
    assert store.status()[0]["status"] == "missing"
    rootfs = asyncio.run(store.ensure("base"))  # adopted: no mmdebstrap (the mirror is unreachable)
    key = store.key(templates.BASE)
    assert key == f"base-{templates.BASE.content_hash()}" and cache.exists(key)
    assert rootfs == cache.path(key) == str(tdir / "layers" / key / "fs")
    new, before = os.stat(os.path.join(rootfs, "usr/bin/python3")), os.stat(old / "rootfs/usr/bin/python3")
    assert (new.st_ino, new.st_dev) == (before.st_ino, before.st_dev)  # hard links, no copy
    assert store.status()[0]["status"] == "ready"
    # another installation sharing the directory finds it made
    other = templates.TemplateStore(str(tdir), "http://127.0.0.1:9/debian", layers.LayerStore(str(tdir)))
    assert other.status()[0]["status"] == "ready" and asyncio.run(other.ensure("base")) == rootfs
