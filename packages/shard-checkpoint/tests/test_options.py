"""StateDictOptions: PyTorch's names and defaults, frozen, and checked."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.checkpoint.state_dict import StateDictOptions as TorchStateDictOptions

from shard_checkpoint import StateDictOptions


def test_fields_and_defaults_are_pytorchs() -> None:
    """Every field exists in PyTorch's StateDictOptions with the same default."""
    ours = {f.name: f.default for f in dataclasses.fields(StateDictOptions)}
    theirs = {f.name: f.default for f in dataclasses.fields(TorchStateDictOptions)}
    assert ours == {
        "full_state_dict": False,
        "cpu_offload": False,
        "broadcast_from_rank0": False,
        "strict": True,
        "flatten_optimizer_state_dict": False,
    }
    assert {name: theirs[name] for name in ours} == ours


def test_options_are_frozen() -> None:
    """Options cannot be changed after construction (they are shared freely)."""
    options = StateDictOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strict = False  # type: ignore[misc]


def test_broadcast_from_rank0_needs_full_state_dict() -> None:
    """broadcast_from_rank0 without full_state_dict is refused with the fix."""
    with pytest.raises(
        ValueError,
        match=r"^StateDictOptions: broadcast_from_rank0=True loads a full state dict held by "
        r"rank 0; set full_state_dict=True as well$",
    ):
        StateDictOptions(broadcast_from_rank0=True)
