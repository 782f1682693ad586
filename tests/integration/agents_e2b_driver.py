"""Drives the OpenAI Agents SDK's own E2B extension (`agents.extensions.sandbox.e2b`, unchanged,
on the e2b 2.31.0 its `e2b` extra pins) against atoll's E2B API (E2B_API_URL / E2B_SANDBOX_URL /
E2B_API_KEY from the environment), the way the SDK's runtime does — never through `Runner.run`
(no model is reachable here) — and prints what it saw as one JSON object; run by
tests/integration/test_e2b_sdk.py inside the venv tests/e2b_venv.py makes for "agents".

    python agents_e2b_driver.py [snapshot]

`snapshot`: the extension's `workspace_persistence="snapshot"` round trip instead — a workspace
persisted with E2B's native create_snapshot (atoll's named snapshot) and hydrated into a new
sandbox made from it.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path

from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
from agents.sandbox import Manifest
from agents.sandbox.entries import File
from agents.sandbox.errors import WorkspaceReadNotFoundError
from agents.sandbox.manifest import Environment
from e2b import AsyncSandbox


def text(result) -> dict:
    return {"stdout": result.stdout.decode(), "stderr": result.stderr.decode(), "exit_code": result.exit_code}


async def main() -> dict:
    out: dict = {}
    client = E2BSandboxClient()
    manifest = Manifest(
        entries={"notes/hello.txt": File(content=b"from the manifest\n")},
        environment=Environment(value={"GREETING": "hi"}),
    )
    # the extension's defaults: on_timeout pause with auto-resume; pause (not kill) on exit
    options = E2BSandboxClientOptions(sandbox_type="e2b", timeout=600, pause_on_exit=True, envs={"BASE": "1"})
    session = await client.create(manifest=manifest, options=options)
    state = session._inner.state
    out["sandbox_id"] = state.sandbox_id
    async with session:
        out["echo"] = text(await session.exec('echo "$GREETING $BASE"'))
        out["fail"] = text(await session.exec("echo oops >&2; exit 3"))
        out["manifest_file"] = (await session.read(Path("notes/hello.txt"))).read().decode()
        await session.write(Path("data/out.txt"), io.BytesIO(b"written by the agent\n"))
        out["cat"] = text(await session.exec("cat data/out.txt"))
        try:
            await session.read(Path("missing.txt"))
        except WorkspaceReadNotFoundError as exc:
            out["missing"] = type(exc).__name__
        out["supports_pty"] = session.supports_pty()
        if out["supports_pty"]:
            started = await session.pty_exec_start("read line; echo got:$line", tty=True, yield_time_s=1)
            update = await session.pty_write_stdin(
                session_id=started.process_id, chars="abc\n", yield_time_s=5
            )
            out["pty"] = {"output": update.output.decode(errors="replace"), "exit_code": update.exit_code}
        out["running"] = await session.running()
    # paused on exit, not killed: resume by its state, files and the session's env intact
    out["state_after_exit"] = str((await AsyncSandbox.get_info(state.sandbox_id)).state.value)
    resumed = await client.resume(client.deserialize_session_state(json.loads(state.model_dump_json())))
    async with resumed:
        out["after_resume"] = text(await resumed.exec("cat data/out.txt; echo $BASE"))
    await client.delete(resumed)
    out["killed"] = await AsyncSandbox.kill(state.sandbox_id)  # the extension leaves it paused
    return out


async def snapshot() -> dict:
    from agents.extensions.sandbox.e2b.sandbox import _decode_e2b_snapshot_ref

    out: dict = {}
    client = E2BSandboxClient()
    options = E2BSandboxClientOptions(sandbox_type="e2b", timeout=600, workspace_persistence="snapshot")
    session = await client.create(manifest=Manifest(), options=options)
    async with session:
        await session.write(Path("kept.txt"), io.BytesIO(b"in the snapshot\n"))
        out["first"] = session._inner.state.sandbox_id
        data = await session.persist_workspace()
        raw = data.read()
        out["snapshot_id"] = _decode_e2b_snapshot_ref(raw)
        await session.write(Path("kept.txt"), io.BytesIO(b"changed after\n"))
        await session.hydrate_workspace(io.BytesIO(raw))  # kills this sandbox, creates one from it
        out["second"] = session._inner.state.sandbox_id
        out["cat"] = text(await session.exec("cat kept.txt"))
    await client.delete(session)
    out["first_state"] = await AsyncSandbox.kill(out["first"])  # already killed by the hydrate: False
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(snapshot() if sys.argv[1:] == ["snapshot"] else main())))
