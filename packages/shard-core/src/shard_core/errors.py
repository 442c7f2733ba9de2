"""The exceptions and warnings shard raises.

Every error shard raises on bad input derives from :class:`ShardError` and
from the built-in exception a Python user would expect (``ValueError`` for a
bad argument, ``LookupError`` for an unknown name...), so existing ``except``
clauses keep working. Messages name the culprit (module, parameter, plugin)
and say what to do instead.

They live here, in the bottom layer, whichever layer raises them: a plugin
depends on ``shard-core`` only and must be able to catch (and raise) the same
classes as the communication layer and the runtime. The one exception is
shard-checkpoint's ``CheckpointError``/``StateDictError``
(``shard_checkpoint/_errors.py``): only that distribution raises them and no
plugin catches them; they too derive from :class:`ShardError`. The packages
that raise them re-export them where users look (``shard_comms.MeshError``,
``shard_device_cuda.DeviceUnavailableError``...); those are the same classes.
"""

from __future__ import annotations

from typing import cast

__all__ = [
    "CollectiveError",
    "CommError",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "DistributedInitError",
    "FrameworkIntegrationWarning",
    "LayoutError",
    "MeshError",
    "ModelMismatchError",
    "OptimizerStepError",
    "PluginCallError",
    "PluginCollisionError",
    "PluginError",
    "PluginWarning",
    "ShardError",
    "UnknownPluginNameError",
    "WrapPlanError",
]


class ShardError(Exception):
    """Base class of every exception shard raises on purpose."""


# - tensors and units


class LayoutError(ShardError, ValueError):
    """Parameters cannot be laid out as asked (dtype, device, shape, contiguity)."""


class WrapPlanError(ShardError, ValueError):
    """A wrap policy or a wrap plan cannot be built as asked.

    Raised for a policy built from bad options, a policy answer that is not a
    decision, and a unit that cannot exist (a container with no forward).
    """


class ModelMismatchError(ShardError, RuntimeError):
    """The ranks of one mesh hold different models, or shard them into different units.

    Found at the root's first forward, before any collective of the model:
    the message names the first parameter or unit that differs, what each
    side of the ranks has there, and the wrap plans when they differ.
    """


class OptimizerStepError(ShardError, RuntimeError):
    """An optimizer stepped on sharded parameters whose gradients are not reduced yet.

    Raised from an optimizer step pre-hook when ``optimizer.step()`` runs
    during backward (in a backward hook) before the unit that holds its
    parameters has reduced its gradients; the message names the unit.
    """


# - plugins


class PluginError(ShardError, RuntimeError):
    """A plugin broke the registry's rules."""


class PluginCollisionError(PluginError):
    """A name was looked up that two plugins both registered, so neither is used.

    Only that name is disabled; every other name, built-ins included, keeps
    working. A third-party name that is also a built-in one is no collision:
    the built-in is used and the plugin is warned about. The message names
    both distributions and the ``SHARD_DISABLE_PLUGINS`` setting that resolves it.
    """


class PluginCallError(PluginError):
    """Code that shard called back into raised: a wrap policy, a policy factory, a comm hook.

    Raised ``from`` the original exception, which stays the ``__cause__``. The
    message says what shard was doing (for a wrap policy, the module's
    qualified name), the exception, and whose code raised it: a plugin's
    distribution and entry point, your own module, or shard's. A
    :class:`ShardError` raised by that code is not wrapped: it already names
    the culprit.

    See [Note: catching what a plugin raised].
    """

    def __str__(self) -> str:
        # The KeyError variant would quote the message like a dict key.
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        # The variants are made at run time; rebuild one from its category by name.
        return (_rebuild_plugin_call_error, (_category_of(type(self)).__name__, str(self)))

    @classmethod
    def wrapping(cls, original: BaseException, message: str) -> PluginCallError:
        """A :class:`PluginCallError` that is also an instance of ``original``'s built-in category.

        ``raise PluginCallError.wrapping(exc, message) from exc``.
        """
        category = next((c for c in type(original).__mro__ if c in _CATEGORIES), RuntimeError)
        return _variant(category)(message)


