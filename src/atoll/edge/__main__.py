"""`python -m atoll.edge --channel FD --e2b-listen FD --server URL`: the edge as a child of the
server (edge.child; started by controlplane.edge_host)."""

from atoll.edge import child

child.main()
