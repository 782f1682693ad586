"""The guest agent's zipapps (atoll.worker.host.agent_pack): what they hold, and that their bytes depend
only on the sources (the template-image key hashes them). test_guest_agent.py runs them."""

from __future__ import annotations

import marshal
import os
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
    code = marshal.loads((tmp_path / agent_pack.COMPILED).read_bytes()[16:])
    blob = next(c for c in code.co_consts if isinstance(c, bytes) and len(c) > 1000)
    bundled = marshal.loads(blob)
    assert sorted(bundled) == sorted("agent" if m == "__init__.py" else f"agent.{m[:-3]}" for m in modules)
    assert bundled["agent"][0] is True and bundled["agent.routing"][0] is False
    assert "from agent.__main__ import main" in main
    assert sorted(os.listdir(tmp_path)) == [agent_pack.SOURCE, agent_pack.COMPILED]  # no .tmp left


def test_archives_are_reproducible(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    agent_pack.build(str(a))
    agent_pack.build(str(b))
    for name in (agent_pack.COMPILED, agent_pack.SOURCE):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_host_pids_ceiling_is_8x_the_guest_limit():
    """Issue 5 item 4: the host-side pids cgroup counts ~6-8 host tasks per guest task; it must sit
    well above the limit the guest agent sets inside, or a flood kills the sentry."""
    from atoll.guest.agent import limits
    from atoll.worker.host import bundle

    assert bundle.GUEST_PIDS_MAX == limits.USER_PIDS_MAX
    assert bundle.HOST_PIDS_LIMIT >= 8 * limits.USER_PIDS_MAX
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
