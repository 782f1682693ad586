"""The guest agent's zipapps (atoll.worker.agent_zipapp): what they hold, and that their bytes depend
only on the sources (the template-image key hashes them). test_guest_agent.py runs them."""

from __future__ import annotations

import os
import zipfile

from atoll.worker import agent_zipapp


def test_archives_hold_the_whole_package(tmp_path):
    agent_zipapp.build(str(tmp_path))
    with zipfile.ZipFile(tmp_path / agent_zipapp.COMPILED) as z:
        compiled = z.namelist()
    with zipfile.ZipFile(tmp_path / agent_zipapp.SOURCE) as z:
        source = z.namelist()
        main = z.read("__main__.py").decode()
    modules = sorted(n for n in os.listdir(agent_zipapp.SOURCE_DIR) if n.endswith(".py"))
    assert "__main__.py" in modules and "routing.py" in modules
    assert source == ["__main__.py"] + [f"agent/{m}" for m in modules]
    assert compiled == [n + "c" for n in source]  # bytecode only: nothing compiles in the sandbox
    assert "from agent.__main__ import main" in main
    assert sorted(os.listdir(tmp_path)) == [agent_zipapp.SOURCE, agent_zipapp.COMPILED]  # no .tmp left


def test_archives_are_reproducible(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    agent_zipapp.build(str(a))
    agent_zipapp.build(str(b))
    for name in (agent_zipapp.COMPILED, agent_zipapp.SOURCE):
        assert (a / name).read_bytes() == (b / name).read_bytes()
