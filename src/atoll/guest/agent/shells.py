"""Which shell runs a string command: `bash -l -c` when the sandbox has /bin/bash (what E2B users
bring: `source`, `[[ ]]`, a login profile), `sh -c` otherwise, or the one the call names.

A login profile resets variables (Debian's /etc/profile sets PATH), so the bash command line first
re-exports the command's environment — the template's, the sandbox's and the call's env — and only
then runs the command: what atoll was told wins over what the profile sets; the profile's other
effects (functions, aliases, variables atoll does not set) stay.

Called by `handlers_exec._exec_spec`.
"""

from __future__ import annotations

import os
import re
import shlex

from .errors import invalid

BASH = "/bin/bash"
SH = "/bin/sh"
SHELLS = ("bash", "sh")
RESTORE_VAR = "__ATOLL_ENV"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Variables the shell itself manages: re-exporting them would be wrong, not merely useless.
_SHELL_OWNED = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS"})
_has_bash: bool | None = None


def has_bash() -> bool:
    global _has_bash
    if not _has_bash:  # a positive answer is kept; bash may be installed later
        _has_bash = os.access(BASH, os.X_OK)
    return _has_bash


def argv(shell, cmd: str, env: dict) -> list[str]:
    """The argv that runs string `cmd` in `shell` ("bash", "sh" or None: bash if present). For bash,
    adds RESTORE_VAR to `env`: the exports, kept out of the command line (`ps` shows that)."""
    if shell is not None and shell not in SHELLS:
        raise invalid(
            f"shell must be 'bash' (bash -l -c), 'sh' (sh -c) or null (bash when present), got {shell!r}"[
                :300
            ]
        )
    if shell is None:
        shell = "bash" if has_bash() else "sh"
    elif shell == "bash" and not has_bash():
        raise invalid(
            f"shell 'bash' was asked for but this sandbox has no {BASH}; use shell 'sh', or install "
            "bash in the template"
        )
    if shell == "sh":
        return [SH, "-c", cmd]
    # ATOLL_* are set by the agent at spawn (the sandbox's identity), over whatever a call passed
    exports = [
        f"{k}={shlex.quote(v)}"
        for k, v in env.items()
        if _NAME.match(k) and k not in _SHELL_OWNED and not k.startswith("ATOLL_")
    ]
    if not exports:
        return [BASH, "-l", "-c", cmd]
    env[RESTORE_VAR] = f"export {' '.join(exports)}"
    # One line, so that bash's line numbers in messages are the command's own.
    return [BASH, "-l", "-c", f'eval "${RESTORE_VAR}"; unset {RESTORE_VAR}; {cmd}']
