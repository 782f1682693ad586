"""An atoll sandbox client for the OpenAI Agents SDK (`openai-agents` 0.24), an optional extra:
`pip install 'atoll[openai-agents]'`.

    from agents.sandbox import Manifest
    from atoll.integrations.openai_agents import AtollSandboxClient, AtollSandboxClientOptions

    async with AtollSandboxClient() as client:          # $ATOLL_URL, $ATOLL_API_KEY
        session = await client.create(manifest=Manifest(), options=AtollSandboxClientOptions(template="base"))
        async with session:                             # start(): workspace root + manifest entries
            result = await session.exec("echo hello")   # ExecResult(stdout=b"hello\\n", exit_code=0)

What implements what (the SDK's Sandbox Agents interface, `agents.sandbox.session`):
`AtollSandboxClient` is a `BaseSandboxClient` (create, delete, resume, deserialize_session_state;
plus `resume_by_id`), `AtollSandboxSession` a `BaseSandboxSession` (_exec_internal, read, write,
running, persist_workspace, hydrate_workspace, supports_pty / pty_exec_start / pty_write_stdin /
pty_terminate_all, _resolve_exposed_port, _shutdown_backend), `AtollSandboxClientOptions` a
`BaseSandboxClientOptions` (type "atoll") and `AtollSandboxSessionState` a `SandboxSessionState`.
docs/integrations.md says what maps to what and what is not supported.

`import atoll` never imports this module; importing it without the extra raises ImportError with
the command that installs it.
"""

from __future__ import annotations

try:
    import agents.sandbox  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a venv without the extra
    from .._openai_agents_mapping import INSTALL_HINT

    raise ImportError(
        f"atoll.integrations.openai_agents needs the OpenAI Agents SDK (openai-agents 0.24, with "
        f"its Sandbox Agents): {INSTALL_HINT} (import failed: {exc})"
    ) from exc

from ._client import AtollSandboxClient, AtollSandboxClientOptions
from ._session import AtollSandboxSession, AtollSandboxSessionState

__all__ = [
    "AtollSandboxClient",
    "AtollSandboxClientOptions",
    "AtollSandboxSession",
    "AtollSandboxSessionState",
]
