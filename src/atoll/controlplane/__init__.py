"""The control plane: REST API, records, lifecycle policy (idle → standby tiers), metrics.

`api` serves HTTP, `lifecycle.SandboxManager` walks the core state machine and persists every
transition before acknowledging it, `db` holds the records (SQLite by default). It talks to a worker
through the `atoll.worker.service.Worker` façade (in-process under `atoll up`).
"""
