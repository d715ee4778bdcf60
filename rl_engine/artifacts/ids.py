"""Run and attempt ids: `[A-Za-z0-9._-]+`; attempt ids sort by time."""

from __future__ import annotations

import re
import secrets
from datetime import datetime, timezone

from rl_engine.errors import BadInput

_ID = re.compile(r"[A-Za-z0-9._-]+")


class BadId(BadInput, ValueError):
    """An id that could escape its folder or is not `[A-Za-z0-9._-]+`."""


def check_id(value: str, what: str = "run id") -> str:
    if not _ID.fullmatch(value or "") or value in {".", ".."} or ".." in value:
        raise BadId(f"{what} {value!r} must match [A-Za-z0-9._-]+ without '..'; "
                    "pick a plain name such as nightly-2026-11-30")
    return value


def new_attempt_id(now: datetime | None = None) -> str:
    """`<UTC yyyymmddTHHMMSSZ>-<6 hex>`: the microseconds in five hex digits, then one random one.

    The microseconds keep two attempts started within one second in the order they were made (a
    resumed cell's new attempt often starts in the second its killed one did); the random digit
    keeps ids of separate processes apart."""
    now = now or datetime.now(timezone.utc)
    return f"{now.strftime('%Y%m%dT%H%M%SZ')}-{now.microsecond:05x}{secrets.randbelow(16):x}"


def sanitize(value: str) -> str:
    """Maps any string (an Airflow run id, say) to a valid id."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", value).strip("._") or "run"
    return cleaned.replace("..", "_")
