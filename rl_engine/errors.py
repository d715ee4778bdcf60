"""The exit-code contract of every `rlk` verb, and the errors that map to it.

0 ok; 1 parity failure (evidence complete, bits differ where the plan requires equality);
2 bad input or usage (named in one line); 3 infrastructure failure (a worker died, a resource never
came, evidence incomplete). Orchestration retries only 3.
"""

from __future__ import annotations

OK, PARITY_FAILURE, BAD_INPUT, INFRASTRUCTURE = 0, 1, 2, 3
# Every `rlk` process's last line is MARKER followed by its exit code ("[rlk] exit-code 0"), so
# whoever reads its output knows the code, and that the process is exiting, before it has exited.
MARKER = "[rlk] exit-code"


class RlkError(Exception):
    exit_code = INFRASTRUCTURE


class BadInput(RlkError):
    """Bad input or usage: a value, file or layout that cannot be used as given."""

    exit_code = BAD_INPUT


class InfrastructureError(RlkError):
    """Something outside the input failed: a worker died, evidence is incomplete."""

    exit_code = INFRASTRUCTURE


class ParityFailure(RlkError):
    exit_code = PARITY_FAILURE


def exit_code_for(exc: BaseException) -> int:
    """Maps any exception to the contract's exit code. The project's own bad-input errors (a bad
    plan, id or route) are BadInput subclasses, so this module needs nothing from the packages
    that raise them; a ValueError or a missing or existing file from anywhere else is bad input too
    (settings raise a ValueError: envs.py sits above this module and cannot import it)."""
    if isinstance(exc, RlkError):
        return exc.exit_code
    if isinstance(exc, (FileNotFoundError, FileExistsError, ValueError)):
        return BAD_INPUT
    return INFRASTRUCTURE
