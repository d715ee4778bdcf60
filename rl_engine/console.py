"""The terminal output of every `rlk` verb: one place decides width and wrapping.

Log lines never wrap (they stay greppable in task logs); tables get a wide page when the output is
not a terminal (an Airflow task log, a file), where rich would otherwise assume 80 columns.
"""

from __future__ import annotations

import sys

from rich.console import Console

_WIDE = 200


def console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else _WIDE
    return Console(stderr=stderr, soft_wrap=True, width=width)
