"""The name_pattern wrap policy, registered in memory the way its entry point registers it."""

from __future__ import annotations

import pytest
from torch import nn

import shard_wrap_example
from shard_core import Registry, WrapPlanError, make_plugin_manager, plan_wraps
from shard_core.protocols import WrapPolicy
from shard_wrap_example import NamePatternPolicy
from shard_wrap_example import plugin as example_plugin


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(2, 2)  # 6 elements


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(2, 1)  # 3 elements


def registry() -> Registry:
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(example_plugin, name="wrap-example")
    return Registry(pm)


def test_plugin_registers_name_pattern() -> None:
    """The plugin module's hook adds "name_pattern" next to the built-in policies."""
    reg = registry()
    assert reg.wrap_policies()["name_pattern"] is NamePatternPolicy
    assert reg.plugin_names() == ["builtins", "wrap-example"]


def test_name_pattern_policy_plans_matching_modules() -> None:
    """Modules whose whole qualified name matches the pattern become units, then the root."""
    policy = registry().wrap_policy("name_pattern", pattern=r"layers\.[02]")
    plan = plan_wraps(Net(), policy)
    assert [(t.name, t.numel) for t in plan] == [("layers.0", 6), ("layers.2", 6), ("", 9)]


def test_name_pattern_matches_the_whole_name() -> None:
    """re.fullmatch: a pattern for the blocks does not also match their submodules."""
    policy = NamePatternPolicy(r"layers\.\d+")
    assert isinstance(policy, WrapPolicy)
    module = nn.Linear(1, 1)
    assert [policy.wrap(module, n, 0) for n in ("layers.1", "layers.1.mlp", "xlayers.1")] == [
        True,
        False,
        False,
    ]
    assert policy.descend(module, "layers.1") is True
    assert repr(policy) == r"NamePatternPolicy('layers\\.\\d+')"
    assert policy.pattern == r"layers\.\d+"


def test_invalid_pattern_is_rejected_with_the_pattern() -> None:
    """A pattern that is not a regular expression is a WrapPlanError naming it."""
    with pytest.raises(
        WrapPlanError,
        match=r"^name_pattern: pattern 'layers\.\(' is not a valid regular expression: "
        r"missing \), unterminated subpattern at position 7$",
    ):
        NamePatternPolicy(r"layers.(")


def test_non_string_pattern_is_rejected() -> None:
    """A pattern that is not a str is a WrapPlanError with the value seen."""
    with pytest.raises(
        WrapPlanError,
        match=r"^name_pattern: pattern must be a str \(a regular expression\), got 3 \(int\)$",
    ):
        NamePatternPolicy(3)  # type: ignore[arg-type]


def test_package_exports() -> None:
    """The package's public names are the policy and the version."""
    assert shard_wrap_example.__all__ == ["NamePatternPolicy", "__version__"]
