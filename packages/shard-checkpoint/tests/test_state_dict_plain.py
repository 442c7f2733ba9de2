"""The functional API on plain (unsharded) models in one process: names, forms, errors.

Sharded models go through the same code with DTensor values; those tests
run on ranks in ``test_roundtrip.py`` and its neighbours (``rank_pool``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shard_checkpoint import (
    IncompatibleKeys,
    StateDictError,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from shard_testing.models import ToyNet, toy_batches

FULL = StateDictOptions(full_state_dict=True)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _zeroed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model


def _step(model: ToyNet, optim: torch.optim.Optimizer, step: int) -> float:
    x, y = toy_batches(1, steps=3)[step][0][0]
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


@pytest.mark.parametrize(
    "options",
    [StateDictOptions(), FULL, StateDictOptions(full_state_dict=True, cpu_offload=True)],
    ids=["sharded", "full", "full-cpu-offload"],
)
def test_plain_model_state_dict_is_its_own(options: StateDictOptions) -> None:
    """A plain model's state dict comes back as model.state_dict(), whatever the options."""
    model = ToyNet()
    state = get_model_state_dict(model, options=options)
    expected = model.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_set_model_state_dict_loads_every_form() -> None:
    """Full values load, also broadcast from rank 0 in a world of one."""
    source = ToyNet(seed=3).state_dict()
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for options in (StateDictOptions(), FULL, broadcast):
        model = _zeroed(ToyNet())
        assert set_model_state_dict(model, source, options=options) == IncompatibleKeys([], [])
        for key, value in source.items():
            assert torch.equal(model.state_dict()[key], value), key


def test_set_model_state_dict_strict_names_the_first_missing_and_unexpected_key() -> None:
    """strict: missing and unexpected keys are errors naming the first; nothing is loaded."""
    model = _zeroed(ToyNet())
    source = ToyNet(seed=3).state_dict()
    partial = {k: v for k, v in source.items() if not k.startswith("blocks.1.")}
    with pytest.raises(
        StateDictError,
        match=r"^set_model_state_dict: the state dict has no value for 'blocks\.1\.inner\.weight' "
        r"\(4 of the model's 16 keys are missing\); load a state dict of this model, or pass "
        r"options=StateDictOptions\(strict=False\) to load the keys it has$",
    ):
        set_model_state_dict(model, partial)
    assert torch.equal(model.embed.weight, torch.zeros_like(model.embed.weight))
    with pytest.raises(
        StateDictError,
        match=r"^set_model_state_dict: the state dict has a value for 'extra', which the model "
        r"does not have \(1 such keys\)",
    ):
        set_model_state_dict(model, {**source, "extra": torch.ones(1)})


def test_set_model_state_dict_not_strict_reports_what_it_skipped() -> None:
    """strict=False loads what matches and returns the missing and unexpected keys."""
    model = _zeroed(ToyNet())
    source = ToyNet(seed=3).state_dict()
    partial = {k: v for k, v in source.items() if k != "head.bias"} | {"extra": torch.ones(1)}
    result = set_model_state_dict(model, partial, options=StateDictOptions(strict=False))
    assert result == IncompatibleKeys(missing_keys=["head.bias"], unexpected_keys=["extra"])
    assert torch.equal(model.head.weight, source["head.weight"])
    assert torch.equal(model.head.bias, torch.zeros(3))


def test_set_model_state_dict_names_a_value_of_another_shape() -> None:
    """A value whose shape differs from the model's is named with both shapes."""
    source = dict(ToyNet().state_dict())
    source["head.weight"] = torch.zeros(4, 10)
    with pytest.raises(
        StateDictError,
        match=r"^set_model_state_dict: 'head\.weight' has shape \(4, 10\) in the state dict but "
        r"\(3, 10\) in the model; load a state dict of this model$",
    ):
        set_model_state_dict(ToyNet(), source)


