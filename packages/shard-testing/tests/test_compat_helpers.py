"""Tests of shard_testing.compat, the helpers shared by side-by-side (PyTorch vs shard) tests."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shard_testing import compat


def _raise() -> None:
    raise ValueError("bad value")


def test_all_is_sorted() -> None:
    """The module's __all__ is sorted and every name exists."""
    assert compat.__all__ == sorted(compat.__all__)
    assert all(hasattr(compat, name) for name in compat.__all__)


def test_outcomes_are_plain_strings() -> None:
    """error gives "<Type>: <message>", error_type the type alone; both "no error" otherwise."""
    assert compat.error(_raise) == "ValueError: bad value"
    assert compat.error_type(_raise) == "ValueError"
    assert compat.error(lambda: None) == compat.error_type(lambda: None) == "no error"


def test_fsdp_namespace_names_each_library() -> None:
    """ "torch" is torch.distributed.fsdp, "shard" is shard_runtime; anything else is refused."""
    assert compat.fsdp_namespace("torch").__name__ == "torch.distributed.fsdp"
    assert compat.fsdp_namespace("shard").__name__ == "shard_runtime"
    with pytest.raises(ValueError, match="impl must be 'torch' or 'shard'"):
        compat.fsdp_namespace("jax")  # type: ignore[arg-type]


def test_importing_compat_loads_no_fsdp() -> None:
    """Importing the module imports neither PyTorch's FSDP nor shard_runtime."""
    code = (
        "import sys, shard_testing.compat; "
        "print(any(m in sys.modules for m in ('torch.distributed.fsdp', 'shard_runtime')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tp_model_runs_unsharded() -> None:
    """TPModel maps (batch, 8) to (batch, 3) through two residual blocks and a head."""
    model = compat.TPModel()
    assert model(torch.zeros(4, 8)).shape == (4, 3)
    assert [tuple(b.up.weight.shape) for b in model.blocks] == [(12, 8), (10, 8)]
