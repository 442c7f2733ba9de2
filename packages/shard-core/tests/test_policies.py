"""The built-in wrap policies: ModuleWrapPolicy, LambdaWrapPolicy and CustomPolicy."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from shard_core import (
    CustomPolicy,
    LambdaWrapPolicy,
    ModuleWrapPolicy,
    WrapPlanError,
    as_module_classes,
)
from shard_core.protocols import WrapPolicy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


class FancyBlock(Block):
    pass


def test_builtin_policies_satisfy_wrap_policy_protocol() -> None:
    """Each built-in policy is a WrapPolicy the walker and the runtime accept."""
    policies = [ModuleWrapPolicy([Block]), LambdaWrapPolicy(bool), CustomPolicy(bool)]
    assert all(isinstance(policy, WrapPolicy) for policy in policies)


def test_module_wrap_policy_wraps_instances_and_subclasses() -> None:
    """A module is a unit when it is an instance of a listed class, subclasses included."""
    policy = ModuleWrapPolicy({Block})
    decisions = [policy.wrap(module, "m", 0) for module in (Block(), FancyBlock(), nn.Linear(2, 2))]
    assert decisions == [True, True, False]
    assert policy.descend(Block(), "m") is True


def test_module_wrap_policy_accepts_one_class_and_drops_duplicates() -> None:
    """A single class or an iterable with repeats gives the classes once, in the order given."""
    assert ModuleWrapPolicy(Block).module_classes == (Block,)
    assert ModuleWrapPolicy([Block, nn.Linear, Block]).module_classes == (Block, nn.Linear)
    assert repr(ModuleWrapPolicy([Block, nn.Linear])) == "ModuleWrapPolicy({Block, Linear})"


@pytest.mark.parametrize(
    ("entry", "shown"),
    [("Block", "'Block' (str)"), (int, "<class 'int'> (type)"), (Block(), "Block(")],
)
def test_module_wrap_policy_rejects_non_module_classes(entry: Any, shown: str) -> None:
    """Anything but an nn.Module subclass is refused with the value seen and how to pass it."""
    with pytest.raises(WrapPlanError, match=r"^ModuleWrapPolicy: module_classes must hold") as info:
        ModuleWrapPolicy([entry])
    assert shown in str(info.value)
    assert str(info.value).endswith("pass the class itself, e.g. module_classes={TransformerBlock}")


def test_lambda_wrap_policy_passes_the_function_answer() -> None:
    """fn's bool or mapping answer is the decision; the policy always descends."""
    answers: dict[str, Any] = {"yes": True, "no": False, "custom": {"reshard_after_forward": False}}
    policy = LambdaWrapPolicy(lambda module: answers[module.tag])
    module = nn.Linear(1, 1)
    seen = {}
    for tag in answers:
        module.tag = tag
        seen[tag] = policy.wrap(module, "m", 0)
    assert seen == answers
    assert policy.descend(module, "m") is True


def test_lambda_wrap_policy_treats_an_empty_mapping_as_no_unit() -> None:
    """An empty mapping means "not a unit", as PyTorch's CustomPolicy treats an empty dict."""
    assert LambdaWrapPolicy(lambda module: {}).wrap(nn.Linear(1, 1), "m", 0) is False


def test_lambda_wrap_policy_rejects_a_non_callable() -> None:
    """A policy built from something that is not callable says what it got."""
    with pytest.raises(
        WrapPlanError,
        match=r"^LambdaWrapPolicy: expected a callable taking a module, got 3 \(int\)$",
    ):
        LambdaWrapPolicy(3)  # type: ignore[arg-type]


def test_custom_policy_keeps_pytorch_signature() -> None:
    """CustomPolicy(lambda_fn=...) builds the lambda policy under PyTorch's name and argument."""
    policy = CustomPolicy(lambda_fn=lambda module: {"mixed_precision": None})
    assert isinstance(policy, LambdaWrapPolicy)
    assert policy.wrap(nn.Linear(1, 1), "m", 0) == {"mixed_precision": None}
    assert repr(CustomPolicy(bool)) == "CustomPolicy(<class 'bool'>)"
    with pytest.raises(WrapPlanError, match=r"^CustomPolicy: expected a callable"):
        CustomPolicy(None)  # type: ignore[arg-type]


def test_as_module_classes_is_the_one_check_every_policy_uses() -> None:
    """One class or an iterable, duplicates dropped in order; anything else names owner and fix."""
    got = as_module_classes([nn.Linear, nn.ReLU, nn.Linear], owner="P", argument="a", example="X")
    assert got == (nn.Linear, nn.ReLU)
    assert as_module_classes(nn.Linear, owner="P", argument="a", example="X") == (nn.Linear,)
    with pytest.raises(
        WrapPlanError,
        match=r"^P: a must be a set of nn.Module subclasses or None, got 'x' \(str\); pass e\.g\. "
        r"a=\{X\}, or None to pick$",
    ):
        as_module_classes("x", owner="P", argument="a", example="X", none_means="pick")
    with pytest.raises(WrapPlanError, match=r"^P: a must hold nn.Module subclasses, got 3 \(int\)"):
        as_module_classes([3], owner="P", argument="a", example="X")
