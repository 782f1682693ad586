"""The `atoll` command line. The typer app lives in `atoll.cli.main` (console script `atoll`)."""
