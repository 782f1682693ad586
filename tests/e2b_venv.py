"""Python environments holding one release of the unmodified `e2b` SDK each, for the tests that
drive atoll's E2B API with it (tests/integration/test_e2b_sdk.py): cached per machine under
$ATOLL_TEST_E2B_VENV_DIR (default /var/tmp/atoll-test-e2b), keyed by the pins and the Python
version, built once with this machine's pip configuration (its package index). atoll is not
installed there: the SDK talks to atoll over HTTP only.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests import venvs

CACHE = Path(os.environ.get("ATOLL_TEST_E2B_VENV_DIR", "/var/tmp/atoll-test-e2b"))
RELEASES = {
    "2.63": ["e2b==2.63.0", "e2b-code-interpreter==2.11.5"],
    "2.31": ["e2b==2.31.0"],
    # the OpenAI Agents SDK's own E2B extension (its `e2b` extra pins e2b 2.31.0), unchanged
    "agents": ["openai-agents[e2b]==0.24.0"],
}


def python(release: str) -> Path:
    """The venv's python for `release` (a key of RELEASES), built first when missing."""
    return venvs.built(CACHE, RELEASES[release])
