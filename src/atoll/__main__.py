"""`python -m atoll …` runs the CLI (same as the `atoll` command)."""

from atoll.cli.main import app

app()
