"""StateDictOptions: PyTorch's fields, order, defaults and mutability; checked when used."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions as TorchStateDictOptions

from shard_checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)


def test_fields_order_and_defaults_are_pytorchs() -> None:
    """The fields, in PyTorch's order, with PyTorch's defaults."""
    ours = [(f.name, f.default) for f in dataclasses.fields(StateDictOptions)]
    theirs = [(f.name, f.default) for f in dataclasses.fields(TorchStateDictOptions)]
    assert ours == [
        ("full_state_dict", False),
        ("cpu_offload", False),
        ("ignore_frozen_params", False),
        ("keep_submodule_prefixes", True),
        ("strict", True),
        ("broadcast_from_rank0", False),
        ("flatten_optimizer_state_dict", False),
        ("dsd_fqn_modifiers", "_fqn_modifiers"),
    ]
    assert ours == theirs


def test_options_are_mutable_like_pytorchs() -> None:
    """A field can be assigned after construction, as with PyTorch's dataclass."""
    options = StateDictOptions()
    options.strict = False
    options.full_state_dict = True
    assert options == StateDictOptions(full_state_dict=True, strict=False)
    assert dataclasses.replace(options, strict=True) == StateDictOptions(full_state_dict=True)


def test_broadcast_from_rank0_without_full_state_dict_is_refused_when_used() -> None:
    """Building the contradiction is allowed (as in PyTorch); every function refuses it."""
    options = StateDictOptions(broadcast_from_rank0=True)
    model = nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {
        "get_model_state_dict": lambda: get_model_state_dict(model, options=options),
        "get_optimizer_state_dict": lambda: get_optimizer_state_dict(model, optim, options=options),
        "get_state_dict": lambda: get_state_dict(model, optim, options=options),
        "set_model_state_dict": lambda: set_model_state_dict(model, {}, options=options),
        "set_optimizer_state_dict": lambda: set_optimizer_state_dict(
            model, optim, {}, options=options
        ),
        "set_state_dict": lambda: set_state_dict(
            model, optim, model_state_dict={}, optim_state_dict={}, options=options
        ),
    }
    for name, call in calls.items():
        with pytest.raises(
            ValueError,
            match=rf"^{name}: StateDictOptions\(broadcast_from_rank0=True\) loads a full state "
            r"dict held by rank 0, but full_state_dict is False; set full_state_dict=True as "
            r"well$",
        ):
            call()


def test_deprecated_submodules_warn_at_the_callers_line() -> None:
    """submodules warns FutureWarning (as PyTorch does) attributed to the caller's file."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    deprecated = r"^get_model_state_dict: the submodules argument is deprecated"
    with pytest.warns(FutureWarning, match=deprecated) as rec:
        state = get_model_state_dict(model, submodules={model[1]})
    assert list(state) == ["1.weight", "1.bias"]
    assert [w.filename for w in rec] == [__file__]
