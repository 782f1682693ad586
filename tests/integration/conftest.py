"""Integration tier: real runsc, namespaces and cgroups through a real `atoll up` (fixtures in tests/conftest.py)."""

from tests.conftest import run  # noqa: F401  (re-exported for the test modules)
