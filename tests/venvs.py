"""Python environments the tests build once per machine from the package index: `built(cache,
reqs)` is a venv under `cache` holding `reqs`, keyed by them and the Python version, built under a
file lock so two test processes build it once, and rebuilt when a pin changes. Used by
tests/e2b_venv.py (the `e2b` SDKs) and tests/agents_venv.py (the OpenAI Agents SDK).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path


def built(cache: Path, reqs: list[str]) -> Path:
    """The python of the venv under `cache` that holds `reqs`, built first when missing (pip reaches
    packages the way this machine's pip is configured)."""
    key = hashlib.sha256(json.dumps([list(sys.version_info[:2]), reqs]).encode()).hexdigest()[:16]
    venv = cache / key
    done = venv / ".complete"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{key}.lock", "w") as lock:
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