# [Note: catching what a plugin raised]
# A plugin's KeyError reaches the user as a PluginCallError, which names the
# plugin, but an ``except KeyError`` around shard's call should still catch it.
# So the error raised is a run-time subclass of PluginCallError and of the
# original's nearest built-in category below: KeyError stays a KeyError, a
# json.JSONDecodeError a ValueError, a FileNotFoundError an OSError. Only
# built-ins whose constructor takes one message are categories; anything else
# (a plugin's own Exception subclass) is a plain PluginCallError, which is a
# RuntimeError like every PluginError. The original itself is ``__cause__``.
_CATEGORIES: tuple[type[Exception], ...] = (
    ArithmeticError,
    AssertionError,
    AttributeError,
    EOFError,
    ImportError,
    IndexError,
    KeyError,
    LookupError,
    MemoryError,
    NameError,
    NotImplementedError,
    OSError,
    OverflowError,
    RecursionError,
    RuntimeError,
    TypeError,
    ValueError,
    ZeroDivisionError,
)
_VARIANTS: dict[type[Exception], type[PluginCallError]] = {RuntimeError: PluginCallError}


def _variant(category: type[Exception]) -> type[PluginCallError]:
    variant = _VARIANTS.get(category)
    if variant is None:
        name = f"PluginCallError[{category.__name__}]"
        doc = f"A :class:`PluginCallError` whose original exception is a {category.__name__}."
        made = type(name, (PluginCallError, category), {"__module__": __name__, "__doc__": doc})
        made.__qualname__ = name
        variant = _VARIANTS.setdefault(category, cast("type[PluginCallError]", made))
    return variant


def _category_of(variant: type[PluginCallError]) -> type[Exception]:
    return next((c for c, v in _VARIANTS.items() if v is variant), RuntimeError)


def _rebuild_plugin_call_error(category: str, message: str) -> PluginCallError:
    by_name = {c.__name__: c for c in _CATEGORIES}
    return _variant(by_name.get(category, RuntimeError))(message)


class UnknownPluginNameError(ShardError, LookupError):
    """A wrap policy, comm hook or device type was asked for by a name nobody registered.

    The message lists the names that are registered, or the distribution to
    install for a device type.
    """

    def __str__(self) -> str:
        # LookupError would quote the message like a dict key.
        return str(self.args[0]) if self.args else ""


class FrameworkIntegrationWarning(UserWarning):
    """A framework that checks PyTorch's FSDP classes runs beside shard without the integration.

    Lightning, torchtitan, accelerate and the transformers Trainer recognise
    sharded modules by ``isinstance(m, torch.distributed.fsdp.FSDPModule)``;
    without ``shard_runtime.use_shard_for_torch_fsdp()`` they treat shard's
    modules as unsharded and silently lose features (Lightning's
    ``no_backward_sync`` reduces every micro-batch). Shown once per process;
    ``SHARD_FRAMEWORK_CHECK=0`` turns the check off.
    """


class PluginWarning(UserWarning):
    """A plugin, or part of one, was skipped; or two plugins claim one name.

    It failed to load, implements a hook shard does not define (or with
    arguments shard does not pass), its hook raised or returned malformed
    entries, or it claims a name another plugin claims too. The message names
    the distribution and entry point; it is shown once per process, on the
    local rank 0 of each host, at the first caller outside shard.
    """


# - devices


class DeviceUnavailableError(ShardError, RuntimeError):
    """A device handle was asked for device work this process or torch build cannot do.

    No usable device of the handle's type is visible here (a torch build
    without that backend, no device, or another accelerator current).
    """


class DeviceMismatchError(ShardError, ValueError):
    """A device, tensor, stream or event of another device type was handed to a device handle."""


# - communication


class MeshError(ShardError, ValueError):
    """A device mesh cannot be built as asked (shape, groups, node size, axis names)."""


class DistributedInitError(ShardError, RuntimeError):
    """The process group cannot be set up, or is not set up, as asked.

    A launch environment that is incomplete or malformed, a second
    ``init_distributed`` call that conflicts with the process group that
    already exists, or a collective called before any process group exists.
    """


class CollectiveError(ShardError, RuntimeError):
    """A collective failed or timed out, or a peer died while one was in flight.

    Raised on every rank that sees the failure, with the backend's exception
    as ``__cause__``. The message reads the flight recorder of this rank and,
    through the c10d store, of every rank that answers: what each last issued
    and completed (unit, phase, step, sequence number), the first rank whose
    record differs and how, and the ranks that did not answer.
    """


class CommError(ShardError, ValueError):
    """A collective or a gradient reduction was handed arguments it cannot work with.

    Tensor sizes that do not split over the group, a non-contiguous output,
    an unknown reduce op or algorithm, divide factors that do not multiply to
    the group size.
    """
