"""Model and optimizer state dicts and resharding checkpoints for shard.

The functional API has the names and options of
``torch.distributed.checkpoint.state_dict``; checkpoints are
``torch.distributed.checkpoint`` directories, written atomically::

    from shard_checkpoint import get_model_state_dict, get_optimizer_state_dict, load, save

    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
         checkpoint_id="ckpt/step-100")
"""

from shard_checkpoint._consolidate import consolidate
from shard_checkpoint._errors import CheckpointError, StateDictError
from shard_checkpoint._export import ExportReport, export_full_state_dict
from shard_checkpoint._model import IncompatibleKeys, get_model_state_dict, set_model_state_dict
from shard_checkpoint._optim import get_optimizer_state_dict, set_optimizer_state_dict
from shard_checkpoint._options import StateDictOptions
from shard_checkpoint._storage import load, resolve_checkpoint, save
from shard_checkpoint._version import __version__

__all__ = [
    "CheckpointError",
    "ExportReport",
    "IncompatibleKeys",
    "StateDictError",
    "StateDictOptions",
    "__version__",
    "consolidate",
    "export_full_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "load",
    "resolve_checkpoint",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]
