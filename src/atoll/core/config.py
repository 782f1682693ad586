"""Reading typed settings from `ATOLL_*` variables: one precedence, one error type.

Precedence, highest first: a command-line flag (passed in as a value), the environment variable,
the built-in default. A bad value is a `SettingsError` naming the variable, the value and what is
allowed; the entry points print it and exit with status 2. Pure (the environment is passed in);
called by controlplane.settings and worker.settings.
"""

from __future__ import annotations

import ipaddress
import math
import os
import typing
import urllib.parse
from collections.abc import Mapping


class SettingsError(ValueError):
    pass


def default_home() -> str:
    if os.geteuid() == 0:
        return "/var/lib/atoll"
    return os.path.join(os.path.expanduser("~"), ".local", "share", "atoll")


def home(flag: str | None, env: Mapping[str, str]) -> str:
    return os.path.abspath(flag or env.get("ATOLL_HOME") or default_home())


def integer(
    env: Mapping[str, str],
    name: str,
    default: int,
    *,
    lo: int | None = None,
    hi: int | None = None,
    flag: int | None = None,
    flag_name: str | None = None,
    what: str = "",
) -> int:
    """`name` from `env`, or `flag` (a command-line option, named `flag_name` in errors) when given."""
    raw = flag if flag is not None else env.get(name)
    if flag is not None and flag_name:
        name = flag_name
    bounds = f"{lo if lo is not None else '-inf'}-{hi if hi is not None else 'inf'}"
    fix = f"{f' ({what})' if what else ''}; set it to a whole number in {bounds}, or unset it for the default {default}"
    if raw is None or raw == "":
        value = default
    else:
        try:
            value = int(raw)  # decimal digits only: 1e9, 2.5 and 0x2 are refused, not read as something else
        except (TypeError, ValueError):
            raise SettingsError(f"{name}={raw!r} is not an integer{fix}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise SettingsError(f"{name}={value} is out of range {bounds}{fix}")
    return value


def number(
    env: Mapping[str, str], name: str, default: float, *, lo: float | None = None, hi: float | None = None
) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    bounds = f"{'-inf' if lo is None else format(lo, 'g')}-{'inf' if hi is None else format(hi, 'g')}"
    fix = f"; set it to a number in {bounds}, or unset it for the default {default:g}"
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number{fix}") from None
    if not math.isfinite(value):  # NaN passes every range check below
        raise SettingsError(f"{name}={raw!r} is not a finite number{fix}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise SettingsError(f"{name}={value} is out of range {bounds}{fix}")
    return value


def boolean(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r}; use 1 or 0")


def choice(
    env: Mapping[str, str], name: str, default: str, allowed: typing.Iterable[str], *, upper: bool = False
) -> str:
    raw = env.get(name) or default
    value = raw.upper() if upper else raw
    options = list(allowed)
    if value not in options:
        raise SettingsError(f"{name}={raw!r}; use one of {', '.join(options)}")
    return value


def port(value: int, where: str) -> int:
    if not 1 <= value <= 65535:
        raise SettingsError(f"port {value} is out of range 1-65535 ({where})")
    return value


def host_port(raw: str, name: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """`HOST:PORT`, `:PORT` or `PORT` (port 0 = any free port)."""
    host, sep, p = raw.rpartition(":")
    if not sep:
        host, p = "", raw
    try:
        number_ = int(p)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not HOST:PORT") from None
    if not 0 <= number_ <= 65535:
        raise SettingsError(f"{name}={raw!r}: port out of range 0-65535")
    return (host.strip("[]") or default_host), number_


def is_loopback_url(url: str) -> bool:
    """Whether `url`'s host is this machine's loopback (`localhost`, 127.0.0.0/8, ::1): the one
    place a worker ↔ server link may go without TLS."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
