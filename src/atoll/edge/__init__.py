"""The edge (`atoll edge`): the client-facing data path of sandboxes, a process of its own.

It serves a sandbox's data routes in the API's own shapes (exec, streamed exec, background
processes, their list and output, files — read, write, stat, list, mkdir, move, chmod, watch, tar
— and terminals) and sends them straight to the worker that holds the sandbox, with a
short-lived grant the server mints for the caller's API key (`POST /v1/sandboxes/{id}/grant`,
core.grants). The server authorizes and routes; the worker serves; the bytes never pass through a
server, so a server restart does not cut a stream. It holds no worker token and no database.
A watchdog ends a call whose worker froze or whose key was revoked.
Imports core and shared only (an import-linter contract says so); started by `atoll edge`
(cli.main) through edge.service.main.
"""
