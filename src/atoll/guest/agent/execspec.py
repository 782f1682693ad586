"""A command to run, as it crosses every boundary below the REST API: the one definition.

The control plane builds an `ExecSpec` from a REST request (`controlplane.routes_exec`, whose
pydantic model is the public contract), the seam carries it (`core.worker_api` re-exports this
class; `core.wire` encodes it between server and worker), the worker sends `to_json()` to the
guest agent (`worker.runtimes.guest`), and the agent reads it back with `from_json`
(`handlers_exec`), which checks each field's type and range. What depends on the sandbox — that
`cwd` exists, that `user` is in /etc/passwd, which shell runs a string — the agent resolves after.
It lives in the agent's package because the agent imports nothing of atoll; stdlib only, pure.

On the host (imported as `atoll.guest.agent.execspec`) `ExecSpec` is a frozen dataclass, which
pydantic reads for the seam. The guest agent runs this file as `agent.execspec` and uses the class
as it is written below: `dataclasses` (with the `inspect`, `ast`, `dis` and `tokenize` it imports)
and `typing` would cost every idle sandbox's agent ~2 MB for nothing it needs.
"""

from __future__ import annotations

import math

DEFAULT_CAPTURE = 1 << 20
"""Bytes of each stream kept by a plain exec when the request names no limit."""
MAX_CAPTURE = 64 << 20
"""The most a request may ask the agent to keep (the server's own limit is lower)."""


class Invalid(ValueError):
    """A field of the request is not what it must be; the message says which, its value and the fix."""


class ExecSpec:
    cmd: str | list[str]
    """A shell string (run with `bash -l -c` or `sh -c`, see `shell`) or an argv list."""
    max_output_bytes: int
    """Bytes of each stream kept in a plain (not streamed) answer: the first and last halves."""
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout_s: float | None = None
    user: str | None = None
    stdin: str | None = None
    """Fed to the command, then its stdin is closed. None: /dev/null for an exec; for a background
    process a pipe kept open for send_stdin."""
    shell: Literal["bash", "sh"] | None = None
    """What runs a string cmd: `bash -l -c` or `sh -c`; None: bash when the sandbox has /bin/bash."""

    def __init__(
        self,
        cmd: str | list[str],
        max_output_bytes: int,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        user: str | None = None,
        stdin: str | None = None,
        shell: Literal["bash", "sh"] | None = None,
    ) -> None:
        # object.__setattr__: on the host the class is frozen (see the module's docstring)
        for name, value in (
            ("cmd", cmd),
            ("max_output_bytes", max_output_bytes),
            ("cwd", cwd),
            ("env", env),
            ("timeout_s", timeout_s),
            ("user", user),
            ("stdin", stdin),
            ("shell", shell),
        ):
            object.__setattr__(self, name, value)

    def to_json(self, background: bool = False) -> dict:
        """The body of the agent's POST /exec (`background`: a process handle, not an answer)."""
        return {
            "cmd": self.cmd,
            "cwd": self.cwd,
            "env": self.env,
            "timeout_s": self.timeout_s,
            "background": background,
            "user": self.user,
            "max_output_bytes": self.max_output_bytes,
            "stdin": self.stdin,
            "shell": self.shell,
        }


if __name__.startswith("atoll."):  # the host's copy: the seam's frozen dataclass
    import dataclasses
    from typing import Literal  # noqa: F401 - resolves the annotation `shell` for pydantic

    ExecSpec = dataclasses.dataclass(frozen=True, init=False)(ExecSpec)  # type: ignore[misc]


def from_json(body: dict) -> tuple[ExecSpec, bool]:
    """The spec a POST /exec body asks for, and whether it runs in the background. Raises Invalid.
    `shell` is only read here: its check needs the sandbox (shells.argv)."""
    cmd = body.get("cmd")
    if isinstance(cmd, str) and cmd.strip():
        pass
    elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd) and cmd[0]:
        cmd = list(cmd)
    else:
        raise Invalid(
            "cmd must be a non-empty string (run with bash -l -c or /bin/sh -c) or a non-empty list of strings "
            f"(the argv), got {cmd!r}"[:500]
        )
    if any("\x00" in a for a in ([cmd] if isinstance(cmd, str) else cmd)):
        raise Invalid("cmd contains a NUL byte; remove it")

    cwd = body.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd or "\x00" in cwd):
        raise Invalid(f"cwd must be a directory path string or null, got {cwd!r}")

    timeout = body.get("timeout_s")
    if timeout is not None and (
        not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not (0 < timeout < math.inf)
    ):
        raise Invalid(f"timeout_s must be a positive number of seconds or null, got {timeout!r}")

    background = body.get("background", False)
    if background is None:
        background = False
    if not isinstance(background, bool):
        raise Invalid(f"background must be true or false, got {background!r}")

    max_output = body.get("max_output_bytes")
    if max_output is None:
        max_output = DEFAULT_CAPTURE
    elif isinstance(max_output, bool) or not isinstance(max_output, int) or not 0 < max_output <= MAX_CAPTURE:
        raise Invalid(
            f"max_output_bytes must be an integer from 1 to {MAX_CAPTURE} (bytes kept per stream), "
            f"got {max_output!r}"
        )

    user = body.get("user")
    if user is not None and (not isinstance(user, str) or not user):
        raise Invalid(f"user must be a user name or null, got {user!r}")

    env = body.get("env")
    if env is not None:
        if not isinstance(env, dict):
            raise Invalid(f"env must be an object of string values or null, got {type(env).__name__}")
        for k, v in env.items():
            if not k or "=" in k or "\x00" in k or not isinstance(v, str) or "\x00" in v:
                raise Invalid(
                    f"env entry {k!r}={v!r} is invalid: names must be non-empty without '=' and "
                    "values must be strings without NUL"[:500]
                )

    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise Invalid(
            f"stdin must be a string (fed to the command, then closed) or null, got {type(stdin).__name__}"
        )
    spec = ExecSpec(
        cmd=cmd,
        max_output_bytes=max_output,
        cwd=cwd,
        env=env,
        timeout_s=timeout,
        user=user,
        stdin=stdin,
        shell=body.get("shell"),
    )
    return spec, background
