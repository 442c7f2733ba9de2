"""The one save in flight in this process; see [Note: asynchronous saves] in ``_async.py``.

``save`` and ``async_save`` call :func:`wait` before they start, so a save
never overlaps another; an error of the save in flight is raised there once
(or by its handle's ``result()``, after which :func:`wait` does not raise
it again).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

__all__ = ["forget", "track", "wait"]

_lock = threading.Lock()
_in_flight: concurrent.futures.Future[Any] | None = None


def track(future: concurrent.futures.Future[Any]) -> None:
    """Record ``future`` as the save in flight."""
    global _in_flight
    with _lock:
        _in_flight = future


def forget(future: concurrent.futures.Future[Any]) -> None:
    """``future``'s outcome was reported by its handle: :func:`wait` need not wait for it."""
    global _in_flight
    with _lock:
        if _in_flight is future:
            _in_flight = None


def wait() -> None:
    """Wait for the save in flight, if any, and raise its error."""
    global _in_flight
    with _lock:
        future, _in_flight = _in_flight, None
    if future is not None:
        future.result()
