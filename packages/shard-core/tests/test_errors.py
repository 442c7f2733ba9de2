"""The exception types of shard_core.errors: one class each, the right bases, old paths kept."""

from __future__ import annotations

import pytest

import shard_core
from shard_core import _wrap_plan, errors
from shard_core.plugin import PluginWarning as PluginWarningFromPlugin
from shard_core.plugin import _manager

# Each error with the built-in exception a Python user would catch it as.
BUILTIN_BASE = {
    "CollectiveError": RuntimeError,
    "CommError": ValueError,
    "DeviceMismatchError": ValueError,
    "DeviceUnavailableError": RuntimeError,
    "DistributedInitError": RuntimeError,
    "LayoutError": ValueError,
    "MeshError": ValueError,
    "ModelMismatchError": RuntimeError,
    "OptimizerStepError": RuntimeError,
    "PluginCollisionError": RuntimeError,
    "PluginError": RuntimeError,
    "ShardError": Exception,
    "UnknownPluginNameError": LookupError,
    "WrapPlanError": ValueError,
}


def test_errors_module_lists_every_error_and_the_plugin_warning() -> None:
    """errors.__all__ is sorted and holds exactly the errors above and PluginWarning."""
    assert errors.__all__ == sorted(errors.__all__)
    assert set(errors.__all__) == {*BUILTIN_BASE, "PluginWarning"}


@pytest.mark.parametrize(("name", "base"), sorted(BUILTIN_BASE.items()))
def test_each_error_is_a_shard_error_and_its_builtin(name: str, base: type[Exception]) -> None:
    """Every error can be caught as ShardError and as the built-in exception it refines."""
    cls = getattr(errors, name)
    assert issubclass(cls, errors.ShardError)
    assert issubclass(cls, base)
    assert cls.__module__ == "shard_core.errors"


def test_plugin_warning_is_a_user_warning_and_not_an_error() -> None:
    """PluginWarning is a UserWarning (filterable), never a ShardError that would be raised."""
    assert issubclass(errors.PluginWarning, UserWarning)
    assert not issubclass(errors.PluginWarning, errors.ShardError)


def test_old_import_paths_give_the_same_classes() -> None:
    """The names that moved into shard_core.errors are the same objects at their old paths."""
    assert shard_core.WrapPlanError is errors.WrapPlanError
    assert _wrap_plan.WrapPlanError is errors.WrapPlanError
    assert shard_core.PluginWarning is errors.PluginWarning
    assert PluginWarningFromPlugin is errors.PluginWarning
    assert _manager.PluginWarning is errors.PluginWarning


def test_unknown_plugin_name_error_prints_its_message_unquoted() -> None:
    """str() of the LookupError subclass is the message itself, not a quoted key."""
    assert str(errors.UnknownPluginNameError("no comm hook 'x'")) == "no comm hook 'x'"
    assert str(errors.UnknownPluginNameError()) == ""
