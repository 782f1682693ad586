"""The installed package's version, in a module of its own so that the SDK (`_client`), the
control plane and the CLI read it without importing the package root (an import back up)."""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("atoll")
except _metadata.PackageNotFoundError:  # running from a source checkout
    __version__ = "0.0.0+unknown"
