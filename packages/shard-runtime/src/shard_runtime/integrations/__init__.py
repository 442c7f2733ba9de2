"""Opt-in integrations that let other code run on shard without being changed.

``use_shard_for_torch_fsdp()`` makes PyTorch's public FSDP names
(``torch.distributed.fsdp.fully_shard``, ``FSDPModule``,
``FullyShardedDataParallel``, ...) resolve to shard's, so that frameworks
which call them (Lightning Fabric, torchtitan, Hugging Face accelerate) run
on shard, and torch.distributed.pipelining drives shard's stages as it
drives PyTorch's. Importing this package imports ``torch.distributed.fsdp``; nothing
else in shard does (see ``torch_fsdp``).
"""

from shard_runtime.integrations.torch_fsdp import (
    KNOWN_FRAMEWORKS,
    TORCH_FSDP_CLIENTS,
    TORCH_FSDP_MODULES,
    LateBindingError,
    LateBindingWarning,
    TorchFSDPPatch,
    use_shard_for_torch_fsdp,
)

__all__ = [
    "KNOWN_FRAMEWORKS",
    "LateBindingError",
    "LateBindingWarning",
    "TORCH_FSDP_CLIENTS",
    "TORCH_FSDP_MODULES",
    "TorchFSDPPatch",
    "use_shard_for_torch_fsdp",
]
