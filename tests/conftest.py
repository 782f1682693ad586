"""Shared test configuration: markers and the template cache shared by every test installation."""

from __future__ import annotations

import os

import pytest

# One template layer cache for all test installations, so the Debian base layer is built once per
# machine (~30-60 s) rather than once per test home.
TEMPLATE_CACHE = os.environ.get("ATOLL_TEST_TEMPLATE_DIR", "/var/tmp/atoll-test-templates")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integration" in str(item.fspath) or "e2e" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
