"""`python -m atoll.gateway --channel FD`: the egress gateway process (gateway.service)."""

from atoll.gateway import service

service.main()
