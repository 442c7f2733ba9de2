"""The failures a multi-rank run reports.

Both derive from ``AssertionError`` so that pytest reports a broken rank as
a failed test, not as an error in the test machinery.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["RankFailure", "RankTimeout"]


class RankFailure(AssertionError):
    """One or more ranks raised, or died, while running a function.

    Attributes:
        world_size: Number of ranks of the run.
        failures: Rank -> the rank's traceback, or how its process ended.
        unfinished: Ranks still running when the pool was killed, after the
            grace period that follows the first failure.
    """

    def __init__(
        self,
        message: str,
        *,
        world_size: int = 0,
        failures: Mapping[int, str] | None = None,
        unfinished: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.failures = dict(failures or {})
        self.unfinished = tuple(unfinished)


class RankTimeout(AssertionError):
    """Ranks did not finish within the run's timeout; the pool was killed.

    Attributes:
        world_size: Number of ranks of the run.
        unfinished: Ranks that had not finished.
        timeout: The timeout in seconds.
    """

    def __init__(
        self,
        message: str,
        *,
        world_size: int = 0,
        unfinished: Sequence[int] = (),
        timeout: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.unfinished = tuple(unfinished)
        self.timeout = timeout
