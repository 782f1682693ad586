"""A Python environment with the OpenAI Agents SDK for the tests of
`atoll.integrations.openai_agents`: a venv holding atoll's base dependencies plus its
`openai-agents` extra (read from pyproject.toml), cached per machine under
$ATOLL_TEST_AGENTS_VENV_DIR (default /var/tmp/atoll-test-openai-agents) and keyed by those
requirements and the Python version, so it is built once (a minute; pip reaches packages the way
this machine's pip is configured) and rebuilt when a pin changes. atoll itself is not installed
there: the tests run it from this checkout (PYTHONPATH=src), so the code under test is always the
worktree's. Used by tests/integration/test_openai_agents.py and tests/unit/test_openai_agents_extra.py.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from tests import venvs

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("ATOLL_TEST_AGENTS_VENV_DIR", "/var/tmp/atoll-test-openai-agents"))


def requirements() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"]["openai-agents"])


def python() -> Path:
    """The venv's python, built first if this set of requirements has none yet."""
    return venvs.built(CACHE, requirements())


def env(**extra: str) -> dict[str, str]:
    """The environment a script in the venv runs with: atoll from this checkout."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}
