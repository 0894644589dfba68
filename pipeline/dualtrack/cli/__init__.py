"""The `dualtrack` command line: thin commands over the Python API (:mod:`.commands`)."""

from dualtrack.cli.commands import main

__all__ = ["main"]
