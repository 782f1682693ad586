"""Integrations of atoll with other tools, each a client of atoll's API through its own SDK: they hold
no privileges but the key they are given and import no server code (an import-linter contract).
Nothing here is imported by `import atoll`; each one imports its framework only when it is imported.

`mcp`: `atoll mcp`, an MCP server whose tools create, drive and delete sandboxes (extra `mcp`).
`openai_agents`: a sandbox client for the OpenAI Agents SDK (`pip install 'atoll[openai-agents]'`).
"""
