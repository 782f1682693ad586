"""A sandbox's resource figures for GET /v1/sandboxes/{id}/metrics, read on the host without
waking it: memory from its cgroup, disk from its writable layer's filesystem (the loop-mounted
upper image, see worker.storage), CPU from the monitor's cpuacct samples. The process count comes
from the guest agent (worker.guest), only while the sandbox runs.

Called by worker.node (the seam's `metrics`).
"""

from __future__ import annotations

import os

from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase
from atoll.worker.host import cgroups, storage

MB = 1024 * 1024


def disk_used_mb(upper_mount: str) -> float:
    """Space used in the writable layer's filesystem (0 when it is not mounted: then statvfs
    would describe the host's filesystem instead)."""
    if not storage.is_mounted(upper_mount):
        return 0.0
    st = os.statvfs(upper_mount)
    return round((st.f_blocks - st.f_bfree) * st.f_frsize / MB, 1)


def figures(
    sandbox_id: str,
    phase: Phase,
    cgroup: str,
    *,
    cpu_share: float | None,
    memory_limit_mb: int,
    disk_limit_mb: int,
    upper_mount: str,
    processes: int | None,
) -> api.SandboxMetrics:
    u = cgroups.usage(cgroup)
    memory = u[1] / MB if u is not None else 0.0
    cpu = (cpu_share or 0.0) * 100 if phase == Phase.RUNNING else 0.0
    return api.SandboxMetrics(
        sandbox_id=sandbox_id,
        phase=phase,
        cpu_percent=round(max(cpu, 0.0), 1),
        memory_used_mb=round(memory, 1),
        memory_limit_mb=memory_limit_mb,
        disk_used_mb=disk_used_mb(upper_mount),
        disk_limit_mb=disk_limit_mb,
        processes=processes,
    )
