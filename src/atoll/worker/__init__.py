"""The worker (node agent): runs sandboxes on this machine through the gVisor backend.

It owns everything host-side about a sandbox: the template layer and overlay root filesystem
(`storage`, `templates`), the OCI bundle (`bundle`), runsc (`runsc`), cgroups (`cgroups`), network
namespaces (`netns`), the channel to the in-sandbox guest agent (`agent_channel`) and the checkpoint
gate. `service.Worker` is the façade the control plane calls.
"""
