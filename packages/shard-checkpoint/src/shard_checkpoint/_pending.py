"""The one save in flight in this process; see [Note: asynchronous saves] in ``_async.py``.

``save`` and ``async_save`` call :func:`wait` before they start, so a save
never overlaps another; an error of the save in flight is raised there once
(or by its handle's ``result()``, after which :func:`wait` does not raise
it again). Whoever waits first calls the save's ``hurry`` (the writer thread
runs at idle priority until someone waits for it).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["forget", "track", "wait"]

_lock = threading.Lock()
_in_flight: concurrent.futures.Future[Any] | None = None
_hurry: Callable[[], None] | None = None


def track(future: concurrent.futures.Future[Any], hurry: Callable[[], None]) -> None:
    """Record ``future`` as the save in flight; ``hurry`` speeds it up once it is waited for."""
    global _in_flight, _hurry
    with _lock:
        _in_flight, _hurry = future, hurry


def forget(future: concurrent.futures.Future[Any]) -> None:
    """``future``'s outcome was reported by its handle: :func:`wait` need not wait for it."""
    global _in_flight, _hurry
    with _lock:
        if _in_flight is future:
            _in_flight, _hurry = None, None


def wait() -> None:
    """Wait for the save in flight, if any, and raise its error."""
    global _in_flight, _hurry
    with _lock:
        future, hurry = _in_flight, _hurry
        _in_flight, _hurry = None, None
    if future is not None:
        if hurry is not None and not future.done():
            hurry()
        future.result()
