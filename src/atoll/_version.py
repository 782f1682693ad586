"""The package's version, in a module of its own so that the SDK (`_client`), the control plane
and the CLI read it without importing the package root (an import back up).

The one place it is written: pyproject.toml reads it as the distribution's version. A plain
constant rather than `importlib.metadata`, whose import alone costs every `atoll` command ~60 ms.
"""

__version__ = "0.2.0"
