"""Typed settings of `atoll up` (control plane + local worker), loaded from ATOLL_* variables and flags.

Precedence, highest first: command-line flag, environment variable, built-in default. Validated at
start-up (a bad value stops atoll with a message naming the variable); logged redacted.
Called by atoll.up.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

MAX_EXEC_OUTPUT_KB = 65536  # the guest agent keeps at most 64 MiB per stream


class SettingsError(ValueError):
    pass


def _default_home() -> str:
    if os.geteuid() == 0:
        return "/var/lib/atoll"
    return os.path.join(os.path.expanduser("~"), ".local", "share", "atoll")


@dataclass
class Settings:
    host: str
    """ATOLL_HOST: address the API listens on (default 127.0.0.1)."""
    port: int
    """ATOLL_PORT: API port (default 7080)."""
    home: str
    """ATOLL_HOME: state directory (default /var/lib/atoll as root, else ~/.local/share/atoll)."""
    api_key: str | None
    """ATOLL_API_KEY: admin API key; generated and saved to $ATOLL_HOME/admin.key when unset."""
    database_url: str
    """ATOLL_DATABASE_URL: SQLAlchemy URL of the records (default SQLite at $ATOLL_HOME/atoll.db)."""
    max_file_mb: int
    """ATOLL_MAX_FILE_MB: largest file body accepted by PUT …/files (default 4096)."""
    max_exec_output_kb: int
    """ATOLL_MAX_EXEC_OUTPUT_KB: KiB of each output stream kept in a non-streamed exec answer (its first
    and last halves; default 1024, at most 65536); also the upper bound of a call's max_output_bytes.
    Streamed exec output is not limited."""
    template_dir: str
    """ATOLL_TEMPLATE_DIR: where template layers are cached (default $ATOLL_HOME/templates); installations
    may share one."""
    template_snapshots: bool
    """ATOLL_TEMPLATE_SNAPSHOTS: '1' (default) creates sandboxes from a checkpoint of a booted template
    sandbox; '0' boots every sandbox cold."""
    debian_mirror: str
    """ATOLL_DEBIAN_MIRROR: Debian mirror for building template layers."""
    log_format: str
    """ATOLL_LOG_FORMAT: 'text' (default) or 'json'."""
    log_level: str
    """ATOLL_LOG_LEVEL: logging level (default INFO)."""

    def redacted(self) -> dict:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None


def _bool(name: str, raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r}; use 1 or 0")


def load(port: int | None = None, home: str | None = None, host: str | None = None) -> Settings:
    env = os.environ
    port_v = port if port is not None else _int("ATOLL_PORT", env.get("ATOLL_PORT", "7080"))
    if not 1 <= port_v <= 65535:
        raise SettingsError(f"port {port_v} is out of range 1-65535 (flag --port or ATOLL_PORT)")
    home_v = os.path.abspath(home or env.get("ATOLL_HOME") or _default_home())
    log_format = env.get("ATOLL_LOG_FORMAT", "text")
    if log_format not in ("text", "json"):
        raise SettingsError(f"ATOLL_LOG_FORMAT={log_format!r}; use 'text' or 'json'")
    log_level = env.get("ATOLL_LOG_LEVEL", "INFO").upper()
    if log_level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise SettingsError(f"ATOLL_LOG_LEVEL={log_level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    max_file = _int("ATOLL_MAX_FILE_MB", env.get("ATOLL_MAX_FILE_MB", "4096"))
    if max_file <= 0:
        raise SettingsError(f"ATOLL_MAX_FILE_MB={max_file} must be positive")
    max_exec_output = _int("ATOLL_MAX_EXEC_OUTPUT_KB", env.get("ATOLL_MAX_EXEC_OUTPUT_KB", "1024"))
    if not 1 <= max_exec_output <= MAX_EXEC_OUTPUT_KB:
        raise SettingsError(
            f"ATOLL_MAX_EXEC_OUTPUT_KB={max_exec_output} is out of range 1-{MAX_EXEC_OUTPUT_KB} "
            "(KiB per output stream of a non-streamed exec)"
        )
    return Settings(
        host=host or env.get("ATOLL_HOST", "127.0.0.1"),
        port=port_v,
        home=home_v,
        api_key=env.get("ATOLL_API_KEY") or None,
        database_url=env.get("ATOLL_DATABASE_URL") or f"sqlite:///{os.path.join(home_v, 'atoll.db')}",
        max_file_mb=max_file,
        max_exec_output_kb=max_exec_output,
        template_dir=os.path.abspath(env.get("ATOLL_TEMPLATE_DIR") or os.path.join(home_v, "templates")),
        template_snapshots=_bool("ATOLL_TEMPLATE_SNAPSHOTS", env.get("ATOLL_TEMPLATE_SNAPSHOTS", "1")),
        debian_mirror=env.get("ATOLL_DEBIAN_MIRROR", "http://deb.debian.org/debian"),
        log_format=log_format,
        log_level=log_level,
    )
