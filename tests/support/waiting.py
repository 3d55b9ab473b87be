"""Waiting on a condition, never for a duration: the one helper tests use."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], object], timeout_s: float = 20.0, what: str = "condition",
               poll_s: float = 0.05) -> object:
    """``pred()``'s first truthy value; AssertionError naming ``what`` after ``timeout_s`` (a cap
    against a hang, not a wait: the condition decides)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)
