"""Identifier formats (sandbox ids, installation ids, host-wide runtime names).

Called by the control plane (to mint and validate sandbox and worker ids, worker tokens) and the worker (to derive host-wide names for
runsc containers, cgroups, network namespaces and mounts that never collide between installations).
"""

from __future__ import annotations

import hashlib
import re
import secrets

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case
SANDBOX_ID_RE = re.compile(r"^sb-[0-9a-hjkmnp-tv-z]{16}$")
DEFAULT_TENANT = "default"


def new_sandbox_id() -> str:
    """A fresh sandbox id: `sb-` + 16 base32 characters (80 random bits)."""
    return "sb-" + "".join(secrets.choice(_ALPHABET) for _ in range(16))


def is_sandbox_id(value: str) -> bool:
    return bool(SANDBOX_ID_RE.match(value))


BUILD_ID_RE = re.compile(r"^bld-[0-9a-hjkmnp-tv-z]{16}$")


def new_build_id() -> str:
    """A fresh template build id: `bld-` + 16 base32 characters."""
    return "bld-" + "".join(secrets.choice(_ALPHABET) for _ in range(16))


def is_build_id(value: str) -> bool:
    return bool(BUILD_ID_RE.match(value))


SNAPSHOT_ID_RE = re.compile(r"^snp-[0-9a-f]{16}$")


def new_snapshot_id() -> str:
    """A fresh named snapshot id: `snp-` + 16 hex digits (64 random bits)."""
    return "snp-" + secrets.token_hex(8)


def is_snapshot_id(value: str) -> bool:
    return bool(SNAPSHOT_ID_RE.match(value))


WORKER_ID_RE = re.compile(r"^wk-[0-9a-hjkmnp-tv-z]{16}$")
WORKER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
INSTALLATION_RE = re.compile(r"[0-9a-z]{1,64}")


def is_worker_name(value: str) -> bool:
    """1-64 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    return bool(WORKER_NAME_RE.fullmatch(value))


def new_worker_id() -> str:
    """A fresh worker id: `wk-` + 16 base32 characters (kept for a name across its restarts)."""
    return "wk-" + "".join(secrets.choice(_ALPHABET) for _ in range(16))


def new_token() -> str:
    """A worker token: what the server presents to one worker (issued at each registration)."""
    return "wkt_" + secrets.token_urlsafe(32)


def installation_id(home: str) -> str:
    """Short stable id of one installation, derived from its ATOLL_HOME path.

    Two installations on one host differ in ATOLL_HOME, so every host-wide name derived from this id
    (container ids, cgroups, netns names) differs too.
    """
    return hashlib.sha256(home.encode()).hexdigest()[:6]


def runtime_name(install_id: str, sandbox_id: str) -> str:
    """Host-wide name for one sandbox: runsc container id, cgroup leaf and netns name.

    Kept short because network-interface names are limited to 15 bytes elsewhere.
    """
    return f"atoll-{install_id}-{sandbox_id[3:]}"
