"""`AtollSandboxClient` and `AtollSandboxClientOptions`: the Agents SDK's `BaseSandboxClient` on
atoll, shaped like that SDK's own provider extensions (`agents.extensions.sandbox.e2b` and the
others): `create(snapshot=, manifest=, options=)` makes a sandbox and returns the SDK's
`SandboxSession` wrapper around an `AtollSandboxSession`; `resume(state)` reattaches to the sandbox
a serialized state names (resuming it from standby) or, when it is gone, makes a replacement that
the SDK hydrates from the state's snapshot; `delete(session)` ends it;
`serialize_session_state` / `deserialize_session_state` round-trip `AtollSandboxSessionState`.
`resume_by_id(sandbox_id)` reattaches to any atoll sandbox. Re-exported by the package.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from agents.sandbox.manifest import Manifest
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.sandbox_session import SandboxSession
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot

import atoll
from atoll import errors

from .. import _openai_agents_mapping as _mapping
from ._session import AtollSandboxSession, AtollSandboxSessionState


class AtollSandboxClientOptions(BaseSandboxClientOptions):
    """How `AtollSandboxClient.create` makes the sandbox. The fields that share a name with
    `client.sandboxes.create` mean the same (None: the server's default); `env` is the base
    environment, under the manifest's. `exposed_ports` are the ports `resolve_exposed_port` may
    answer (with the port's atoll preview URL). `pause_on_exit` puts the sandbox in standby
    (`pause_tier`) when the session shuts down instead of deleting it, so that `resume` finds it.
    `workspace_persistence`: "tar" (the SDK's snapshot store keeps a tar of the workspace root) or
    "fork" (it keeps the id of a fork of the whole sandbox, processes and memory included, parked
    in `pause_tier` standby; restoring forks that sandbox again).
    """

    type: Literal["atoll"] = "atoll"
    template: str = "base"
    env: dict[str, str] | None = None
    metadata: dict[str, str] | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    disk_mb: int | None = None
    user: str | None = None
    network: dict[str, list[str]] | None = None
    secrets: dict[str, str] | None = None
    timeout_s: float | None = None
    on_timeout: Literal["pause", "delete"] | None = None
    idle_timeout_s: float | None = None
    standby: dict[str, float] | None = None
    volumes: list[dict[str, Any]] | None = None
    drives: list[dict[str, Any]] | None = None
    shell: str | None = None
    exposed_ports: tuple[int, ...] = ()
    pause_on_exit: bool = False
    pause_tier: Literal["memory", "disk", "archive"] = "disk"
    workspace_persistence: Literal["tar", "fork"] = "tar"


class AtollSandboxClient(BaseSandboxClient[AtollSandboxClientOptions]):
    """Agents SDK sandbox client for atoll. `base_url` / `api_key` default to `$ATOLL_URL` /
    `$ATOLL_API_KEY` (as `atoll.AsyncClient`); or pass your own `client=atoll.AsyncClient(...)`,
    which this client then does not close. Close it with `await client.aclose()` or
    `async with AtollSandboxClient() as client:`."""

    backend_id = _mapping.BACKEND_ID
    supports_default_options = True
    _instrumentation: Instrumentation

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        client: atoll.AsyncClient | None = None,
        instrumentation: Instrumentation | None = None,
        dependencies: Any = None,
    ) -> None:
        if client is not None and (base_url is not None or api_key is not None):
            raise ValueError("AtollSandboxClient: pass either client= or base_url=/api_key=, not both")
        self._owns_client = client is None
        self.atoll = client if client is not None else atoll.AsyncClient(base_url, api_key)
        """The `atoll.AsyncClient` this client calls."""
        self._instrumentation = instrumentation if instrumentation is not None else Instrumentation()
        self._dependencies = dependencies

    async def aclose(self) -> None:
        if self._owns_client:
            await self.atoll.aclose()

    async def __aenter__(self) -> AtollSandboxClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _session(self, state: AtollSandboxSessionState, sandbox: Any) -> AtollSandboxSession:
        return AtollSandboxSession(state=state, sandbox=sandbox, client=self.atoll)

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: AtollSandboxClientOptions | None = None,
    ) -> SandboxSession:
        options = options if options is not None else AtollSandboxClientOptions()
        if not isinstance(options, AtollSandboxClientOptions):
            raise TypeError(
                f"AtollSandboxClient.create expects AtollSandboxClientOptions, not {type(options).__name__}"
            )
        manifest = manifest if manifest is not None else Manifest()
        self._validate_manifest_for_create(manifest)
        fields = options.model_dump(exclude={"type"})
        kwargs = _mapping.create_kwargs(fields, await manifest.environment.resolve())
        sandbox = await self.atoll.sandboxes.create(**kwargs)
        session_id = uuid.uuid4()
        state = AtollSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            sandbox_id=sandbox.id,
            create_options={k: v for k, v in kwargs.items() if k != "env"},
            base_env=dict(options.env or {}),
            exposed_ports=options.exposed_ports,
            pause_on_exit=options.pause_on_exit,
            pause_tier=options.pause_tier,
            workspace_persistence=options.workspace_persistence,
        )
        return self._wrap_session(self._session(state, sandbox), instrumentation=self._instrumentation)

    async def delete(self, session: SandboxSession) -> SandboxSession:
        """End the session's sandbox: deleted, or in standby with `pause_on_exit` (the same as its
        shutdown; doing both is harmless)."""
        inner = session._inner
        if not isinstance(inner, AtollSandboxSession):
            raise TypeError("AtollSandboxClient.delete expects a session made by AtollSandboxClient")
        await inner.shutdown()
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        if not isinstance(state, AtollSandboxSessionState):
            raise TypeError("AtollSandboxClient.resume expects an AtollSandboxSessionState")
        state.assert_path_grants_rebound()
        reconnected = True
        try:
            sandbox = await self.atoll.sandboxes.connect(state.sandbox_id)
        except (errors.SandboxNotFound, errors.InvalidState, errors.SandboxFailed):
            # gone (deleted, failed): a replacement, which start() hydrates from the snapshot
            reconnected = False
            env = {**state.base_env, **await state.manifest.environment.resolve()}
            kwargs = dict(state.create_options)
            if env:
                kwargs["env"] = env
            sandbox = await self.atoll.sandboxes.create(**kwargs)
            state.sandbox_id = sandbox.id
            state.workspace_root_ready = False
        inner = self._session(state, sandbox)
        inner._set_start_state_preserved(reconnected, system=reconnected)
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    async def resume_by_id(
        self,
        sandbox_id: str,
        *,
        manifest: Manifest | None = None,
        options: AtollSandboxClientOptions | None = None,
    ) -> SandboxSession:
        """A session on the existing atoll sandbox `sandbox_id` (resumed if it is in standby), for
        a sandbox made outside the Agents SDK or whose serialized state was not kept. Its workspace
        is used as it is (nothing is written at start). `atoll.errors.SandboxNotFound` if there is
        no such sandbox."""
        options = options if options is not None else AtollSandboxClientOptions()
        manifest = manifest if manifest is not None else Manifest()
        sandbox = await self.atoll.sandboxes.connect(sandbox_id)
        fields = options.model_dump(exclude={"type"})
        session_id = uuid.uuid4()
        state = AtollSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(None, str(session_id)),
            sandbox_id=sandbox.id,
            create_options={k: v for k, v in _mapping.create_kwargs(fields, {}).items() if k != "env"},
            base_env=dict(options.env or {}),
            exposed_ports=options.exposed_ports,
            pause_on_exit=options.pause_on_exit,
            pause_tier=options.pause_tier,
            workspace_persistence=options.workspace_persistence,
        )
        inner = self._session(state, sandbox)
        inner._set_start_state_preserved(True, system=True)
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, AtollSandboxSessionState)
