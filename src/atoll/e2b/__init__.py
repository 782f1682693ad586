"""E2B compatibility: what the unmodified `e2b` SDKs speak, for the edge process that serves them
(issue 22; plan in docs/e2b-compat.md). `proto/` holds envd's wire contract (.proto files and the
Python generated from them by scripts/gen_e2b_stubs.py)."""
