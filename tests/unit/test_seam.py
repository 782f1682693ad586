"""The seam's wire form (core.wire), the error registry (core.errors.CODES) and the worker's own
records (runtime.json, snapshots): hermetic."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atoll import errors as sdk_errors
from atoll.core import errors, wire
from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase, Step
from atoll.worker.host.snapshots import LocalSnapshotStore
from atoll.worker.runtimes.runtime import RuntimeStore

ROOT = pathlib.Path(__file__).resolve().parents[2]
TYPES = [
    api.SandboxSpec,
    api.WorkerInfo,
    api.CreateOutcome,
    api.PauseOutcome,
    api.ResumeOutcome,
    api.Inventory,
    api.SnapshotOutcome,
    api.ExecSpec,
    api.ExecResult,
    api.ProcessStarted,
    api.ProcessInfo,
    api.FileEntry,
]
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
st.register_type_strategy(str, _text)
st.register_type_strategy(float, st.floats(allow_nan=False, allow_infinity=False))


# no time limits: on a loaded machine (the suite runs three processes on two cores) a big drawn
# SandboxSpec took past hypothesis' 200 ms deadline and failed a run that was right
@pytest.mark.parametrize("tp", TYPES, ids=lambda t: t.__name__)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_seam_type_survives_the_wire(tp, data):
    obj = data.draw(st.builds(tp))
    blob = json.dumps(wire.dump(obj))
    assert wire.load(tp, json.loads(blob)) == obj


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ev=st.one_of(
        *(st.builds(t) for t in (api.SandboxDied, api.RuntimeChanged, api.TemplateChanged, api.UsageReport))
    )
)
def test_events_survive_the_wire_by_their_kind(ev):
    assert wire.load_event(json.loads(json.dumps(wire.dump_event(ev)))) == ev


def test_exec_events_by_their_kind():
    for ev in (api.ExecOutput("stderr", "x\u2028"), api.ExecExit(137, True, 5)):
        assert wire.load_exec_event(wire.dump_exec_event(ev)) == ev


def test_process_events_by_their_kind_with_exact_bytes():
    for ev in (
        api.ProcessOutput("stdout", "\ufffdok", 3, b64="/29r"),  # b"\xffok": not UTF-8
        api.ProcessOutput("stderr", "é", 5),
        api.ProcessDropped(10, 20),
        api.ProcessExit(137, True, 5, 30),
    ):
        assert wire.load_process_event(json.loads(json.dumps(wire.dump_process_event(ev)))) == ev


def test_a_malformed_message_is_a_runtime_failure_not_a_crash():
    with pytest.raises(errors.RuntimeFailure, match="malformed pause outcome"):
        wire.load(api.PauseOutcome, {"tier": "tape"}, "pause outcome")
    with pytest.raises(errors.RuntimeFailure):
        wire.load_event({"kind": "nope"})


def test_errors_cross_the_wire_as_the_same_class():
    for e in (
        errors.SandboxNotFound("x"),
        errors.SandboxBusy("y"),
        errors.SandboxDied("z"),
        errors.InsufficientStorage("d"),
        errors.Unavailable("u"),
        errors.InvalidPath("p"),
    ):
        back = wire.error_from_body(e.status, wire.error_body(e), "?")
        assert (type(back), back.code, back.message, back.status, back.retryable) == (
            type(e),
            e.code,
            e.message,
            e.status,
            e.retryable,
        )
    odd = wire.error_from_body(418, {"error": {"code": "teapot", "message": "short and stout"}}, "?")
    assert (
        odd.code not in ("teapot",) and odd.message == "short and stout"
    )  # untrusted codes are not passed on
    assert isinstance(wire.error_from_body(502, b"<html>", "a proxy answered 502"), errors.RuntimeFailure)


def test_protocol_versions_must_match():
    wire.check_protocol(str(api.PROTOCOL_VERSION), "peer")
    for bad in (None, "0", str(api.PROTOCOL_VERSION + 1), "x"):
        with pytest.raises(errors.IncompatibleProtocol) as e:
            wire.check_protocol(bad, "the worker")
        assert e.value.code == "incompatible_protocol" and str(api.PROTOCOL_VERSION) in e.value.message


def test_the_registry_knows_every_code_the_server_raises():
    raised = set()
    for cls in _subclasses(errors.AtollError):
        raised.add(cls.code)
    assert raised <= set(errors.CODES), raised - set(errors.CODES)
    for code, info in errors.CODES.items():
        e = errors.from_code(code, "m")
        assert e.code == code and e.status == info.status and e.retryable == info.retryable


def test_the_sdk_maps_every_code_of_the_registry():
    unmapped = [c for c in errors.CODES if c not in sdk_errors._BY_CODE]
    assert not unmapped, f"the SDK has no class for {unmapped}"
    for code, info in errors.CODES.items():
        cls = sdk_errors.error_class(code, info.status)
        assert cls is not sdk_errors.AtollError


def test_docs_list_every_code():
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [c for c in errors.CODES if f"`{c}`" not in text]
    assert not missing, f"docs/api.md does not list {missing}"


def test_docs_state_the_protocol_version_the_code_speaks():
    """Docs once said protocol 3 while the code spoke 5: every number they give is the constant's
    (prose names `PROTOCOL_VERSION`; only examples carry a number)."""
    pattern = re.compile(r"(?:Atoll-Protocol:\s*|\"protocol\":\s*|[Pp]rotocol (?:version )?)`?(\d+)")
    stale = [
        f"{doc.name}: {m.group(0)!r}"
        for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
        for m in pattern.finditer(doc.read_text())
        if int(m.group(1)) != api.PROTOCOL_VERSION
    ]
    assert not stale, f"the worker protocol is {api.PROTOCOL_VERSION}; update {stale}"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


# ---- the worker's own records ------------------------------------------------------------------


def test_runtime_records_walk_the_phase_table_and_survive_a_reload(tmp_path):
    store = RuntimeStore(str(tmp_path), "abc123")
    rt = store.new("sb-0000000000000001", template="base", memory_mb=512, cpus=1, env={"A": "1"}, disk_mb=64)
    assert oct(os.stat(store.path(rt.sandbox_id, "runtime.json")).st_mode & 0o777) == "0o600"
    store.advance(rt, Step.BOOTED)
    store.advance(rt, Step.FREEZE, durable=False)
    with pytest.raises(errors.RuntimeFailure):
        store.advance(rt, Step.COMMIT_CHECKPOINT)  # out of order: a bug, and nothing is written
    again = RuntimeStore(str(tmp_path), "abc123").get(rt.sandbox_id)
    assert again.phase == Phase.FROZEN and again.env == {"A": "1"} and again.history == ["booted", "freeze"]
    store.fail(rt, "it died")
    store.fail(rt, "twice")  # the first cause stays
    assert RuntimeStore(str(tmp_path), "abc123").get(rt.sandbox_id).failure == "it died"
    assert [r.sandbox_id for r in RuntimeStore(str(tmp_path), "abc123").all()] == [rt.sandbox_id]


def test_a_thaw_is_written_shortly_after_off_the_resume_path(tmp_path):
    store = RuntimeStore(str(tmp_path), "abc123")
    rt = store.new("sb-0000000000000003", template="base", memory_mb=512, cpus=1, env={}, disk_mb=64)
    store.advance(rt, Step.BOOTED)
    store.advance(rt, Step.FREEZE, durable=False)

    def on_disk() -> Phase:
        return RuntimeStore(str(tmp_path), "abc123").get(rt.sandbox_id).phase

    async def main() -> None:
        store.advance(rt, Step.THAW, soon=True)
        assert rt.phase == Phase.RUNNING and on_disk() == Phase.FROZEN  # not yet: after the answer
        await asyncio.sleep(0.1)
        assert on_disk() == Phase.RUNNING
        store.advance(rt, Step.FREEZE, durable=False)
        store.advance(rt, Step.THAW, soon=True)
        store.advance(rt, Step.FREEZE, durable=False)  # a save in between makes the pending one moot
        await asyncio.sleep(0.1)
        assert on_disk() == Phase.FROZEN
        store.advance(rt, Step.THAW, soon=True)
        store.forget(rt.sandbox_id)  # forgotten (deleted): nothing is written later
        await asyncio.sleep(0.1)
        assert on_disk() == Phase.FROZEN

    asyncio.run(main())
    store.advance(rt, Step.FREEZE, durable=False)
    store.advance(rt, Step.THAW, soon=True)  # outside an event loop: written at once
    assert on_disk() == Phase.RUNNING


def test_a_runtime_record_of_the_previous_version_loads(tmp_path):
    sid = "sb-0000000000000002"
    d = tmp_path / "sandboxes" / sid
    d.mkdir(parents=True)
    old = {
        "sandbox_id": sid,
        "name": "atoll-abc123-0000000000000002",
        "template": "base",
        "memory_mb": 512,
        "cpus": 1,
        "env": {},
        "disk_mb": 64,
        "generation": 3,
        "phase": "checkpointed",
        "failure": None,
        "sentry_pid": None,
    }
    (d / "runtime.json").write_text(json.dumps(old))
    rt = RuntimeStore(str(tmp_path), "abc123").get(sid)
    assert (rt.phase, rt.generation, rt.cid) == (Phase.CHECKPOINTED, 3, "atoll-abc123-0000000000000002-3")


async def test_a_snapshot_is_committed_whole_and_verified(tmp_path):
    sid = "sb-0000000000000003"
    store = LocalSnapshotStore(str(tmp_path))
    (tmp_path / sid).mkdir()
    tmp = store.staging(sid, 0)
    os.makedirs(tmp)
    pathlib.Path(tmp, "checkpoint.img").write_bytes(os.urandom(4096))
    assert not store.staged_complete(tmp)  # no `done` marker: runsc did not finish
    pathlib.Path(tmp, "done").write_text("ok")
    assert store.staged_complete(tmp)
    snap = await store.commit(sid, 0, tmp)
    assert not os.path.exists(tmp) and store.committed(sid) == snap
    await store.verify(store.checked(sid))
    with open(snap.image, "r+b") as f:  # one flipped byte
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(errors.RuntimeFailure, match="damaged"):
        await store.verify(snap)
    with open(snap.image, "ab") as f:
        f.write(b"x")
    with pytest.raises(errors.RuntimeFailure, match="damaged"):
        store.checked(sid)
    await store.discard(sid)
    assert store.committed(sid) is None
    assert dataclasses.asdict(snap.manifest)["size"] == 4096


async def test_a_snapshot_an_earlier_version_committed_with_blake2b_still_verifies(tmp_path):
    import hashlib

    sid = "sb-0000000000000004"
    snap = tmp_path / sid / "snapshot"
    snap.mkdir(parents=True)
    data = os.urandom(8192)
    (snap / "checkpoint.img").write_bytes(data)
    old = {
        "sandbox_id": sid,
        "generation": 2,
        "image": "checkpoint.img",
        "size": len(data),
        "blake2b": hashlib.blake2b(data, digest_size=20).hexdigest(),
        "runsc": "x",
        "created_at": 0.0,
    }
    (snap / "manifest.json").write_text(json.dumps(old))
    store = LocalSnapshotStore(str(tmp_path))
    committed = store.checked(sid)
    assert committed.manifest.algorithm == "blake2b"
    await store.verify(committed)
    (snap / "checkpoint.img").write_bytes(os.urandom(8192))
    with pytest.raises(errors.RuntimeFailure, match="blake2b checksum"):
        await store.verify(store.checked(sid))
