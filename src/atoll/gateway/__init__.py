"""The egress gateway: the only way out of a sandbox's network namespace, in a process of its own.

nftables in each sandbox's host-side namespace (worker.netns) send every TCP connection the sandbox
opens to the gateway's listener there, and every DNS question to its resolver there; everything
else is dropped. The gateway decides each connection by the sandbox's policy (core.netpolicy), by
destination address, or by the name it carries (TLS SNI, HTTP Host) and the addresses that name
resolves to, then connects out from the worker's own namespace and relays the bytes.

It runs as a process beside each worker (`service`, started and stopped by worker.edge), holding
sockets the worker made inside each sandbox's namespace and handed over (SCM_RIGHTS, atoll.shared.ipc);
it does no namespace switching itself. Modules: service (the process, its channel), egress (the
TCP side: decisions, connections, quiesce), splice (the kernel byte relay), httpflow (HTTP/1.1
events from llhttp), httprelay (request by request), placeholders (secrets: the one rule),
intercept (HTTPS to a secret's host), tlsstream, fairshare (parse work per sandbox), sniff (SNI /
Host from the first bytes), names (hosts files, then the worker's resolver), dns (the resolver).
"""
