"""OCI runtime bundle (config.json) for one gVisor sandbox.

Pure apart from writing the file: the process is the guest agent (PID 1), the root is the overlay
rootfs, the agent directory is bind-mounted read-only at /opt/atoll, resources come from the sandbox
spec. Called by worker.service at create and before every restore (the cgroup path changes with
each generation).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from atoll.core import templatespec

AGENT_PORT = 49999
AGENT_DIR_IN_SANDBOX = "/opt/atoll"
PATH = templatespec.DEFAULT_PATH
AGENT_PYTHON = "/usr/bin/python3"
"""The interpreter the agent runs on, by its absolute path: never looked up through the PATH of the
sandbox's env, which is the template's or the caller's for their commands, not the agent's (a PATH
of `/nonexistent` failed every boot with nothing but "runsc run failed"). Every template has it: a
build refuses an image or a step without it (worker.images.builder)."""
# The runtime's own overhead (sentry, gofer, page tables) and the growth a restore brings
# (DESIGN facts: a restored sandbox uses 17–80 MB more) are put on top of what the programs may use.
RUNTIME_OVERHEAD_MB = 96
RESTORE_GROWTH_MB = 96
# User processes are limited inside the sandbox by gVisor's own pids cgroup (guest agent module
# `limits`: 1,024 tasks in all, 512 per command tree; a test keeps these equal). The host-side
# pids cgroup counts host tasks: ~6 per guest task on the ptrace platform (measured: 50 guest
# sleeps 296 host tasks, 150 -> 893), so it is set at 8x the guest limit plus room for the
# runtime and the agent, and is only the last resort: reaching it kills the sentry.
GUEST_PIDS_MAX = 1024
HOST_TASKS_PER_GUEST_TASK = 8
HOST_PIDS_LIMIT = HOST_TASKS_PER_GUEST_TASK * GUEST_PIDS_MAX + 1024

CAPS = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_AUDIT_WRITE",
    "CAP_MKNOD",
    "CAP_SETFCAP",
    "CAP_SYS_ADMIN",
]


@dataclass
class BundleSpec:
    sandbox_id: str
    hostname: str
    rootfs: str
    agent_dir: str
    netns_path: str
    cgroup_path: str
    memory_mb: int
    cpus: float | None
    env: dict[str, str]
    generation: int = 0
    agent_entry: str = "agent-source.pyz"
    agent_host: str = "0.0.0.0"
    """The address the agent listens on: the sandbox's own (not the wildcard), so that no program
    in the sandbox can bind the agent's port beside it."""
    binds: tuple[tuple[str, str, bool], ...] = ()
    """Volumes and drives: (host directory, path in the sandbox, read-only)."""
    visible_cpus: float | None = None
    """The CPU count the sandbox's programs see (`ATOLL_CPUS` for the agent, which narrows the
    CPU affinity of commands to it); the quota itself is set on the host cgroup."""


def cgroup_limit_bytes(memory_mb: int) -> int:
    return (memory_mb + RUNTIME_OVERHEAD_MB + RESTORE_GROWTH_MB) * 1024 * 1024


def tmp_size_mb(memory_mb: int) -> int:
    """The size of the sandbox's /tmp (a tmpfs in its memory): half its memory_mb, at least 16 MB."""
    return max(memory_mb // 2, 16)


def render(spec: BundleSpec) -> dict:
    env = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root", **spec.env}
    env["ATOLL_SANDBOX_ID"] = spec.sandbox_id
    env["ATOLL_GENERATION"] = str(spec.generation)
    if spec.visible_cpus:
        env["ATOLL_CPUS"] = str(spec.visible_cpus)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            # -I: isolated (no env, no user site); -S: no site import (~10 ms inside gVisor).
            "args": [
                AGENT_PYTHON,
                "-I",
                "-S",
                "-u",
                f"{AGENT_DIR_IN_SANDBOX}/{spec.agent_entry}",
                "--host",
                spec.agent_host,
                "--port",
                str(AGENT_PORT),
            ],
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576}],
        },
        "root": {"path": spec.rootfs, "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                # memory-backed: bounded at half the sandbox's memory (as Linux bounds a tmpfs at
                # half the RAM), so filling /tmp is ENOSPC for the writer, not the host's OOM
                # killer stopping the whole sandbox
                "options": ["nosuid", "nodev", "mode=1777", f"size={tmp_size_mb(spec.memory_mb)}m"],
            },
            {
                "destination": AGENT_DIR_IN_SANDBOX,
                "type": "bind",
                "source": spec.agent_dir,
                "options": ["rbind", "ro"],
            },
            *(
                {
                    "destination": dest,
                    "type": "bind",
                    "source": src,
                    "options": ["rbind", "ro" if ro else "rw"],
                }
                for src, dest, ro in spec.binds
            ),
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "network", "path": spec.netns_path},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
            ],
            "cgroupsPath": spec.cgroup_path,
            "resources": {
                "memory": {"limit": cgroup_limit_bytes(spec.memory_mb)},
                "pids": {"limit": HOST_PIDS_LIMIT},
                **({"cpu": {"quota": int(spec.cpus * 100000), "period": 100000}} if spec.cpus else {}),
            },
        },
    }


def write(bundle_dir: str, spec: BundleSpec) -> str:
    os.makedirs(bundle_dir, exist_ok=True)
    path = os.path.join(bundle_dir, "config.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(render(spec), f, indent=1)
    os.replace(tmp, path)
    return path
