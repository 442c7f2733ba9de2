"""``shard train --tensorboard``: rank 0's metrics as TensorBoard events in the run directory.

TensorBoard is optional (the ``tensorboard`` extra of shard-cli). The
install hint names the ``tensorboard`` package itself, never
``shard-cli[tensorboard]`` from the package index: the ``shard-cli`` there is
an unrelated project.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TENSORBOARD_INSTALL", "MetricsWriter", "check_tensorboard"]

TENSORBOARD_INSTALL = (
    "pip install tensorboard (or, from a shard checkout, "
    "pip install './packages/shard-cli[tensorboard]')"
)
"""How to install what ``--tensorboard`` needs."""


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch's module imports the tensorboard package
        raise ImportError(
            f"--tensorboard needs the tensorboard package, which is not installed: "
            f"{TENSORBOARD_INSTALL}"
        ) from exc
    return SummaryWriter


def check_tensorboard() -> None:
    """Fail before any rank starts when ``--tensorboard`` cannot work.

    Raises:
        ImportError: the tensorboard package is missing (the message says
            how to install it).
    """
    _summary_writer_class()


class MetricsWriter:
    """Scalars of each step, written to ``<run_dir>/tensorboard`` (rank 0 only)."""

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / "tensorboard"
        self._writer = _summary_writer_class()(log_dir=str(self.log_dir))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Record every scalar of ``step`` (tags ``train/<name>``)."""
        for name, value in scalars.items():
            self._writer.add_scalar(f"train/{name}", value, step)

    def close(self) -> None:
        """Flush the events to disk."""
        self._writer.close()
