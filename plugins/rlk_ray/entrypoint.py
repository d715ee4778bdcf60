"""Build the shell command of a Ray job from validated pieces.

A Ray job's entrypoint is run by a shell on the cluster, so every piece of it that can come from a
DAG's params (a Jinja-rendered value, a UI trigger) goes through this module: names must be plain
CLI words, values are single arguments quoted by ``shlex.join``, and characters that could end a
line or truncate a C string are refused. Nothing is concatenated into the command unquoted.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import PurePath
from typing import Any

# Subcommand words and option names of the rlk CLI: lower-case, digits and dashes.
_NAME = re.compile(r"[a-z][a-z0-9-]*")
# A newline would end the command for the shell's history and the job log; NUL truncates argv.
_FORBIDDEN = ("\x00", "\n", "\r")

_Scalar = str | int | float | PurePath


def _check_name(kind: str, name: object) -> str:
    # fullmatch, not match with "$": "$" also matches before a trailing newline.
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{kind} {name!r} must match ^[a-z][a-z0-9-]*$")
    return name


def check_argument(value: str, what: str = "argument") -> str:
    """Return ``value`` unchanged if it is safe as one shell argument, else raise ``ValueError``."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    for bad in _FORBIDDEN:
        if bad in value:
            raise ValueError(f"{what} {value!r} contains {bad!r}; NUL and line breaks are refused")
    return value


def _scalar_text(name: str, value: object) -> str:
    # bool is an int subclass: a flag inside a list has no single spelling, so refuse it.
    if isinstance(value, bool) or value is None:
        raise ValueError(f"option {name!r}: {value!r} is not allowed inside a list")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"option {name!r}: {value!r} is not a finite number")
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (str, PurePath)):
        return check_argument(str(value), f"option {name!r} value")
    raise ValueError(f"option {name!r}: values of type {type(value).__name__} are not supported")


def option_arguments(name: str, value: Any) -> list[str]:
    """Spell one option as CLI arguments.

    ``True`` is a bare flag, ``False`` and ``None`` leave the option out, a list or tuple repeats
    the option once per item, anything else is ``--name=value``. The ``=`` form binds the value to
    its option, so a value that starts with ``-`` can never be read as another option.
    """
    _check_name("option name", name)
    if value is None or value is False:
        return []
    if value is True:
        return [f"--{name}"]
    if isinstance(value, (list, tuple)):
        return [f"--{name}={_scalar_text(name, item)}" for item in value]
    return [f"--{name}={_scalar_text(name, value)}"]


def build_rlk_command(
    verb: list[str], options: dict[str, Any] | None = None, positional: list[str] | None = None
) -> str:
    """Return the shell command ``rlk <verb...> --option=value ... [-- positional...]``, every
    argument quoted.

    Positional arguments (``rlk manifest verify FILE``) follow ``--``, so one that starts with
    ``-`` is still read as an argument, never as an option.

    >>> build_rlk_command(["matrix", "run-cell"], {"cell": "tp2 cp1", "dry-run": True})
    "rlk matrix run-cell '--cell=tp2 cp1' --dry-run"
    """
    if isinstance(verb, str) or not verb:
        raise ValueError(f"verb must be a non-empty list of words, got {verb!r}")
    argv = ["rlk"] + [_check_name("verb word", word) for word in verb]
    for name, value in (options or {}).items():
        argv += option_arguments(name, value)
    if isinstance(positional, str):
        raise ValueError(f"positional must be a list of arguments, got {positional!r}")
    if positional:
        argv += ["--"] + [check_argument(arg, "positional argument") for arg in positional]
    return shlex.join(argv)
