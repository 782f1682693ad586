"""Put on PYTHONPATH of an SDK's process by tests/integration/test_e2b_domain.py: names under
$ATOLL_TEST_LOOPBACK_DOMAIN (the preview domain) resolve to 127.0.0.1 in this process, with no
query to any resolver — as wildcard DNS or hosts entries would for a user. Only Python's own
lookups (httpx: e2b 2.31, e2b-code-interpreter 2.8.1) pass here; e2b 2.63's pyqwest resolves
`*.localhost` to loopback itself (hickory, RFC 6761)."""

import os
import socket

_domain = os.environ.get("ATOLL_TEST_LOOPBACK_DOMAIN", "").lower().strip(".")
if _domain:
    _real = socket.getaddrinfo

    def _getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and name.lower().rstrip(".").endswith("." + _domain):
            return _real("127.0.0.1", *args, **kwargs)
        return _real(host, *args, **kwargs)

    socket.getaddrinfo = _getaddrinfo
