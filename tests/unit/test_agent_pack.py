"""The guest agent's zipapps (atoll.worker.host.agent_pack): what they hold, and that their bytes depend
only on the sources (the template-image key hashes them). test_guest_agent.py runs them."""

from __future__ import annotations

import marshal
import os
import struct
import zipfile

from atoll.worker.host import agent_pack


def test_archives_hold_the_whole_package(tmp_path):
    agent_pack.build(str(tmp_path))
    with zipfile.ZipFile(tmp_path / agent_pack.SOURCE) as z:
        source = z.namelist()
        main = z.read("__main__.py").decode()
    modules = sorted(n for n in os.listdir(agent_pack.SOURCE_DIR) if n.endswith(".py"))
    assert "__main__.py" in modules and "routing.py" in modules
    assert source == ["__main__.py"] + [f"agent/{m}" for m in modules]
    # the bytecode bundle: one .pyc whose importer serves every module of the package from memory
    data = (tmp_path / agent_pack.COMPILED).read_bytes()
    code = marshal.loads(data[16:])  # the importer; the table follows it, its size at the end
    assert not any(isinstance(c, bytes) and len(c) > 1000 for c in code.co_consts)  # not a constant
    size = int.from_bytes(data[-8:], "little")
    bundled = marshal.loads(data[-8 - size : -8])
    assert sorted(bundled) == sorted("agent" if m == "__init__.py" else f"agent.{m[:-3]}" for m in modules)
    assert bundled["agent"][0] is True and bundled["agent.routing"][0] is False
    assert "from agent.__main__ import main" in main
    # atoll-init, compiled statically, and the key it was compiled under; no .tmp left
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            agent_pack.SOURCE,
            agent_pack.COMPILED,
            agent_pack.INIT,
            agent_pack.INIT + ".key",
            agent_pack.INTERPRETER,  # the code interpreter service, copied as is
        ]
    )


def test_archives_are_reproducible(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    agent_pack.build(str(a))
    agent_pack.build(str(b))
    for name in (agent_pack.COMPILED, agent_pack.SOURCE):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_init_is_static_and_compiled_again_only_when_its_key_changes(tmp_path):
    out = agent_pack.build_init(str(tmp_path))
    with open(out, "rb") as f:
        elf = f.read()
    assert elf[:4] == b"\x7fELF"
    phoff, phentsize, phnum = struct.unpack_from("<Q", elf, 32)[0], *struct.unpack_from("<HH", elf, 54)
    types = [struct.unpack_from("<I", elf, phoff + i * phentsize)[0] for i in range(phnum)]
    assert types and 3 not in types  # no PT_INTERP: static, it needs no C library in the template
    first = os.stat(out).st_mtime_ns
    agent_pack.build_init(str(tmp_path))
    assert os.stat(out).st_mtime_ns == first
    (tmp_path / (agent_pack.INIT + ".key")).write_text("another compiler")
    agent_pack.build_init(str(tmp_path))
    assert os.stat(out).st_mtime_ns != first
    assert (tmp_path / (agent_pack.INIT + ".key")).read_text() == agent_pack.init_key()


def _init_define(name: str) -> int:
    with open(agent_pack.INIT_SOURCE) as f:
        for line in f:
            parts = line.split()
            if parts[:2] == ["#define", name]:
                return int(parts[2])
    raise AssertionError(f"{name} is not defined in {agent_pack.INIT_SOURCE}")


def test_host_pids_ceiling_is_8x_the_guest_limit():
    """Issue 5 item 4: the host-side pids cgroup counts ~6-8 host tasks per guest task; it must sit
    well above the limit atoll-init sets inside, or a flood kills the sentry."""
    from atoll.worker.host import bundle

    user_pids_max = _init_define("USER_PIDS_MAX")
    assert bundle.GUEST_PIDS_MAX == user_pids_max
    assert bundle.HOST_PIDS_LIMIT >= 8 * user_pids_max
    spec = bundle.BundleSpec("sb-x", "h", "/r", "/a", "/n", "/c", 512, None, {})
    assert bundle.render(spec)["linux"]["resources"]["pids"]["limit"] == bundle.HOST_PIDS_LIMIT


def test_the_agent_starts_by_its_absolute_path_whatever_path_the_template_sets():
    """A template with env PATH=/nonexistent built to "runsc run failed (exit 128)" at its boot:
    runsc looked `python3` up through the PATH of the sandbox's env. The agent is named by its
    path; the template's PATH stays the env of its commands."""
    from atoll.worker.host import bundle

    spec = bundle.BundleSpec("sb-x", "h", "/r", "/a", "/n", "/c", 512, None, {"PATH": "/nonexistent"})
    process = bundle.render(spec)["process"]
    assert process["args"][0] == bundle.AGENT_PYTHON == "/usr/bin/python3"
    assert "PATH=/nonexistent" in process["env"]
