"""What the E2B integration tests (test_e2b_sdk.py, test_e2b_domain.py) share."""

from __future__ import annotations

import time

import httpx


def template_ready(atoll_up, name: str, timeout: float) -> dict:
    """Wait for a built-in template the worker builds in the background after `base`: its record
    once ready, or as it is when `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        t = httpx.get(f"{atoll_up.url}/v1/templates/{name}", headers=atoll_up.headers(), timeout=30).json()
        if t.get("status") == "ready" or time.monotonic() > deadline:
            return t
        time.sleep(2)


def code_interpreter_ready(atoll_up) -> None:
    """Wait (up to 20 minutes) for the `code-interpreter-v1` template the worker builds at first
    start; fail at once when the installation runs without it."""
    listed = httpx.get(f"{atoll_up.url}/v1/templates", headers=atoll_up.headers()).json()["items"]
    assert "code-interpreter-v1" in [t["name"] for t in listed], (
        "the installation runs without the code interpreter template: run this with "
        "ATOLL_E2B_CODE_INTERPRETER=1 in the environment (make test-ecosystem does)"
    )
    t = template_ready(atoll_up, "code-interpreter-v1", 1200)
    assert t["status"] == "ready", t
