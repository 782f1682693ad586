"""Python environments holding one release of the unmodified `e2b` SDK each, for the tests that
drive atoll's E2B API with it (tests/integration/test_e2b_sdk.py): cached per machine under
$ATOLL_TEST_E2B_VENV_DIR (default /var/tmp/atoll-test-e2b), keyed by the pins and the Python
version, built once with this machine's pip configuration (its package index). atoll is not
installed there: the SDK talks to atoll over HTTP only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("ATOLL_TEST_E2B_VENV_DIR", "/var/tmp/atoll-test-e2b"))
RELEASES = {
    "2.63": ["e2b==2.63.0", "e2b-code-interpreter==2.11.5"],
    "2.31": ["e2b==2.31.0"],
    # the OpenAI Agents SDK's own E2B extension (its `e2b` extra pins e2b 2.31.0), unchanged
    "agents": ["openai-agents[e2b]==0.24.0"],
}


def python(release: str) -> Path:
    """The venv's python for `release` (a key of RELEASES), built first when missing."""
    reqs = RELEASES[release]
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
