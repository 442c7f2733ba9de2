"""Exceptions raised inside code shard calls: wrapped, chained, and blamed on the right code.

A wrap policy's ``wrap()``/``descend()`` is called by the planner; its
exception becomes a ``PluginCallError`` naming the policy, the module being
planned and the code that raised: a plugin (by distribution and entry point,
from a faked entry point here), the user's module, another installed
package, or shard itself. Real plugins are covered in
``integration_tests/test_wrap_plugins.py``.
"""

from __future__ import annotations

import re
import textwrap
import types
from dataclasses import dataclass

import pytest
from torch import nn

from shard_core import LambdaWrapPolicy, plan_wraps
from shard_core._version import __version__
from shard_core.errors import PluginCallError, ShardError, WrapPlanError
from shard_core.plugin import _manager as manager_module
from shard_core.plugin import plugin_call_error


@dataclass(frozen=True)
class FakeDist:
    name: str
    version: str


@dataclass(frozen=True)
class FakeEntryPoint:
    name: str
    dist: FakeDist | None
    module: str


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


POLICY_SOURCE = """
class BrokenPolicy:
    def descend(self, module, name):
        return True

    def wrap(self, module, name, unwrapped_numel):
        return {}["oops in wrap"]

    def __repr__(self):
        return "BrokenPolicy()"
"""


def module_named(name: str, source: str = POLICY_SOURCE) -> types.ModuleType:
    """A module object called ``name`` (not imported) whose code runs under that name."""
    module = types.ModuleType(name)
    exec(compile(textwrap.dedent(source), f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture
def fake_plugin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Package ``shard_fakeplugin`` is entry point 'fake' of distribution shard-fake 1.0."""
    entry_point = FakeEntryPoint("fake", FakeDist("shard-fake", "1.0"), "shard_fakeplugin.plugin")
    monkeypatch.setattr(manager_module, "_entry_points", lambda: [entry_point])
    return module_named("shard_fakeplugin._policy")


def planning_error(policy: object) -> PluginCallError:
    with pytest.raises(PluginCallError) as info:
        plan_wraps(Net(), policy)  # type: ignore[arg-type]
    return info.value


def test_plugin_policy_raising_in_wrap_names_plugin_distribution_and_module(
    fake_plugin: types.ModuleType,
) -> None:
    """The issue's bare "KeyError: 'oops in wrap'" now names the plugin and the module planned."""
    error = planning_error(fake_plugin.BrokenPolicy())
    assert str(error) == (
        "wrap policy BrokenPolicy() raised KeyError: 'oops in wrap' in wrap() for module "
        "'layers.0' (Linear). It was raised in shard-fake 1.0 (plugin 'fake'), module "
        "'shard_fakeplugin._policy': report it to the authors of shard-fake with the traceback "
        "above, or block the plugin with SHARD_DISABLE_PLUGINS=fake"
    )
    assert isinstance(error, KeyError)
    assert type(error.__cause__) is KeyError
    assert error.__cause__.args == ("oops in wrap",)


def test_policy_raising_in_descend_names_the_root() -> None:
    """descend() is wrapped the same way; the root is shown as such; user code is named."""
    source = POLICY_SOURCE.replace("return True", "raise AttributeError('no blocks')")
    error = planning_error(module_named("userpkg.policies", source).BrokenPolicy())
    assert isinstance(error, AttributeError)
    assert str(error) == (
        "wrap policy BrokenPolicy() raised AttributeError: no blocks in descend() for module '' "
        "(the root) (Net). It was raised in your code, module 'userpkg.policies' "
        "(<userpkg.policies>:4): see the original exception above"
    )


def test_users_function_inside_a_builtin_policy_is_blamed_on_the_user() -> None:
    """LambdaWrapPolicy is shard's, but the lambda that raised is the user's: the user is named."""

    def is_block(module: nn.Module) -> bool:
        return bool(module.weight.shape[0] > 1)  # type: ignore[index]  # Net has no weight

    error = planning_error(LambdaWrapPolicy(is_block))
    assert isinstance(error, AttributeError)
    line = is_block.__code__.co_firstlineno + 1
    assert re.fullmatch(
        r"wrap policy LambdaWrapPolicy\(<function .*is_block at 0x[0-9a-f]+>\) raised "
        r"AttributeError: 'ModuleList' object has no attribute 'weight' in wrap\(\) for module "
        rf"'layers' \(ModuleList\). It was raised in your code, module {re.escape(repr(__name__))} "
        rf"\({re.escape(__file__)}:{line}\): see the original exception above",
        str(error),
    ), str(error)


def test_a_policy_of_another_installed_package_names_that_distribution() -> None:
    """A policy from an installed distribution that is no shard plugin is named by distribution."""
    error = planning_error(module_named("_pytest._shard_fake").BrokenPolicy())
    assert re.search(
        r"It was raised in pytest \S+, module '_pytest._shard_fake' \(<_pytest._shard_fake>:7\): "
        r"see the original exception above$",
        str(error),
    ), str(error)


def test_shards_own_code_raising_is_reported_as_a_bug_in_shard() -> None:
    """When every frame is shard's or a library's, shard itself is blamed."""
    error = planning_error(module_named("shard_core._fake_policy").BrokenPolicy())
    assert str(error).endswith(
        f"It was raised inside shard-core {__version__} itself, module 'shard_core._fake_policy' "
        "(<shard_core._fake_policy>:7): this is a bug in shard, please report it with the "
        "traceback above"
    )


def test_a_shard_error_from_a_policy_passes_unchanged() -> None:
    """A WrapPlanError a policy raises on purpose already names the culprit: it is not wrapped."""

    def refuse(module: nn.Module) -> bool:
        raise WrapPlanError("MyPolicy: layers must be named")

    with pytest.raises(WrapPlanError) as info:
        plan_wraps(Net(), LambdaWrapPolicy(refuse))
    assert type(info.value) is WrapPlanError
    assert str(info.value) == "MyPolicy: layers must be named"


def test_a_policy_whose_repr_raises_is_still_named() -> None:
    """The message falls back to the policy's class when its __repr__ raises too."""
    source = POLICY_SOURCE.replace('return "BrokenPolicy()"', "raise ValueError('no repr')")
    error = planning_error(module_named("userpkg.bad_repr", source).BrokenPolicy())
    assert str(error).startswith("wrap policy <BrokenPolicy object> raised KeyError")


def test_plugin_call_error_for_code_without_a_traceback() -> None:
    """An exception that was never raised has no frames: the message says what was called only."""
    error = plugin_call_error(KeyError("k"), "comm hook 'x'", " in reduce")
    assert str(error) == "comm hook 'x' raised KeyError: 'k' in reduce"
    assert isinstance(error, KeyError)
    assert isinstance(error, ShardError)
