"""Template layer build step: the compatibility shim is compiled, installed, preloaded and hashed."""

from __future__ import annotations

import asyncio
import os
import pty
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from atoll.core import errors
from atoll.worker.images import login_profile, templates
from atoll.worker.images import shim as shim_mod

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (scripts/install-deps.sh)")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (scripts/install-deps.sh)")
    rootfs = tmp_path_factory.mktemp("rootfs")
    (rootfs / "etc").mkdir()
    lib = asyncio.run(shim_mod.install(str(rootfs)))
    return rootfs, lib


def test_layer_hash_covers_the_shim_source(tmp_path, monkeypatch):
    before = templates.BASE.content_hash()
    assert before == templates.BASE.content_hash()
    changed = tmp_path / "atoll-compat.c"
    changed.write_bytes(open(shim_mod.COMPAT_SOURCE, "rb").read() + b"/* changed */\n")
    monkeypatch.setattr(shim_mod, "COMPAT_SOURCE", str(changed))
    assert templates.BASE.content_hash() != before


def test_layer_hash_covers_the_shim_flags(monkeypatch):
    before = templates.BASE.content_hash()
    monkeypatch.setattr(shim_mod, "COMPAT_CFLAGS", (*shim_mod.COMPAT_CFLAGS, "-O3"))
    assert templates.BASE.content_hash() != before


def test_shim_source_ships_with_the_package():
    assert os.path.isfile(shim_mod.COMPAT_SOURCE)
    assert "atoll.worker" in open("pyproject.toml").read().split("[tool.setuptools.package-data]")[1]


def test_shim_installed_and_preloaded(shim):
    rootfs, lib = shim
    assert lib == str(rootfs / shim_mod.COMPAT_LIBRARY.lstrip("/"))
    assert os.stat(lib).st_mode & 0o777 == 0o644
    assert (rootfs / "etc/ld.so.preload").read_text() == shim_mod.COMPAT_LIBRARY + "\n"
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
    monkeypatch.setattr(shim_mod.shutil, "which", lambda name: None)
    with pytest.raises(errors.RuntimeFailure, match="gcc and libc6-dev"):
        asyncio.run(shim_mod.install(str(tmp_path)))


@needs_gcc
def test_broken_source_fails_the_build(tmp_path):
    (tmp_path / "etc").mkdir()
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(errors.RuntimeFailure, match="gcc failed"):
        asyncio.run(shim_mod.install(str(tmp_path), source=str(bad)))
    assert not (tmp_path / "etc/ld.so.preload").exists()


# ---------------------------------------------------------------- login profile

DEBIAN_ETC_PROFILE = """\
if [ "$(id -u)" -eq 0 ]; then
  PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
else
  PATH="/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
fi
export PATH

if [ "${PS1-}" ]; then
  if [ "${BASH-}" ] && [ "$BASH" != "/bin/sh" ]; then
    if [ -f /etc/bash.bashrc ]; then
      . /etc/bash.bashrc
    fi
  else
    if [ "$(id -u)" -eq 0 ]; then
      PS1='# '
    else
      PS1='$ '
    fi
  fi
fi
"""
DEBIAN_ROOT_PROFILE = """\
if [ "$BASH" ]; then
  if [ -f ~/.bashrc ]; then
    . ~/.bashrc
  fi
fi

mesg n 2> /dev/null || true
"""


@pytest.fixture
def profiles():
    """Debian 12's two profile files (the parts that run code) in a rootfs, before and after
    (world-readable: the shells also read them as nobody)."""
    top = Path(tempfile.mkdtemp(prefix="atoll-profiles-"))
    os.chmod(top, 0o755)
    orig, edited = top / "orig", top / "edited"
    for root in (orig, edited):
        (root / "etc").mkdir(parents=True)
        (root / "root").mkdir()
        (root / "etc/profile").write_text(DEBIAN_ETC_PROFILE)
        (root / "root/.profile").write_text(DEBIAN_ROOT_PROFILE)
        os.chmod(root, 0o755)
    assert sorted(login_profile.patch(str(edited))) == ["etc/profile", "root/.profile"]
    yield orig, edited
    shutil.rmtree(top)


def test_login_profile_edits_start_no_program(profiles):
    _, edited = profiles
    etc, dot = (edited / "etc/profile").read_text(), (edited / "root/.profile").read_text()
    assert "$(id -u)" not in etc.replace("${EUID:-$(id -u)}", "")
    assert "mesg" in dot and "if [ -t 0 ] || [ -t 1 ]; then" in dot
    assert login_profile.unpatch(etc, "etc/profile") == DEBIAN_ETC_PROFILE
    assert login_profile.unpatch(dot, "root/.profile") == DEBIAN_ROOT_PROFILE
    assert login_profile.patch(str(edited)) == []  # applied once