def test_optimizer_state_dict_is_keyed_by_parameter_name() -> None:
    """State and param groups name parameters by their qualified names, nested or flat."""
    model = ToyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    nested = get_optimizer_state_dict(model, optim)
    names = [n for n, _ in model.named_parameters()]
    assert list(nested["state"]) == names
    assert set(nested["state"]["embed.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert nested["param_groups"][0]["params"] == names
    assert nested["param_groups"][0]["lr"] == 0.1
    flat = get_optimizer_state_dict(model, optim, options=FLAT)
    assert flat["state.embed.weight.step"] is nested["state"]["embed.weight"]["step"]
    assert flat["param_groups.head.bias.lr"] == 0.1
    assert len(flat) == 3 * len(names) + len(names) * (len(nested["param_groups"][0]) - 1)


def test_fresh_optimizer_gets_state_without_moving_parameters() -> None:
    """A never-stepped optimizer gets zero state (step 1) and the parameters do not change."""
    model = ToyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    state = get_optimizer_state_dict(model, optim)["state"]
    assert torch.equal(state["head.weight"]["exp_avg"], torch.zeros(3, 10))
    assert state["head.weight"]["step"].item() == 1
    assert optim.param_groups[0]["lr"] == 0.1
    assert all(p.grad is None for p in model.parameters())
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize(
    "options", [StateDictOptions(), FLAT, FULL], ids=["nested", "flat", "full"]
)
def test_resuming_from_an_optimizer_state_dict_is_exact(options: StateDictOptions) -> None:
    """Two steps, state dicts, a fresh model and optimizer, one step: equals three steps."""
    reference = ToyNet()
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    ref_losses = [_step(reference, ref_optim, s) for s in range(3)]

    model = ToyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    for s in range(2):
        _step(model, optim, s)
    model_state = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim_state = get_optimizer_state_dict(model, optim, options=options)

    resumed = _zeroed(ToyNet(seed=5))
    resumed_optim = torch.optim.AdamW(resumed.parameters(), lr=0.9)
    set_model_state_dict(resumed, model_state, options=options)
    set_optimizer_state_dict(resumed, resumed_optim, optim_state, options=options)
    assert resumed_optim.param_groups[0]["lr"] == 0.05
    assert _step(resumed, resumed_optim, 2) == ref_losses[2]
    for key, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_optimizer_over_foreign_parameters_is_refused() -> None:
    """An optimizer built before sharding (or over another model) is named with the fix."""
    model = ToyNet()
    optim = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(2, 2))], lr=0.1)
    with pytest.raises(
        StateDictError,
        match=r"^parameter 16 \(shape \(2, 2\)\) of param group 0 of optimizer 0 is not a "
        r"parameter of the model; build the optimizer from model\.parameters\(\) after "
        r"fully_shard \(an optimizer built before holds the unsharded parameters\)$",
    ):
        get_optimizer_state_dict(model, optim)


def test_set_optimizer_state_dict_strict_names_unknown_parameters() -> None:
    """State for a parameter no optimizer holds is an error under strict, ignored otherwise."""
    model = ToyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    state: dict[str, Any] = get_optimizer_state_dict(model, optim)
    state["state"]["ghost.weight"] = {"step": torch.tensor(1.0)}
    with pytest.raises(
        StateDictError,
        match=r"^set_optimizer_state_dict: the optimizer state dict has state for "
        r"'ghost\.weight', which no optimizer holds \(1 such parameters\)",
    ):
        set_optimizer_state_dict(model, optim, state)
    set_optimizer_state_dict(model, optim, state, options=StateDictOptions(strict=False))
    with pytest.raises(
        StateDictError, match=r"^optimizer state dict key 'bogus' is neither nested"
    ):
        set_optimizer_state_dict(model, optim, {"bogus": 1})


def test_ignore_frozen_params_composes_with_submodules() -> None:
    """Frozen keys go first, then the submodule filter (PyTorch raises KeyError for these)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    frozen = StateDictOptions(ignore_frozen_params=True)
    stripped = StateDictOptions(ignore_frozen_params=True, keep_submodule_prefixes=False)
    with pytest.warns(FutureWarning, match=r"the submodules argument is deprecated"):
        outside = get_model_state_dict(model, submodules={model[1]}, options=frozen)
    with pytest.warns(FutureWarning, match=r"the submodules argument is deprecated"):
        inside = get_model_state_dict(model, submodules={model[0]}, options=stripped)
    assert list(outside) == ["1.weight", "1.bias"]
    assert list(inside) == ["bias"]
