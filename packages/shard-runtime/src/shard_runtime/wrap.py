"""PyTorch's ``torch.distributed.fsdp.wrap``, for shard: the same names, signatures and answers.

Switch by changing the import line::

    from shard_runtime.wrap import enable_wrap, size_based_auto_wrap_policy, wrap

The policy functions and classes work as ``auto_wrap_policy=`` of
:class:`~shard_runtime.FullyShardedDataParallel` (``functools.partial`` forms
included) and through :func:`~shard_runtime.apply_wrap_policy` for
``fully_shard``. See [Note: PyTorch's policy functions] in ``_wrap_policy.py``.
"""

from shard_core import CustomPolicy, ModuleWrapPolicy
from shard_runtime._wrap_policy import (
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
