"""Helpers several of atoll's processes share; they import no process package (an import-linter
contract), only `atoll.core`.

`http11` (the small HTTP/1.1 client over asyncio + h11 under the worker's agent channels and the
control plane's worker channels), `ipc` (messages, calls and sockets between atoll's processes;
`Child`, a helper process kept running), `portstream` (connections into a sandbox's port as seam
`PortStream`s; the tunnel's line reader), `tlsstream` (TLS over streams whose first bytes were
already read: the gateway's interception, the ingress router), `ndjson` (the one line splitter of
every NDJSON stream, the SDK's included), `relay` (bytes moved both ways; the first direction to end
ends the others), `logconfig` (logging set-up of every entry point, with redaction).
"""
