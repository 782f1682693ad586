"""An archived sandbox whose archive is gone from the store (removed by another worker, or lost)
cannot come back: worker.runtimes.archiving `unarchive` fails it and answers 409 sandbox_failed
(the control plane marks the record failed), never a 5xx runtime_error."""

from __future__ import annotations

import pytest

from atoll.core import errors
from atoll.core.lifecycle import Phase, Step
from atoll.worker.host.objectstore import LocalStore
from atoll.worker.runtimes.archiving import Archiver
from atoll.worker.runtimes.runtime import RuntimeStore


async def test_an_archive_missing_from_the_store_is_a_409_sandbox_failed(tmp_path):
    runtimes = RuntimeStore(str(tmp_path / "home"), "abc123")
    archiver = Archiver(runtimes, LocalStore(str(tmp_path / "archive")), str(tmp_path / "pending.json"))
    rt = runtimes.new("sb-0000000000000001", template="base", memory_mb=512, cpus=1, env={}, disk_mb=64)
    runtimes.advance(rt, Step.ADOPTED)  # archived, its manifest neither local nor in the store
    with pytest.raises(errors.AtollError) as e:
        await archiver.unarchive(rt)
    assert (e.value.status, e.value.code) == (409, "sandbox_failed"), e.value
    assert "no archive" in e.value.message and "delete the sandbox" in e.value.message, e.value.message
    assert runtimes.get(rt.sandbox_id).phase == Phase.FAILED
