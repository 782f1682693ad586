"""The egress gateway: the only way out of a sandbox's network namespace.

nftables in each sandbox's host-side namespace (worker.netns) send every TCP connection the sandbox
opens to the gateway's listener there, and every DNS question to its resolver there; everything
else is dropped. The gateway decides each connection by the sandbox's policy (core.netpolicy), by
destination address, or by the name it carries (TLS SNI, HTTP Host) and the addresses that name
resolves to, then connects out from the worker's own namespace and relays the bytes.

It holds sockets the worker made inside each sandbox's namespace and does no namespace switching
itself, so it can move to a process of its own (the sockets would be passed over a Unix socket).
Today it runs inside the worker process. Modules: sniff (SNI / Host from the first bytes), names
(hosts files, then the worker's resolver), egress (the TCP side), dns (the resolver side).
Called by worker.node (attach, detach, policy updates).
"""
