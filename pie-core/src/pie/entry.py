"""The ``pie`` command's entry point.

A Ctrl-C while pie starts (importing its modules and building its commands take a moment) ends it as one
later does: status 130, no traceback.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130
"""128 + SIGINT, what a shell reports for a command a Ctrl-C ended."""


def main() -> None:
    try:
        from pie.cli import app

        app()
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
