"""Pure domain core of atoll: ids, lifecycle states and transitions, error codes, policies.

Nothing in this package performs I/O; the control plane and the worker import it, never the other
way round (enforced by import-linter in `make lint`).
"""