@pytest.mark.parametrize("shell", ["bash", "dash"])
@pytest.mark.parametrize("uid", [0, 65534])
@pytest.mark.parametrize("interactive", [False, True])
def test_login_profile_edits_keep_what_the_shell_sees(profiles, shell, uid, interactive):
    """The host's bash and dash source both versions as root and as nobody: the same variables
    (PATH, PS1 included), umask and exit status."""
    if shutil.which(shell) is None:
        pytest.skip(f"needs {shell}")
    dump = 'echo "rc=$?"; umask; set | grep -E "^(PATH|PS1|HOME|i)=" ; export -p | sort'

    def run(root) -> str:
        script = f". {root}/etc/profile; HOME={root}/root; . {root}/root/.profile; {dump}"
        argv = [shell, "-c", script] if shell == "dash" else [shell, "--noprofile", "--norc", "-c", script]
        env = {"HOME": "/", "TERM": "dumb"} | ({"PS1": "> "} if interactive else {})
        if uid:
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        return out.stdout.replace(str(root), "ROOT") + out.stderr.replace(str(root), "ROOT")

    orig, edited = profiles
    before, after = run(orig), run(edited)
    assert after == before
    expected_path = (
        "/usr/local/sbin:/usr/local/bin" if uid == 0 else "/usr/local/bin:/usr/bin:/bin:/usr/local/games"
    )
    assert expected_path in after


def test_layer_hash_covers_the_login_profile_edits(monkeypatch):
    before = templates.BASE.content_hash()
    edits = ((*login_profile.EDITS[0][:2], login_profile.EDITS[0][2] + " "), *login_profile.EDITS[1:])
    monkeypatch.setattr(login_profile, "EDITS", edits)
    assert templates.BASE.content_hash() != before


@pytest.mark.skipif(shutil.which("mesg") is None, reason="needs mesg (util-linux)")
@pytest.mark.parametrize("tty_on", ["stdin", "stdout", "stderr", "none"])
def test_login_profile_still_runs_mesg_on_a_terminal(profiles, tty_on):
    """root's ~/.profile denies `write` to the login terminal (mesg n) in both versions alike, with
    the terminal on each of the standard descriptors (the host's mesg is Debian 12's)."""

    def writable_after(root) -> bool:
        master, slave = pty.openpty()
        try:
            name = os.ttyname(slave)
            os.chmod(name, 0o620)  # mesg y
            fds = {k: (slave if k == tty_on else subprocess.DEVNULL) for k in ("stdin", "stdout", "stderr")}
            subprocess.run(
                ["bash", "--noprofile", "--norc", "-c", f"HOME={root}/root; . {root}/root/.profile"],
                env={"PATH": "/usr/bin:/bin"},
                check=True,
                **fds,
            )
            return bool(os.stat(name).st_mode & 0o020)
        finally:
            os.close(slave)
            os.close(master)

    orig, edited = profiles
    before = writable_after(orig)
    assert writable_after(edited) == before
    assert before == (tty_on not in ("stdin", "stdout"))  # the profile's mesg has stderr on /dev/null


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


def test_the_code_interpreter_template_is_offered_unless_turned_off(tmp_path):
    """ATOLL_E2B_CODE_INTERPRETER (worker settings): on, `code-interpreter-v1` is a built-in template
    beside `base` (its own layer: base's packages plus the kernel's, base's hash unchanged); off, it
    is not listed and a create names the setting."""
    from atoll.worker.images import layers

    tm = templates
    ci = tm.RECIPES["code-interpreter-v1"]
    assert set(tm.BASE.packages) < set(ci.packages) and "python3-ipykernel" in ci.packages
    assert ci.content_hash() != tm.BASE.content_hash()
    store = layers.LayerStore(str(tmp_path))
    on = tm.TemplateStore(str(tmp_path), "http://mirror.invalid/debian", store)
    assert [t["name"] for t in on.status()] == ["base", "code-interpreter-v1"]
    off = tm.TemplateStore(str(tmp_path), "http://mirror.invalid/debian", store, code_interpreter=False)
    assert [t["name"] for t in off.status()] == ["base"]
    with pytest.raises(errors.TemplateNotFound) as e:
        off.recipe("code-interpreter-v1")
    assert "ATOLL_E2B_CODE_INTERPRETER=0" in e.value.message
