"""The in-sandbox side of atoll: the guest agent (the `agent` package) that runs as PID 1 in every gVisor
sandbox.

`agent` is standard-library-only and imports nothing else from atoll (an import-linter contract). The
worker (`atoll.worker.host.agent_pack`) packs it into one bytecode file that every sandbox runs as
`python3 -I -S -u /opt/atoll/agent.pyc --port 49999`. The worker on the host is its only client.
Nothing in atoll imports it at runtime (tests import its modules to exercise their pure helpers).
"""
