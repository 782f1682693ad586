"""`python -m atoll.ingress --channel FD --listen FD`: the ingress router process (ingress.service)."""

from atoll.ingress import service

service.main()
