"""Drives `atoll.integrations.openai_agents` the way the OpenAI Agents SDK's runtime does, against
a real atoll ($ATOLL_URL / $ATOLL_API_KEY), and prints what it saw as one JSON object; run by
tests/integration/test_openai_agents.py inside a venv that has openai-agents (tests/agents_venv.py).
No model is called: sessions are driven through the client directly, never through `Runner.run`.

    python openai_agents_driver.py SCENARIO SNAPSHOT_DIR LABEL
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import agents
from agents.sandbox import LocalSnapshotSpec, Manifest
from agents.sandbox.entries import File
from agents.sandbox.errors import ExecTimeoutError, WorkspaceReadNotFoundError
from agents.sandbox.manifest import Environment

import atoll
from atoll.integrations.openai_agents import AtollSandboxClient, AtollSandboxClientOptions


def text(result) -> dict:
    return {"stdout": result.stdout.decode(), "stderr": result.stderr.decode(), "exit_code": result.exit_code}


async def state_of(client: AtollSandboxClient, sandbox_id: str) -> str:
    try:
        return (await client.atoll.sandboxes.get(sandbox_id)).state
    except atoll.errors.SandboxNotFound:
        return "gone"


async def read_text(session, path: str) -> str:
    return (await session.read(Path(path))).read().decode()


async def basic(client: AtollSandboxClient, out: dict, label: str, snapshots: Path) -> None:
    """Open a session from a manifest, exec, files, errors, PTY; close (the sandbox is deleted)."""
    manifest = Manifest(
        entries={"notes/hello.txt": File(content=b"from the manifest\n")},
        environment=Environment(value={"GREETING": "hi"}),
    )
    options = AtollSandboxClientOptions(
        template="base", env={"BASE": "1", "GREETING": "base"}, metadata={"test": label}
    )
    session = await client.create(manifest=manifest, options=options)
    out["sandbox_id"] = session.state.sandbox_id
    async with session:
        out["echo"] = text(await session.exec('echo "$GREETING $BASE"; pwd'))
        out["fail"] = text(await session.exec("echo oops >&2; exit 3"))
        out["manifest_file"] = await read_text(session, "notes/hello.txt")
        import io

        await session.write(Path("data/out.txt"), io.BytesIO(b"written by the agent\n"))
        out["written"] = await read_text(session, "data/out.txt")
        out["cat"] = text(await session.exec("cat data/out.txt"))
        try:
            await session.read(Path("missing.txt"))
        except WorkspaceReadNotFoundError as exc:
            out["missing"] = type(exc).__name__
        try:
            await session.exec("sleep 30", timeout=1)
        except ExecTimeoutError as exc:
            out["timeout"] = type(exc).__name__
        out["supports_pty"] = session.supports_pty()
        started = await session.pty_exec_start("read line; echo got:$line", tty=True, yield_time_s=1)
        out["pty_started"] = {"live": started.process_id is not None, "exit_code": started.exit_code}
        update = await session.pty_write_stdin(session_id=started.process_id, chars="abc\n", yield_time_s=5)
        out["pty"] = {"output": update.output.decode(errors="replace"), "exit_code": update.exit_code}
        plain = await session.pty_exec_start("echo one; sleep 0.3; echo two", tty=False, yield_time_s=10)
        out["pty_plain"] = {"output": plain.output.decode(), "exit_code": plain.exit_code}
        out["running"] = await session.running()
    out["state_after_close"] = await state_of(client, out["sandbox_id"])


async def resume(client: AtollSandboxClient, out: dict, label: str, snapshots: Path) -> None:
    """pause_on_exit: the sandbox goes to standby on close; its serialized state resumes it (the
    same sandbox, workspace as it was); resume_by_id reattaches too; an unknown id is refused."""
    options = AtollSandboxClientOptions(metadata={"test": label}, pause_on_exit=True, pause_tier="memory")
    session = await client.create(manifest=Manifest(), options=options)
    async with session:
        await session.exec("echo kept > state.txt")
    sandbox_id = session.state.sandbox_id
    out["state_after_close"] = await state_of(client, sandbox_id)
    payload = json.loads(json.dumps(client.serialize_session_state(session.state)))
    state = client.deserialize_session_state(payload)
    resumed = await client.resume(state)
    async with resumed:
        out["resumed_same_id"] = resumed.state.sandbox_id == sandbox_id
        out["resumed_file"] = await read_text(resumed, "state.txt")
    out["state_after_second_close"] = await state_of(client, sandbox_id)
    by_id = await client.resume_by_id(sandbox_id)
    async with by_id:
        out["by_id"] = text(await by_id.exec("cat /workspace/state.txt"))
    out["state_after_by_id_close"] = await state_of(client, sandbox_id)  # default options: deleted
    try:
        await client.resume_by_id("sb-0000000000000000")
    except atoll.errors.AtollError as exc:
        out["unknown_id"] = type(exc).__name__


async def snapshot(client: AtollSandboxClient, out: dict, label: str, snapshots: Path) -> None:
    """A workspace snapshot (tar, and fork) outlives its sandbox: resume makes a replacement and
    restores the workspace into it."""
    for mode in ("tar", "fork"):
        options = AtollSandboxClientOptions(metadata={"test": label}, workspace_persistence=mode)
        session = await client.create(
            manifest=Manifest(), options=options, snapshot=LocalSnapshotSpec(base_path=snapshots / mode)
        )
        async with session:
            await session.exec(f"mkdir -p sub && echo {mode}-content > sub/file.txt")
        first = session.state.sandbox_id
        stored = sorted(p.name for p in (snapshots / mode).iterdir())
        raw = (snapshots / mode / stored[0]).read_bytes()
        state = client.deserialize_session_state(
            json.loads(json.dumps(client.serialize_session_state(session.state)))
        )
        resumed = await client.resume(state)
        async with resumed:
            out[mode] = {
                "first_state": await state_of(client, first),
                "new_sandbox": resumed.state.sandbox_id != first,
                "file": await read_text(resumed, "sub/file.txt"),
                "stored_is_ref": raw.startswith(b"ATOLL_SANDBOX_SNAPSHOT_V1\n"),
            }
        if mode == "fork":
            snapshot_id = raw.split(b"\n", 1)[1].decode()
            out["fork_snapshot_state"] = await state_of(client, snapshot_id)
            await client.atoll.sandboxes.delete(snapshot_id)
    # Each persist of a fork-mode session parks one fork; closing the resumed session made a
    # second, which the snapshot store now names. They are the user's to delete.
    stored = (snapshots / "fork" / sorted(p.name for p in (snapshots / "fork").iterdir())[0]).read_bytes()
    remaining = await client.atoll.sandboxes.list(metadata={"test": label})
    out["remaining"] = [(s.id == stored.split(b"\n", 1)[1].decode(), s.state) for s in remaining]
    for s in remaining:
        await s.delete()


async def failures(client: AtollSandboxClient, out: dict, label: str, snapshots: Path) -> None:
    """atoll errors as the Agents SDK's own exception types, with atoll's code in their context;
    and an exposed port as the sandbox's preview URL."""
    from agents.sandbox.errors import (
        ExecTransportError,
        ExposedPortUnavailableError,
        WorkspaceArchiveReadError,
        WorkspaceArchiveWriteError,
    )

    def seen(exc) -> dict:
        return {"type": type(exc).__name__, "code": exc.context.get("code"), "retryable": exc.retryable}

    try:
        await client.create(
            options=AtollSandboxClientOptions(template="no-such-template", metadata={"test": label})
        )
    except atoll.errors.AtollError as exc:
        out["bad_template"] = type(exc).__name__
    options = AtollSandboxClientOptions(metadata={"test": label}, exposed_ports=(8000,))
    session = await client.create(options=options)
    async with session:
        await session.exec("mkdir -p adir && echo x > afile")
        try:
            await session.read(Path("adir"))
        except WorkspaceArchiveReadError as exc:
            out["read_dir"] = seen(exc)
        import io

        try:
            await session.write(Path("afile/child.txt"), io.BytesIO(b"x"))
        except (WorkspaceArchiveWriteError, ExecTransportError) as exc:
            out["write_under_file"] = seen(exc)
        endpoint = await session.resolve_exposed_port(8000)
        out["port"] = {"host": endpoint.host, "tls": endpoint.tls, "has_query": bool(endpoint.query)}
        try:
            await session.resolve_exposed_port(9000)
        except ExposedPortUnavailableError as exc:
            out["unlisted_port"] = exc.context.get("reason")
        try:
            await session.pty_write_stdin(session_id=424242, chars="x")
        except Exception as exc:  # the SDK's PtySessionNotFoundError
            out["unknown_pty"] = type(exc).__name__
        await client.atoll.sandboxes.delete(session.state.sandbox_id)  # gone behind the session's back
        try:
            await session.exec("true")
        except ExecTransportError as exc:
            out["exec_gone"] = seen(exc)
        out["running_gone"] = await session.running()


async def main() -> None:
    scenario, snapshots, label = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    out: dict = {"agents_version": agents.__version__ if hasattr(agents, "__version__") else None}
    async with AtollSandboxClient() as client:
        try:
            await {"basic": basic, "resume": resume, "snapshot": snapshot, "failures": failures}[scenario](
                client, out, label, snapshots
            )
        finally:
            left = await client.atoll.sandboxes.list(metadata={"test": label})
            out["left"] = [s.id for s in left if s.state != "deleted"]
            for s in left:
                try:
                    await s.delete()
                except atoll.errors.SandboxNotFound:
                    pass
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
