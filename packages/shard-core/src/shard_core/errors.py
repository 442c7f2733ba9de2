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

__all__ = [
    "CollectiveError",
    "CommError",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "DistributedInitError",
    "LayoutError",
    "MeshError",
    "ModelMismatchError",
    "OptimizerStepError",
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
    """Two plugins registered the same name for the same kind of extension."""


class UnknownPluginNameError(ShardError, LookupError):
    """A wrap policy, comm hook or device type was asked for by a name nobody registered.

    The message lists the names that are registered, or the distribution to
    install for a device type.
    """

    def __str__(self) -> str:
        # LookupError would quote the message like a dict key.
        return str(self.args[0]) if self.args else ""


class PluginWarning(UserWarning):
    """A plugin was skipped: it failed to load, or its hook raised or returned a malformed value."""


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
