"""The ingress router: preview URLs (`https://{port}-{sandbox_id}.{domain}`) into sandboxes.

Runs beside the control plane's API (its own port, ATOLL_INGRESS_PORT); imports no process — it
reaches sandboxes only through the backend it is given (controlplane.previews).
"""
