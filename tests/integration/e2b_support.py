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
