"""Model and optimizer state dicts and resharding checkpoints for shard.

The functional API has the names and options of
``torch.distributed.checkpoint.state_dict``; checkpoints are
``torch.distributed.checkpoint`` directories, written atomically::

    from shard_checkpoint import get_state_dict, load, save

    model_state, optim_state = get_state_dict(model, optim)
    save({"model": model_state, "optim": optim_state}, checkpoint_id="ckpt/step-100")
"""

from shard_checkpoint._async import AsyncSave, async_save, close_async_saves
from shard_checkpoint._consolidate import consolidate
from shard_checkpoint._errors import CheckpointError, CorruptCheckpointError, StateDictError
from shard_checkpoint._export import ExportReport, export_full_state_dict
from shard_checkpoint._model import IncompatibleKeys, get_model_state_dict, set_model_state_dict
from shard_checkpoint._optim import get_optimizer_state_dict, set_optimizer_state_dict
from shard_checkpoint._options import StateDictOptions
from shard_checkpoint._state_dict import get_state_dict, set_state_dict
from shard_checkpoint._steps import (
    latest_checkpoint,
    newest_intact_checkpoint,
    prune_checkpoints,
    step_checkpoint_id,
    step_checkpoints,
    step_of,
)
from shard_checkpoint._storage import (
    VerifyReport,
    load,
    resolve_checkpoint,
    save,
    verify_checkpoint,
)
from shard_checkpoint._types import (
    FQNS_T,
    DictValueType,
    ListDictValueType,
    OptimizerStateType,
    PrimitiveType,
    ValueType,
)
from shard_checkpoint._version import __version__

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CorruptCheckpointError",
    "DictValueType",
    "ExportReport",
    "FQNS_T",
    "IncompatibleKeys",
    "ListDictValueType",
    "OptimizerStateType",
    "PrimitiveType",
    "StateDictError",
    "StateDictOptions",
    "ValueType",
    "VerifyReport",
    "__version__",
    "async_save",
    "close_async_saves",
    "consolidate",
    "export_full_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "latest_checkpoint",
    "load",
    "newest_intact_checkpoint",
    "prune_checkpoints",
    "resolve_checkpoint",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "step_checkpoint_id",
    "step_checkpoints",
    "step_of",
    "verify_checkpoint",
]
