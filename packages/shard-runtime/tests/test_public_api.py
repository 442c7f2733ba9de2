"""shard-runtime's front door and its plumbing module export exactly their documented names."""

from __future__ import annotations

import importlib

import pytest

FRONT_DOOR = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "CustomPolicy",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "FSDPModule",
    "FlatShard",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "HSDPMeshInfo",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "ModuleWrapPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardPlacementResult",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "WrapPolicyLike",
    "__version__",
    "always_wrap_policy",
    "apply_wrap_policy",
    "enable_wrap",
    "flat_shard_placement",
    "fully_shard",
    "lambda_auto_wrap_policy",
    "register_fsdp_forward_method",
    "release_host_memory",
    "set_release_host_memory_after_backward",
    "share_comm_ctx",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "use_shard_for_torch_fsdp",
]

PLUMBING = [
    "FlatUnit",
    "FlatUnitParam",
    "ShardedParam",
    "clean_fqn",
    "contiguous_dtensor",
    "flat_sharded_params",
    "flat_to_rows",
    "flat_units",
    "full_to_flat",
    "is_flat_layout",
    "is_tensor_subclass",
    "meta_tie_groups",
    "original_buffer_dtypes",
    "plan_units",
    "raw_module_state_dicts",
    "resolve_wrap_policy",
    "retie",
]


@pytest.mark.parametrize(
    ("module", "names"),
    [("shard_runtime", FRONT_DOOR), ("shard_runtime.plumbing", PLUMBING)],
)
def test_all_is_sorted_complete_and_importable(module: str, names: list[str]) -> None:
    """Each module's ``__all__`` is the expected sorted list and every name in it resolves."""
    mod = importlib.import_module(module)
    assert mod.__all__ == names
    assert mod.__all__ == sorted(mod.__all__)
    for name in names:
        assert getattr(mod, name) is not None, name


def test_plumbing_is_not_on_the_front_door() -> None:
    """The plumbing names are reached through ``shard_runtime.plumbing`` only."""
    import shard_runtime

    for name in PLUMBING:
        assert not hasattr(shard_runtime, name), name
