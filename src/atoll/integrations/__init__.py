"""Adapters that let other agent frameworks run on atoll sandboxes, each an optional extra.

`atoll.integrations.openai_agents`: a sandbox client for the OpenAI Agents SDK
(`pip install 'atoll[openai-agents]'`). Nothing here is imported by `import atoll`; each adapter
imports its framework only when the adapter itself is imported.
"""
