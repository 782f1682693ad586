"""Host storage rules without root: every mount gets nosuid,nodev and never noexec; secure_home
makes atoll's own state private but never touches a sandbox's or a template's filesystem; sweep
maps every runtime name back to its sandbox."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from atoll.worker.host import hostcmd, storage, sweep


def test_every_mount_gets_nosuid_nodev(monkeypatch):
    calls = []

    async def fake_run(*argv, **kw):
        calls.append(argv)
        return 0, "", ""

    monkeypatch.setattr(hostcmd, "run", fake_run)
    asyncio.run(storage.mount("/img", "/mnt", options="loop,noatime"))
    asyncio.run(storage.mount("overlay", "/r", options="lowerdir=/l,upperdir=/u", fstype="overlay"))
    assert calls[0] == ("mount", "-o", "nosuid,nodev,loop,noatime", "/img", "/mnt")
    assert calls[1] == (
        "mount",
        "-t",
        "overlay",
        "-o",
        "nosuid,nodev,lowerdir=/l,upperdir=/u",
        "overlay",
        "/r",
    )


@pytest.mark.parametrize("bad", ["suid", "dev", "noexec", "loop,exec"])
def test_options_that_undo_the_rule_or_break_gvisor_are_refused(bad):
    with pytest.raises(ValueError, match="not allowed"):
        storage.mount_options(bad)


def test_mountinfo_escapes_are_decoded():
    assert storage._unescape(r"/a\040b\134c") == "/a b\\c"
    assert storage._unescape("/plain") == "/plain"


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_secure_home_makes_atolls_state_private_and_leaves_filesystems_alone(tmp_path):
    home = tmp_path / "home"
    sbx = home / "sandboxes" / "sb-0123456789abcdef"
    for d in (
        sbx / "bundle",
        sbx / "rootfs" / "etc",
        sbx / "upper" / "upper" / "bin",
        home / "runsc" / "d",
        home / "agent",
        home / "templates" / "h" / "rootfs",
    ):
        d.mkdir(parents=True)
    files = [
        home / "atoll.db",
        home / "installation-id",
        sbx / "runtime.json",
        sbx / "bundle" / "config.json",
        home / "runsc" / "c.state",
        home / "runsc" / "d" / "c.lock",
    ]
    theirs = [
        sbx / "rootfs" / "etc" / "hosts",
        sbx / "upper" / "upper" / "bin" / "sh",
        home / "agent" / "agent.pyc",
        home / "templates" / "h" / "rootfs" / "su",
    ]
    for f in files + theirs:
        f.write_text("x")
    for p in [home, *home.rglob("*")]:
        os.chmod(p, 0o755)
    storage.secure_home(str(home))
    for d in (
        home,
        home / "sandboxes",
        sbx,
        sbx / "bundle",
        home / "runsc",
        home / "runsc" / "d",
        home / "templates",
    ):
        assert _mode(d) == 0o700, d
    for f in files:
        assert _mode(f) == 0o600, f
    # a sandbox's or template's own files, and the agent (bind-mounted into sandboxes), keep their modes
    for p in [*theirs, sbx / "rootfs", sbx / "upper" / "upper", home / "agent", home / "templates" / "h"]:
        assert _mode(p) == 0o755, p


def test_sweep_maps_runtime_names_to_their_sandbox():
    inst = sweep.Installation("/h", "abc123")
    sid = "sb-0123456789abcdef"
    assert inst.owner("atoll-abc123-0123456789abcdef") == sid  # netns
    assert inst.owner("atoll-abc123-0123456789abcdef-h") == sid  # its host side
    assert inst.owner("atoll-abc123-0123456789abcdef-3") == sid  # container id
    assert inst.owner(f"{sid}-3") == sid  # cgroup leaf
    assert inst.owner(f"/h/sandboxes/{sid}/bundle") == sid
    assert inst.owner(f"/h/sandboxes/{sid}") == sid
    assert inst.owner("atoll-ffffff-0123456789abcdef") is None  # another installation's
    assert inst.owner("/h/sandboxes/other/x") is None
    assert inst.owner("/elsewhere") is None
