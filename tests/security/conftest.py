"""Security battery (issue 20): the fixtures of the tiers its modules come from.

The battery mixes tiers: in-process checks of the control plane (FakeAtoll), and real gVisor
sandboxes through `atoll up` (the session fixtures of tests/conftest.py, and `local`, a private
installation per test, from tests/integration/conftest.py, imported here so that the modules moved
from tests/integration keep it). Modules that need root and runsc carry `pytestmark =
pytest.mark.integration` themselves (tests/conftest.py marks by path only under tests/integration
and tests/e2e)."""

from __future__ import annotations

from tests.integration.conftest import local  # noqa: F401  (the fixture, for test_host_hardening)
