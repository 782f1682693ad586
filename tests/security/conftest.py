"""Security battery (issue 20): the fixtures of the tiers its modules come from.

The battery mixes tiers: in-process checks of the control plane (FakeAtoll), and real gVisor
sandboxes through `atoll up` (the session fixtures of tests/conftest.py). `fake` (a FakeAtoll per
test, tests/component/conftest.py) and `local` (a private installation per test,
tests/integration/conftest.py, for the modules moved from tests/integration) are imported here. Modules that need root and runsc carry `pytestmark =
pytest.mark.integration` themselves (tests/conftest.py marks by path only under tests/integration
and tests/e2e)."""

from __future__ import annotations

from tests.component.conftest import fake  # noqa: F401  (fixtures, for the modules of this tier)
from tests.integration.conftest import local  # noqa: F401
