"""Integrations of atoll with other tools, each a client of atoll's API through its own SDK: they hold
no privileges but the key they are given and import no server code (an import-linter contract).

`mcp`: `atoll mcp`, an MCP server whose tools create, drive and delete sandboxes.
"""
