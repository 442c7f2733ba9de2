"""The exception types of shard_core.errors: one class each, the right bases, old paths kept."""

from __future__ import annotations

import json
import pickle

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
    "PluginCallError": RuntimeError,
    "PluginCollisionError": RuntimeError,
    "PluginError": RuntimeError,
    "ShardError": Exception,
    "UnknownPluginNameError": LookupError,
    "WrapPlanError": ValueError,
}


WARNINGS = ("FrameworkIntegrationWarning", "PluginWarning")


def test_errors_module_lists_every_error_and_the_warnings() -> None:
    """errors.__all__ is sorted and holds exactly the errors above and the two warnings."""
    assert errors.__all__ == sorted(errors.__all__)
    assert set(errors.__all__) == {*BUILTIN_BASE, *WARNINGS}


@pytest.mark.parametrize(("name", "base"), sorted(BUILTIN_BASE.items()))
def test_each_error_is_a_shard_error_and_its_builtin(name: str, base: type[Exception]) -> None:
    """Every error can be caught as ShardError and as the built-in exception it refines."""
    cls = getattr(errors, name)
    assert issubclass(cls, errors.ShardError)
    assert issubclass(cls, base)
    assert cls.__module__ == "shard_core.errors"


@pytest.mark.parametrize("name", WARNINGS)
def test_warnings_are_user_warnings_and_not_errors(name: str) -> None:
    """shard's warnings are UserWarnings (filterable), never ShardErrors that would be raised."""
    assert issubclass(getattr(errors, name), UserWarning)
    assert not issubclass(getattr(errors, name), errors.ShardError)


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


def _raised(exc: Exception) -> errors.PluginCallError:
    try:
        raise exc
    except Exception as caught:
        return errors.PluginCallError.wrapping(caught, "policy raised")


@pytest.mark.parametrize(
    ("original", "category"),
    [
        (KeyError("k"), KeyError),
        (IndexError(3), IndexError),
        (AttributeError("a"), AttributeError),
        (TypeError("t"), TypeError),
        (json.JSONDecodeError("bad", "{", 0), ValueError),
        (FileNotFoundError(2, "missing"), OSError),
        (ModuleNotFoundError("m"), ImportError),
        (NotImplementedError("n"), NotImplementedError),
        (ZeroDivisionError("z"), ZeroDivisionError),
        (RecursionError("r"), RecursionError),
        (MemoryError(), MemoryError),
    ],
)
def test_plugin_call_error_is_also_the_originals_category(
    original: Exception, category: type[Exception]
) -> None:
    """A plugin's KeyError re-raised as PluginCallError is still caught by except KeyError."""
    error = _raised(original)
    assert isinstance(error, errors.PluginCallError)
    assert isinstance(error, errors.PluginError)
    assert isinstance(error, category)
    assert type(error).__qualname__ == f"PluginCallError[{category.__name__}]"
    assert type(error).__module__ == "shard_core.errors"
    assert str(error) == "policy raised"
    assert type(_raised(original)) is type(error)  # one class per category


@pytest.mark.parametrize(
    "original", [StopIteration(), Exception("e"), type("Own", (Exception,), {})()]
)
def test_plugin_call_error_without_a_category_is_a_plain_runtime_error(
    original: Exception,
) -> None:
    """An exception of no category (its own class, StopIteration) gives PluginCallError itself."""
    error = _raised(original)
    assert type(error) is errors.PluginCallError
    assert not isinstance(error, StopIteration)


def test_plugin_call_error_pickles_with_its_category() -> None:
    """A PluginCallError crosses processes (the rank pool pickles results): class and text kept."""
    for original in (KeyError("k"), ValueError("v"), Exception("e")):
        error = _raised(original)
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == "policy raised"
