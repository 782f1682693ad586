"""Signal names a caller may send to a sandbox's process: the Linux table (sandboxes run Linux
whatever the control plane runs on), and `normalize`, which turns TERM / SIGTERM / sigterm / 15
into the canonical name ("TERM") or raises InvalidRequest listing the valid ones.

Used by controlplane.schemas (POST …/processes/{pid}/signal) and the SDK-facing docs; the guest
agent checks the name again on its side.
"""

from __future__ import annotations

from atoll.core import errors

LINUX_SIGNALS: dict[str, int] = {
    "HUP": 1, "INT": 2, "QUIT": 3, "ILL": 4, "TRAP": 5, "ABRT": 6, "BUS": 7, "FPE": 8, "KILL": 9,
    "USR1": 10, "SEGV": 11, "USR2": 12, "PIPE": 13, "ALRM": 14, "TERM": 15, "STKFLT": 16,
    "CHLD": 17, "CONT": 18, "STOP": 19, "TSTP": 20, "TTIN": 21, "TTOU": 22, "URG": 23, "XCPU": 24,
    "XFSZ": 25, "VTALRM": 26, "PROF": 27, "WINCH": 28, "IO": 29, "PWR": 30, "SYS": 31,
}  # fmt: skip
_BY_NUMBER = {n: name for name, n in LINUX_SIGNALS.items()}


def normalize(value: object) -> str:
    """The canonical name of a signal given as a name (with or without SIG, any case) or number."""
    if isinstance(value, int) and not isinstance(value, bool) and value in _BY_NUMBER:
        return _BY_NUMBER[value]
    if isinstance(value, str):
        text = value.strip().upper()
        if text.isdigit() and int(text) in _BY_NUMBER:
            return _BY_NUMBER[int(text)]
        name = text[3:] if text.startswith("SIG") else text
        if name in LINUX_SIGNALS:
            return name
    raise errors.InvalidRequest(
        f"unknown signal {value!r}; send a name or number such as TERM, SIGTERM or 15. Valid names: "
        + ", ".join(LINUX_SIGNALS)
    )
