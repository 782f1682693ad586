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

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("ATOLL_TEST_AGENTS_VENV_DIR", "/var/tmp/atoll-test-openai-agents"))


def requirements() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"]["openai-agents"])


def python() -> Path:
    """The venv's python, built first if this set of requirements has none yet."""
    reqs = requirements()
    key = hashlib.sha256(json.dumps([list(sys.version_info[:2]), reqs]).encode()).hexdigest()[:16]
    venv = CACHE / key
    done = venv / ".complete"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test processes build it once
        if not done.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            proc = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *reqs],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if proc.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                raise RuntimeError(f"pip install {' '.join(reqs)} failed:\n{proc.stdout}\n{proc.stderr}")
            done.write_text(json.dumps(reqs))
    return venv / "bin" / "python"


def env(**extra: str) -> dict[str, str]:
    """The environment a script in the venv runs with: atoll from this checkout."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}
