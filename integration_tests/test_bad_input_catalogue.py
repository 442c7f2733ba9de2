"""The bad-input catalogue: each kind of bad input, its exception type and a message that helps.

One row of ``CATALOGUE`` per kind of bad input: the scenario that builds it,
the exact exception type it raises, text that must name the culprit (module,
parameter, rank, path) and text that must say the fix. The list below is
generated from the table (``python integration_tests/test_bad_input_catalogue.py``
rewrites it; a test checks it is current). Where an older test covers the
same input, the catalogue calls the scenario again, compactly, so that the
whole list is checked in one place.

Every multi-rank scenario of one world size runs in one ``rank_pool.run``:
each scenario catches its own exception and every rank raises at the same
point (before any mismatched collective), so the process group stays in
step and the pool's group is reused.

The catalogue: each kind, then its exception [test id] and, where an older
test covers the same input, that test's file:

.. catalogue-start
 1. ranks whose models differ in a parameter's shape (fully_shard)
    ModelMismatchError [shapes_differ]
 2. ranks whose models name their parameters differently
    ModelMismatchError [names_differ]
 3. ranks with different wrap plans (fully_shard on different submodules)
    ModelMismatchError [wrap_plans_differ]
 4. ranks that freeze different parameters
    ModelMismatchError [requires_grad_differs]
 5. ranks whose models differ in shapes (FullyShardedDataParallel)
    ModelMismatchError [wrapper_shapes_differ]
 6. ranks with different auto_wrap_policy decisions (FullyShardedDataParallel)
    ModelMismatchError [wrapper_plans_differ]
 7. ranks whose models differ, with sync_module_states=True (found before the broadcast)
    ModelMismatchError [wrapper_sync_models_differ]
 8. one rank's model differs on a 2-D (replicate, shard) mesh: every rank raises
    ModelMismatchError [hybrid_one_rank_differs]
 9. one rank's model differs, HYBRID_SHARD with sync_module_states=True: every rank raises
    ModelMismatchError [wrapper_hybrid_sync_one_rank_differs]
10. a mesh whose size disagrees with the world
    MeshError [mesh_size_vs_world], also shard-comms/tests/test_mesh.py
11. fully_shard applied twice to one module
    AssertionError [fully_shard_twice], also shard-runtime/tests/test_compat_fully_shard.py
12. a tensor subclass parameter with fsdp_pre_all_gather but no fsdp_post_all_gather
    AssertionError [one_extension_hook], also shard-runtime/tests/test_fully_shard_extensions.py
13. parameters of mixed dtypes in one flat unit (FullyShardedDataParallel)
    LayoutError [wrapper_mixed_dtypes]
14. a tensor subclass parameter in one flat unit (FullyShardedDataParallel)
    TypeError [wrapper_subclass_param], also shard-runtime/tests/test_fully_shard_extensions.py
15. fully_shard before torch.distributed is initialized, without a mesh
    RuntimeError [fully_shard_without_init]
16. FullyShardedDataParallel before torch.distributed is initialized, without a mesh
    RuntimeError [wrapper_without_init]
17. integer parameters requiring grad (an integer param_dtype for trainable parameters)
    LayoutError [integer_param_dtype]
18. optimizer.step() before backward finished (in a backward hook)
    OptimizerStepError [step_in_backward]
19. parameters still on the meta device at the first forward
    RuntimeError [meta_at_forward], also shard-runtime/tests/test_fully_shard_api.py
20. fully_shard on a container with no forward (ModuleList)
    ValueError [container_without_forward], also shard-runtime/tests/test_fully_shard_api.py
21. a 0-d (scalar) parameter
    LayoutError [scalar_parameter], also shard-runtime/tests/test_fully_shard_api.py
22. a non-contiguous parameter
    NotImplementedError [non_contiguous], also shard-runtime/tests/test_fully_shard_api.py
23. a parameter shared by two units (refused at the root's first forward, as PyTorch)
    ValueError [shared_across_units], also shard-runtime/tests/test_fully_shard_api.py
24. reshard_after_forward as an int that does not divide the shard axis
    ValueError [bad_reshard_size], also shard-runtime/tests/test_fully_shard_api.py
25. a 2-D mesh without axis names
    AssertionError [unnamed_2d_mesh], also shard-runtime/tests/test_fully_shard_api.py
26. copy.deepcopy of a sharded module
    AssertionError [deepcopy], also shard-runtime/tests/test_fully_shard_api.py
27. fully_shard on something that is not a module
    TypeError [not_a_module]
28. fully_shard on an empty list
    ValueError [empty_list]
29. a submodule's forward run before its root's first forward
    RuntimeError [inner_forward_first], also shard-runtime/tests/test_fully_shard_api.py
30. a sharded parameter replaced by a plain (full) tensor
    AttributeError [replaced_by_plain_tensor], also shard-runtime/tests/test_fully_shard_api.py
31. register_fsdp_forward_method with a method the module lacks
    ValueError [missing_forward_method], also shard-runtime/tests/test_compat_fully_shard.py
32. a sharding_strategy that is not a ShardingStrategy
    TypeError [wrapper_bad_strategy], also shard-runtime/tests/test_wrapper_api.py
33. frozen and trainable parameters in one flat parameter
    ValueError [wrapper_frozen_mix], also shard-runtime/tests/test_wrapper_api.py
34. FullyShardedDataParallel over a module already sharded by fully_shard
    ValueError [wrapper_over_fully_shard], also shard-runtime/tests/test_wrapper_api.py
35. both process_group and device_mesh
    ValueError [wrapper_group_and_mesh]
36. a hybrid strategy given one process group
    ValueError [wrapper_hybrid_plain_group]
37. a wrap policy asked for by a name nobody registered
    UnknownPluginNameError [unknown_wrap_policy], also shard-core/tests/test_registry.py
38. a registered wrap policy given an option it does not take
    WrapPlanError [wrong_policy_options], also shard-core/tests/test_registry.py
39. a wrap policy whose wrap() raises
    PluginCallError[KeyError] [policy_raises], also shard-core/tests/test_plugin_call_errors.py
40. a comm hook that raises (FullyShardedDataParallel.register_comm_hook)
    PluginCallError[KeyError] [comm_hook_raises], also shard-comms/tests/test_comm_hooks.py
41. DataParallelMeshDims with neither axis
    ValueError [empty_mesh_dims]
42. load of a checkpoint from a different model (other names)
    CheckpointError [load_other_model], also shard-checkpoint/tests/test_storage.py
43. load of a checkpoint from a different model (other shapes)
    CheckpointError [load_other_shapes], also shard-checkpoint/tests/test_storage.py
44. a truncated checkpoint data file
    CorruptCheckpointError [truncated_data_file], also shard-checkpoint/tests/test_integrity.py
45. a corrupted (cut) .metadata file
    CorruptCheckpointError [corrupt_metadata], also shard-checkpoint/tests/test_integrity.py
46. a corrupted checkpoint data file (overwritten bytes)
    CorruptCheckpointError [corrupt_data_file], also shard-checkpoint/tests/test_integrity.py
47. an unwritable checkpoint directory (EACCES); the previous checkpoint loads
    CheckpointError [unwritable_directory]
48. a checkpoint path under a file
    CheckpointError [parent_not_a_directory]
49. a full disk (ENOSPC) while saving; the previous checkpoint loads
    CheckpointError [disk_full], also shard-checkpoint/tests/test_failures.py
50. a checkpoint_id that is a file
    CheckpointError [checkpoint_id_is_a_file], also shard-checkpoint/tests/test_storage.py
51. a checkpoint_id that is a directory of other files
    CheckpointError [directory_not_a_checkpoint], also shard-checkpoint/tests/test_storage.py
52. load from a path with no checkpoint
    CheckpointError [load_missing], also shard-checkpoint/tests/test_storage.py
53. load of a checkpoint a failed save left incomplete
    CheckpointError [load_incomplete], also shard-checkpoint/tests/test_storage.py
.. catalogue-end
"""

from __future__ import annotations

import contextlib
import copy
import errno
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.futures import Future

from shard_checkpoint import CheckpointError, CorruptCheckpointError, load, save
from shard_comms import build_mesh
from shard_core import plan_wraps
from shard_core.errors import (
    LayoutError,
    MeshError,
    ModelMismatchError,
    OptimizerStepError,
    PluginCallError,
    UnknownPluginNameError,
    WrapPlanError,
)
from shard_core.plugin import get_registry
from shard_runtime import (
    DataParallelMeshDims,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingStrategy,
    _fingerprint,
    fully_shard,
    register_fsdp_forward_method,
)
from shard_runtime.wrap import ModuleWrapPolicy
from shard_testing import RankPool

HERE = Path(__file__).resolve()
_START, _END = ".. catalogue-start\n", ".. catalogue-end\n"


@dataclass(frozen=True)
class Kind:
    """One kind of bad input and what its error must say."""

    id: str
    what: str  # the bad input, in words
    error: type[BaseException]
    names: tuple[str, ...]  # the culprit: each must appear in the message
    fix: tuple[str, ...]  # the fix: each must appear in the message
    covered: str = ""  # an older test of the same input
    where: str = "ranks"  # "ranks": on 2 gloo ranks; "ranks4": on 4; "local": in this process


# ---------------------------------------------------------------------- scenarios on ranks


def _mesh() -> Any:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _rank() -> int:
    return dist.get_rank()


def _blocks(widths: list[int]) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))


def _forward(model: nn.Module, features: int = 4) -> None:
    model(torch.ones(2, features))


def _shapes_differ() -> None:
    model = _blocks([4, 4, 4] if _rank() == 0 else [4, 6, 4])
    for block in model:
        fully_shard(block, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    _forward(model)


def _names_differ() -> None:
    model = _blocks([4, 4, 4])
    if _rank() == 1:
        model = nn.Sequential()
        model.add_module("first", nn.Linear(4, 4))
        model.add_module("second", nn.Linear(4, 4))
    fully_shard(model, mesh=_mesh())
    _forward(model)


def _wrap_plans_differ() -> None:
    model = _blocks([4, 4, 4, 4])
    blocks = [model[0], model[1]] if _rank() == 0 else [model[0]]
    for block in blocks:
        fully_shard(block, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    _forward(model)


def _requires_grad_differs() -> None:
    model = _blocks([4, 4, 4])
    model[1].bias.requires_grad_(_rank() == 0)
    fully_shard(model, mesh=_mesh())
    _forward(model)


def _wrapper_shapes_differ() -> None:
    model = _blocks([4, 4, 4] if _rank() == 0 else [4, 8, 4])
    wrapped = FullyShardedDataParallel(model, device_mesh=_mesh())
    _forward(wrapped)


def _wrapper_plans_differ() -> None:
    policy = ModuleWrapPolicy({nn.Linear}) if _rank() == 0 else None
    wrapped = FullyShardedDataParallel(
        _blocks([4, 4, 4]), device_mesh=_mesh(), auto_wrap_policy=policy
    )
    _forward(wrapped)


def _wrapper_sync_models_differ() -> None:
    model = _blocks([4, 4, 4] if _rank() == 0 else [4, 8, 4])
    FullyShardedDataParallel(model, device_mesh=_mesh(), sync_module_states=True)


def _mesh_size_vs_world() -> None:
    build_mesh(shape=(3,))


def _fully_shard_twice() -> None:
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=_mesh())
    fully_shard(model, mesh=_mesh())


class _Float64Scale(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).double() * self.scale


def _mixed_dtypes() -> None:
    """Allowed since #23: one unit of several dtypes gathers bytes, reduces per dtype."""
    model = _Float64Scale()
    fully_shard(model, mesh=_mesh())
    model(torch.ones(2, 4)).sum().backward()


class _OnlyPreAllGather(torch.Tensor):
    """Half of the tensor-subclass all-gather contract."""

    def fsdp_pre_all_gather(self, mesh: object) -> tuple[tuple[torch.Tensor, ...], object]:
        return (self,), None


def _one_extension_hook() -> None:
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(model.weight.detach().as_subclass(_OnlyPreAllGather))
    fully_shard(model, mesh=_mesh())


def _wrapper_subclass_param() -> None:
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(model.weight.detach().as_subclass(_OnlyPreAllGather))
    FullyShardedDataParallel(model, device_mesh=_mesh())


def _wrapper_mixed_dtypes() -> None:
    model = nn.Linear(4, 4)
    model.bias = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    FullyShardedDataParallel(model, device_mesh=_mesh())


def _integer_param_in_unit() -> None:
    """Allowed since #23: a frozen integer parameter travels as bytes beside the others."""
    model = nn.Linear(4, 4)
    model.register_parameter("index", nn.Parameter(torch.zeros(4, dtype=torch.int64), False))
    fully_shard(model, mesh=_mesh())
    model(torch.ones(2, 4)).sum().backward()


def _step_in_backward() -> None:
    model = _blocks([4, 4, 4])
    for block in model:
        fully_shard(block, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.ones(2, 4))
    out.register_hook(lambda grad: optimizer.step())
    try:
        out.sum().backward()
    finally:
        model.reset_iter_state()  # type: ignore[operator]
        # A normal step afterwards is not refused.
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()


def _step_per_unit_in_backward(in_backward: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _blocks([4, 4, 4])
    for block in model:
        fully_shard(block, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    late = torch.optim.SGD(model[1].parameters(), lr=0.1)  # its unit reduces first
    inputs = torch.ones(2, 4, requires_grad=True)
    if in_backward:
        # Runs in block 0's backward: block 1 has reduced, its reduction may be in flight.
        inputs.register_hook(lambda grad: late.step())  # type: ignore[no-untyped-call]
    model(inputs).sum().backward()
    if not in_backward:
        late.step()
    return [p.full_tensor() for p in model[1].parameters()]  # type: ignore[attr-defined]


def _step_in_backward_after_reduce() -> None:
    """Allowed: a per-unit step in backward on a reduced unit equals the step after backward."""
    got, want = _step_per_unit_in_backward(True), _step_per_unit_in_backward(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)


def _meta_at_forward() -> None:
    with torch.device("meta"):
        model = _blocks([4, 4, 4])
    fully_shard(model, mesh=_mesh())
    _forward(model)


def _container_without_forward() -> None:
    fully_shard(nn.ModuleList([nn.Linear(4, 4)]), mesh=_mesh())


def _scalar_parameter() -> None:
    model = nn.Linear(4, 4)
    model.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    fully_shard(model, mesh=_mesh())


def _non_contiguous() -> None:
    model = nn.Linear(4, 6)
    model.weight = nn.Parameter(torch.randn(4, 6).t())
    fully_shard(model, mesh=_mesh())


def _shared_across_units() -> None:
    model = _blocks([4, 4, 4])
    model[1].weight = model[0].weight
    fully_shard(model[0], mesh=_mesh())
    fully_shard(model[1], mesh=_mesh())  # accepted, as PyTorch does: the root's forward refuses
    fully_shard(model, mesh=_mesh())
    _forward(model)


def _bad_reshard_size() -> None:
    fully_shard(nn.Linear(4, 4), mesh=_mesh(), reshard_after_forward=3)


def _unnamed_2d_mesh() -> None:
    fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2)))


def _deepcopy() -> None:
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=_mesh())
    copy.deepcopy(model)


def _not_a_module() -> None:
    fully_shard(torch.zeros(3), mesh=_mesh())  # type: ignore[call-overload]


def _empty_list() -> None:
    fully_shard([], mesh=_mesh())


def _inner_forward_first() -> None:
    model = _blocks([4, 4, 4])
    fully_shard(model[0], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    model[0](torch.ones(2, 4))
    _forward(model)


def _replaced_by_plain_tensor() -> None:
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=_mesh())
    model.weight = nn.Parameter(torch.zeros(4, 4))
    _forward(model)


def _missing_forward_method() -> None:
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=_mesh())
    register_fsdp_forward_method(model, "generate")


def _wrapper_bad_strategy() -> None:
    FullyShardedDataParallel(nn.Linear(4, 4), sharding_strategy="FULL_SHARD")  # type: ignore[arg-type]


def _wrapper_frozen_mix() -> None:
    model = nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    FullyShardedDataParallel(model, device_mesh=_mesh())


def _wrapper_over_fully_shard() -> None:
    model = _blocks([4, 4, 4])
    fully_shard(model[0], mesh=_mesh())
    FullyShardedDataParallel(model, device_mesh=_mesh())


def _wrapper_group_and_mesh() -> None:
    FullyShardedDataParallel(nn.Linear(4, 4), process_group=dist.group.WORLD, device_mesh=_mesh())


def _wrapper_hybrid_plain_group() -> None:
    FullyShardedDataParallel(
        nn.Linear(4, 4),
        process_group=dist.group.WORLD,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
    )


def _raising_comm_hook(reducer: object, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    raise KeyError("oops in hook")


def _comm_hook_raises() -> None:
    model = FullyShardedDataParallel(_blocks([4, 4]), device_mesh=_mesh())
    model.register_comm_hook(_raising_comm_hook)
    model(torch.ones(2, 4)).sum().backward()


RANK_SCENARIOS: dict[str, Callable[[], None]] = {
    "shapes_differ": _shapes_differ,
    "names_differ": _names_differ,
    "wrap_plans_differ": _wrap_plans_differ,
    "requires_grad_differs": _requires_grad_differs,
    "wrapper_shapes_differ": _wrapper_shapes_differ,
    "wrapper_plans_differ": _wrapper_plans_differ,
    "wrapper_sync_models_differ": _wrapper_sync_models_differ,
    "mesh_size_vs_world": _mesh_size_vs_world,
    "fully_shard_twice": _fully_shard_twice,
    "one_extension_hook": _one_extension_hook,
    "wrapper_mixed_dtypes": _wrapper_mixed_dtypes,
    "wrapper_subclass_param": _wrapper_subclass_param,
    "step_in_backward": _step_in_backward,
    "meta_at_forward": _meta_at_forward,
    "container_without_forward": _container_without_forward,
    "scalar_parameter": _scalar_parameter,
    "non_contiguous": _non_contiguous,
    "shared_across_units": _shared_across_units,
    "bad_reshard_size": _bad_reshard_size,
    "unnamed_2d_mesh": _unnamed_2d_mesh,
    "deepcopy": _deepcopy,
    "not_a_module": _not_a_module,
    "empty_list": _empty_list,
    "inner_forward_first": _inner_forward_first,
    "replaced_by_plain_tensor": _replaced_by_plain_tensor,
    "missing_forward_method": _missing_forward_method,
    "wrapper_bad_strategy": _wrapper_bad_strategy,
    "wrapper_frozen_mix": _wrapper_frozen_mix,
    "wrapper_over_fully_shard": _wrapper_over_fully_shard,
    "wrapper_group_and_mesh": _wrapper_group_and_mesh,
    "wrapper_hybrid_plain_group": _wrapper_hybrid_plain_group,
    "comm_hook_raises": _comm_hook_raises,
}


def _hybrid_mesh() -> Any:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _hybrid_one_rank_differs() -> None:
    model = _blocks([4, 8, 4] if _rank() == 3 else [4, 4, 4])
    for block in model:
        fully_shard(block, mesh=_hybrid_mesh())
    fully_shard(model, mesh=_hybrid_mesh())
    _forward(model)


def _wrapper_hybrid_sync_one_rank_differs() -> None:
    model = _blocks([4, 8, 4] if _rank() == 3 else [4, 4, 4])
    FullyShardedDataParallel(
        model,
        device_mesh=_hybrid_mesh(),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        sync_module_states=True,
    )


# At world size 4, on a (replicate 2, shard 2) mesh: every rank must raise, also
# ranks 0 and 1, whose own shard group and replica agree.
HYBRID_SCENARIOS: dict[str, Callable[[], None]] = {
    "hybrid_one_rank_differs": _hybrid_one_rank_differs,
    "wrapper_hybrid_sync_one_rank_differs": _wrapper_hybrid_sync_one_rank_differs,
}


# Not bad input: scenarios the checks above must let through, run in the same group.
ALLOWED_SCENARIOS: dict[str, Callable[[], None]] = {
    "step_in_backward_after_reduce": _step_in_backward_after_reduce,
    "mixed_dtypes": _mixed_dtypes,
    "integer_param_in_unit": _integer_param_in_unit,
}


def _outcome(fn: Callable[[], object]) -> tuple[str, str]:
    """(qualified exception type, message), or ("", "") when nothing was raised."""
    try:
        fn()
    except Exception as exc:  # the catalogue records whatever is raised
        return f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)
    return "", ""


def _run_rank_scenarios(names: list[str]) -> dict[str, tuple[str, str]]:
    scenarios = {**RANK_SCENARIOS, **ALLOWED_SCENARIOS, **HYBRID_SCENARIOS}
    return {name: _outcome(scenarios[name]) for name in names}


# ---------------------------------------------------------------------- local scenarios


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((8, 4), value), "b": torch.full((4,), value)}}


def _saved(tmp: Path, value: float = 1.0) -> Path:
    path = tmp / "ckpt"
    save(_state(value), checkpoint_id=path)
    return path


def _loads_previous(path: Path, value: float = 1.0) -> None:
    """The checkpoint at ``path`` still loads the values it was saved with."""
    state = _state(0.0)
    load(state, checkpoint_id=path)
    for key, tensor in state["model"].items():
        assert torch.equal(tensor, _state(value)["model"][key]), key


class _RaisingWriter(FileSystemWriter):
    """Raises ``OSError(code)`` while writing data, as a full or read-only disk does."""

    def __init__(self, path: Path, code: int) -> None:
        super().__init__(path)
        self._code = code

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        raise OSError(self._code, os.strerror(self._code))


def _other_model(tmp: Path) -> None:
    path = _saved(tmp)
    load({"model": {"weight": torch.zeros(8, 4)}}, checkpoint_id=path)


def _other_shapes(tmp: Path) -> None:
    path = _saved(tmp)
    load({"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}}, checkpoint_id=path)


def _data_file(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


def _truncated(tmp: Path) -> None:
    path = _saved(tmp)
    data = _data_file(path)
    data.write_bytes(data.read_bytes()[:100])
    load(_state(0.0), checkpoint_id=path)


def _corrupt_metadata(tmp: Path) -> None:
    path = _saved(tmp)
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    load(_state(0.0), checkpoint_id=path)


def _corrupt_data(tmp: Path) -> None:
    path = _saved(tmp)
    data = _data_file(path)
    data.write_bytes(bytes(b ^ 0x5A for b in data.read_bytes()))
    load(_state(0.0), checkpoint_id=path)


def _unwritable(tmp: Path) -> None:
    path = _saved(tmp)
    try:
        save(_state(2.0), checkpoint_id=path, storage_writer=_RaisingWriter(path, errno.EACCES))
    finally:
        _loads_previous(path)


def _parent_not_a_directory(tmp: Path) -> None:
    (tmp / "runs").write_text("a file where a directory should be")
    save(_state(2.0), checkpoint_id=tmp / "runs" / "ckpt")


def _disk_full(tmp: Path) -> None:
    path = _saved(tmp)
    try:
        save(_state(2.0), checkpoint_id=path, storage_writer=_RaisingWriter(path, errno.ENOSPC))
    finally:
        _loads_previous(path)
        assert sorted(p.name for p in tmp.iterdir()) == ["ckpt"]  # partial files removed


def _id_is_a_file(tmp: Path) -> None:
    (tmp / "ckpt").write_text("not a checkpoint")
    save(_state(2.0), checkpoint_id=tmp / "ckpt")


def _dir_not_a_checkpoint(tmp: Path) -> None:
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "notes.txt").write_text("mine")
    save(_state(2.0), checkpoint_id=tmp / "ckpt")


def _load_missing(tmp: Path) -> None:
    load(_state(0.0), checkpoint_id=tmp / "nothing")


def _load_incomplete(tmp: Path) -> None:
    path = _saved(tmp)
    with contextlib.suppress(CheckpointError):
        save(_state(2.0), checkpoint_id=path, storage_writer=_RaisingWriter(path, errno.EIO))
    staging = next(p for p in tmp.iterdir() if p.name.startswith("ckpt.incomplete-"))
    load(_state(0.0), checkpoint_id=staging)


def _integer_param_dtype(tmp: Path) -> None:
    MixedPrecisionPolicy(param_dtype=torch.int32)


def _unknown_wrap_policy(tmp: Path) -> None:
    get_registry().wrap_policy("module_clas")


def _wrong_policy_options(tmp: Path) -> None:
    get_registry().wrap_policy("size", min_params=10)


class _RaisingPolicy:
    def descend(self, module: nn.Module, name: str) -> bool:
        return True

    def wrap(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        if name == "1":
            raise KeyError("oops in wrap")
        return False

    def __repr__(self) -> str:
        return "_RaisingPolicy()"


def _policy_raises_in_wrap(tmp: Path) -> None:
    plan_wraps(_blocks([4, 4, 4]), _RaisingPolicy())


def _empty_mesh_dims(tmp: Path) -> None:
    DataParallelMeshDims()


def _fully_shard_without_init(tmp: Path) -> None:
    assert not dist.is_initialized()
    fully_shard(nn.Linear(4, 4))


def _wrapper_without_init(tmp: Path) -> None:
    assert not dist.is_initialized()
    FullyShardedDataParallel(nn.Linear(4, 4), auto_wrap_policy="transfomer")  # misspelled too


LOCAL_SCENARIOS: dict[str, Callable[[Path], None]] = {
    "load_other_model": _other_model,
    "load_other_shapes": _other_shapes,
    "truncated_data_file": _truncated,
    "corrupt_metadata": _corrupt_metadata,
    "corrupt_data_file": _corrupt_data,
    "unwritable_directory": _unwritable,
    "parent_not_a_directory": _parent_not_a_directory,
    "disk_full": _disk_full,
    "checkpoint_id_is_a_file": _id_is_a_file,
    "directory_not_a_checkpoint": _dir_not_a_checkpoint,
    "load_missing": _load_missing,
    "load_incomplete": _load_incomplete,
    "integer_param_dtype": _integer_param_dtype,
    "unknown_wrap_policy": _unknown_wrap_policy,
    "wrong_policy_options": _wrong_policy_options,
    "policy_raises": _policy_raises_in_wrap,
    "empty_mesh_dims": _empty_mesh_dims,
    "fully_shard_without_init": _fully_shard_without_init,
    "wrapper_without_init": _wrapper_without_init,
}


# ---------------------------------------------------------------------- the catalogue

_SAME_MODEL = ("Every rank must build the same model", "in the same order")
_CKPT = "shard-checkpoint/tests/test_storage.py"

CATALOGUE: list[Kind] = [
    # - ranks that disagree (found by the fingerprint check at the root's lazy init)
    Kind(
        "shapes_differ",
        "ranks whose models differ in a parameter's shape (fully_shard)",
        ModelMismatchError,
        ("'0.weight' shape (4, 4)", "'0.weight' shape (6, 4)", "rank 0 has", "rank 1 has"),
        _SAME_MODEL,
    ),
    Kind(
        "names_differ",
        "ranks whose models name their parameters differently",
        ModelMismatchError,
        ("'0.weight'", "'first.weight'", "rank 0", "rank 1"),
        _SAME_MODEL,
    ),
    Kind(
        "wrap_plans_differ",
        "ranks with different wrap plans (fully_shard on different submodules)",
        ModelMismatchError,
        (
            "wrap plans",
            "rank 0 has unit '1', but rank 1 has nothing there",
            "['(root)', '0', '1']",
            "['(root)', '0']",
        ),
        _SAME_MODEL,
    ),
    Kind(
        "requires_grad_differs",
        "ranks that freeze different parameters",
        ModelMismatchError,
        ("'1.bias'", "requires_grad=True", "requires_grad=False", "rank 1"),
        _SAME_MODEL,
    ),
    Kind(
        "wrapper_shapes_differ",
        "ranks whose models differ in shapes (FullyShardedDataParallel)",
        ModelMismatchError,
        ("FullyShardedDataParallel:", "'0.weight' shape (4, 4)", "'0.weight' shape (8, 4)"),
        _SAME_MODEL,
    ),
    Kind(
        "wrapper_plans_differ",
        "ranks with different auto_wrap_policy decisions (FullyShardedDataParallel)",
        ModelMismatchError,
        ("wrap plans", "rank 0 has unit '0'", "rank 1"),
        _SAME_MODEL,
    ),
    Kind(
        "wrapper_sync_models_differ",
        "ranks whose models differ, with sync_module_states=True (found before the broadcast)",
        ModelMismatchError,
        ("FullyShardedDataParallel(sync_module_states=True)", "'0.weight' shape (8, 4)"),
        _SAME_MODEL,
    ),
    Kind(
        "hybrid_one_rank_differs",
        "one rank's model differs on a 2-D (replicate, shard) mesh: every rank raises",
        ModelMismatchError,
        ("fully_shard: the ranks do not hold the same model",),
        ("Every rank must build the same model",),
        where="ranks4",
    ),
    Kind(
        "wrapper_hybrid_sync_one_rank_differs",
        "one rank's model differs, HYBRID_SHARD with sync_module_states=True: every rank raises",
        ModelMismatchError,
        ("FullyShardedDataParallel(sync_module_states=True)",),
        ("Every rank must build the same model",),
        where="ranks4",
    ),
    Kind(
        "mesh_size_vs_world",
        "a mesh whose size disagrees with the world",
        MeshError,
        ("shape=(3,) holds 3 ranks but the world has 2",),
        ("must multiply to the world size",),
        "shard-comms/tests/test_mesh.py",
    ),
    # - fully_shard
    Kind(
        "fully_shard_twice",
        "fully_shard applied twice to one module",
        AssertionError,
        ("Linear is already sharded",),
        ("apply fully_shard once per module",),
        "shard-runtime/tests/test_compat_fully_shard.py",
    ),
    Kind(
        "one_extension_hook",
        "a tensor subclass parameter with fsdp_pre_all_gather but no fsdp_post_all_gather",
        AssertionError,
        ("parameter 'weight'", "_OnlyPreAllGather", "not fsdp_post_all_gather"),
        ("Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined",),
        "shard-runtime/tests/test_fully_shard_extensions.py",
    ),
    Kind(
        "wrapper_mixed_dtypes",
        "parameters of mixed dtypes in one flat unit (FullyShardedDataParallel)",
        LayoutError,
        ("FullyShardedDataParallel(Linear)", "weight (float32)", "bias (float64)"),
        ("cast them to one dtype", "wrap the differently typed submodule"),
    ),
    Kind(
        "wrapper_subclass_param",
        "a tensor subclass parameter in one flat unit (FullyShardedDataParallel)",
        TypeError,
        ("FullyShardedDataParallel(Linear)", "parameter 'weight'", "_OnlyPreAllGather"),
        ("Shard this module with fully_shard",),
        "shard-runtime/tests/test_fully_shard_extensions.py",
    ),
    Kind(
        "fully_shard_without_init",
        "fully_shard before torch.distributed is initialized, without a mesh",
        RuntimeError,
        ("fully_shard", "torch.distributed is not initialized"),
        ("shard_comms.init_distributed()", "pass mesh="),
        where="local",
    ),
    Kind(
        "wrapper_without_init",
        "FullyShardedDataParallel before torch.distributed is initialized, without a mesh",
        RuntimeError,
        ("FullyShardedDataParallel", "torch.distributed is not initialized"),
        ("shard_comms.init_distributed()", "device_mesh="),
        where="local",
    ),
    Kind(
        "integer_param_dtype",
        "integer parameters requiring grad (an integer param_dtype for trainable parameters)",
        LayoutError,
        ("MixedPrecisionPolicy: param_dtype=torch.int32",),
        ("pass a floating-point dtype",),
        where="local",
    ),
    Kind(
        "step_in_backward",
        "optimizer.step() before backward finished (in a backward hook)",
        OptimizerStepError,
        ("SGD.step() ran during backward", "before the unit '0' reduced its gradients"),
        ("call optimizer.step() after loss.backward() returns",),
    ),
    Kind(
        "meta_at_forward",
        "parameters still on the meta device at the first forward",
        RuntimeError,
        ("0.weight, 0.bias, 1.weight, 1.bias",),
        ("call module.to_empty(device=...)",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "container_without_forward",
        "fully_shard on a container with no forward (ModuleList)",
        ValueError,
        ("ModuleList is a container without a forward",),
        ("shard its children instead",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "scalar_parameter",
        "a 0-d (scalar) parameter",
        LayoutError,
        ("parameter 'scale' is a scalar",),
        ("nn.Parameter(value.reshape(1))",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "non_contiguous",
        "a non-contiguous parameter",
        NotImplementedError,
        ("parameter 'weight' is not contiguous",),
        ("nn.Parameter(param.contiguous())",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "shared_across_units",
        "a parameter shared by two units (refused at the root's first forward, as PyTorch)",
        ValueError,
        ("parameter 'weight' is shared with a parameter already managed by another FSDP group",),
        ("pass the modules that share it as a list to one fully_shard call",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "bad_reshard_size",
        "reshard_after_forward as an int that does not divide the shard axis",
        ValueError,
        ("shard axis size 2", "got 3"),
        ("an int that divides the shard axis size",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "unnamed_2d_mesh",
        "a 2-D mesh without axis names",
        AssertionError,
        ("a 2-D mesh needs axis names",),
        ("mesh_dim_names=('replicate', 'shard')",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "deepcopy",
        "copy.deepcopy of a sharded module",
        AssertionError,
        ("FSDPLinear is sharded by fully_shard",),
        ("copy the model's state dict instead",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "not_a_module",
        "fully_shard on something that is not a module",
        TypeError,
        ("got Tensor",),
        ("expects an nn.Module or a list of them",),
    ),
    Kind(
        "empty_list",
        "fully_shard on an empty list",
        ValueError,
        ("got an empty list of modules",),
        ("fully_shard",),
    ),
    Kind(
        "inner_forward_first",
        "a submodule's forward run before its root's first forward",
        RuntimeError,
        ("Linear ('0') already ran forward as a root", "Sequential"),
        ("run the outermost sharded module's forward first",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "replaced_by_plain_tensor",
        "a sharded parameter replaced by a plain (full) tensor",
        AttributeError,
        ("'weight'",),
        ("DTensor",),
        "shard-runtime/tests/test_fully_shard_api.py",
    ),
    Kind(
        "missing_forward_method",
        "register_fsdp_forward_method with a method the module lacks",
        ValueError,
        ("FSDPLinear has no method 'generate'",),
        ("pass the name of a method its class defines",),
        "shard-runtime/tests/test_compat_fully_shard.py",
    ),
    # - FullyShardedDataParallel
    Kind(
        "wrapper_bad_strategy",
        "a sharding_strategy that is not a ShardingStrategy",
        TypeError,
        ("got 'FULL_SHARD'",),
        ("sharding_strategy must be a ShardingStrategy",),
        "shard-runtime/tests/test_wrapper_api.py",
    ),
    Kind(
        "wrapper_frozen_mix",
        "frozen and trainable parameters in one flat parameter",
        ValueError,
        ("frozen: bias", "trainable: weight"),
        ("pass use_orig_params=True", "Wrap them in separate units"),
        "shard-runtime/tests/test_wrapper_api.py",
    ),
    Kind(
        "wrapper_over_fully_shard",
        "FullyShardedDataParallel over a module already sharded by fully_shard",
        ValueError,
        ("submodule '0' (FSDPLinear) is already sharded by fully_shard",),
        ("shard a model with one front end",),
        "shard-runtime/tests/test_wrapper_api.py",
    ),
    Kind(
        "wrapper_group_and_mesh",
        "both process_group and device_mesh",
        ValueError,
        ("FullyShardedDataParallel",),
        ("pass either process_group or device_mesh, not both",),
    ),
    Kind(
        "wrapper_hybrid_plain_group",
        "a hybrid strategy given one process group",
        ValueError,
        ("HYBRID_SHARD",),
        ("(shard_group, replicate_group) tuple", "2-D device_mesh"),
    ),
    # - plugins, options
    Kind(
        "unknown_wrap_policy",
        "a wrap policy asked for by a name nobody registered",
        UnknownPluginNameError,
        ("no wrap policy is registered as 'module_clas'",),
        ("Did you mean 'module_class'?",),
        "shard-core/tests/test_registry.py",
        where="local",
    ),
    Kind(
        "wrong_policy_options",
        "a registered wrap policy given an option it does not take",
        WrapPlanError,
        ("wrap policy 'size' does not take the options {'min_params': 10}",),
        ("its options are: min_num_params=100000000",),
        "shard-core/tests/test_registry.py",
        where="local",
    ),
    Kind(
        "policy_raises",
        "a wrap policy whose wrap() raises",
        type(PluginCallError.wrapping(KeyError(), "")),
        ("wrap policy _RaisingPolicy() raised KeyError", "for module '1' (Linear)"),
        ("It was raised in your code", "test_bad_input_catalogue.py:"),
        "shard-core/tests/test_plugin_call_errors.py",
        where="local",
    ),
    Kind(
        "comm_hook_raises",
        "a comm hook that raises (FullyShardedDataParallel.register_comm_hook)",
        type(PluginCallError.wrapping(KeyError(), "")),
        ("_raising_comm_hook raised KeyError: 'oops in hook' for unit 'Sequential'",),
        ("It was raised in your code",),
        "shard-comms/tests/test_comm_hooks.py",
    ),
    Kind(
        "empty_mesh_dims",
        "DataParallelMeshDims with neither axis",
        ValueError,
        ("DataParallelMeshDims",),
        ("give shard=", "replicate="),
        where="local",
    ),
    # - checkpoints
    Kind(
        "load_other_model",
        "load of a checkpoint from a different model (other names)",
        CheckpointError,
        ("has no 'model.weight'", "closest: 'model.w'"),
        ("Load a checkpoint of this model", "strict=False"),
        _CKPT,
        where="local",
    ),
    Kind(
        "load_other_shapes",
        "load of a checkpoint from a different model (other shapes)",
        CheckpointError,
        ("'model.w' with shape (8, 4)", "expects (4, 4)"),
        ("load a checkpoint of this model",),
        _CKPT,
        where="local",
    ),
    Kind(
        "truncated_data_file",
        "a truncated checkpoint data file",
        CorruptCheckpointError,
        ("is corrupt", "__0_0.distcp (written by rank 0) has 100 bytes", "'model.w'"),
        ("restore it from a copy",),
        "shard-checkpoint/tests/test_integrity.py",
        where="local",
    ),
    Kind(
        "corrupt_metadata",
        "a corrupted (cut) .metadata file",
        CorruptCheckpointError,
        ("is corrupt", ".metadata (written by rank 0) has 40 bytes"),
        ("restore it from a copy",),
        "shard-checkpoint/tests/test_integrity.py",
        where="local",
    ),
    Kind(
        "corrupt_data_file",
        "a corrupted checkpoint data file (overwritten bytes)",
        CorruptCheckpointError,
        ("is corrupt", "__0_0.distcp (written by rank 0) does not match its checksum", "'model.w'"),
        ("restore it from a copy",),
        "shard-checkpoint/tests/test_integrity.py",
        where="local",
    ),
    Kind(
        "unwritable_directory",
        "an unwritable checkpoint directory (EACCES); the previous checkpoint loads",
        CheckpointError,
        ("Permission denied", "on rank 0"),
        ("cannot write to", "pass a checkpoint_id in a writable directory"),
        where="local",
    ),
    Kind(
        "parent_not_a_directory",
        "a checkpoint path under a file",
        CheckpointError,
        ("cannot save a checkpoint at", "Not a directory"),
        ("is not a directory: pass a directory path",),
        where="local",
    ),
    Kind(
        "disk_full",
        "a full disk (ENOSPC) while saving; the previous checkpoint loads",
        CheckpointError,
        ("No space left on device", "on rank 0", "the partial files were removed"),
        ("is full: free space there", "on another disk"),
        "shard-checkpoint/tests/test_failures.py",
        where="local",
    ),
    Kind(
        "checkpoint_id_is_a_file",
        "a checkpoint_id that is a file",
        CheckpointError,
        ("it is a file",),
        ("pass a directory path as checkpoint_id",),
        _CKPT,
        where="local",
    ),
    Kind(
        "directory_not_a_checkpoint",
        "a checkpoint_id that is a directory of other files",
        CheckpointError,
        ("the directory exists and is not a checkpoint",),
        ("choose another checkpoint_id or remove the directory",),
        _CKPT,
        where="local",
    ),
    Kind(
        "load_missing",
        "load from a path with no checkpoint",
        CheckpointError,
        ("no checkpoint at", "does not exist"),
        ("nothing",),
        _CKPT,
        where="local",
    ),
    Kind(
        "load_incomplete",
        "load of a checkpoint a failed save left incomplete",
        CheckpointError,
        ("is an incomplete checkpoint",),
        ("load the last complete checkpoint",),
        _CKPT,
        where="local",
    ),
]

_RANK_KINDS = [k for k in CATALOGUE if k.where == "ranks"]
_LOCAL_KINDS = [k for k in CATALOGUE if k.where == "local"]
_HYBRID_KINDS = [k for k in CATALOGUE if k.where == "ranks4"]


def _qualified(cls: type[BaseException]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check(kind: Kind, outcome: tuple[str, str]) -> None:
    raised, message = outcome
    assert raised == _qualified(kind.error), f"{kind.id}: raised {raised or 'nothing'}: {message}"
    for text in (*kind.names, *kind.fix):
        assert text in message, f"{kind.id}: {text!r} not in: {message}"


@pytest.fixture(scope="module")
def rank_outcomes(rank_pool: RankPool) -> list[dict[str, tuple[str, str]]]:
    """Every multi-rank scenario, on 2 ranks, in one run."""
    names = [k.id for k in _RANK_KINDS] + list(ALLOWED_SCENARIOS)
    return rank_pool.run(_run_rank_scenarios, 2, names)


def test_the_catalogue_counts_at_least_30_kinds() -> None:
    """Issue 12 asks for 30 kinds of bad input; every kind has a scenario and a unique id."""
    ids = [k.id for k in CATALOGUE]
    assert len(ids) == len(set(ids)) >= 30
    assert {k.id for k in _RANK_KINDS} == set(RANK_SCENARIOS)
    assert {k.id for k in _LOCAL_KINDS} == set(LOCAL_SCENARIOS)
    assert {k.id for k in _HYBRID_KINDS} == set(HYBRID_SCENARIOS)
    root = HERE.parents[1]
    for kind in CATALOGUE:
        if kind.covered:
            where = kind.covered if kind.covered.startswith("integration") else "packages/"
            path = root / kind.covered if where == kind.covered else root / where / kind.covered
            assert path.is_file(), f"{kind.id}: {kind.covered} does not exist"


@pytest.mark.parametrize("kind", _RANK_KINDS, ids=lambda k: k.id)
def test_bad_input_on_ranks(kind: Kind, rank_outcomes: list[dict[str, tuple[str, str]]]) -> None:
    """Every rank raises the kind's exception type, naming the culprit and the fix."""
    for outcome in rank_outcomes:
        _check(kind, outcome[kind.id])


@pytest.fixture(scope="module")
def hybrid_outcomes(rank_pool: RankPool) -> list[dict[str, tuple[str, str]]]:
    """The 2-D mesh scenarios, on 4 ranks, in one run."""
    return rank_pool.run(_run_rank_scenarios, 4, [k.id for k in _HYBRID_KINDS])


@pytest.mark.parametrize("kind", _HYBRID_KINDS, ids=lambda k: k.id)
def test_bad_input_on_a_2d_mesh(
    kind: Kind, hybrid_outcomes: list[dict[str, tuple[str, str]]]
) -> None:
    """All four ranks raise, though only rank 3's model differs."""
    for outcome in hybrid_outcomes:
        _check(kind, outcome[kind.id])
    messages = [outcome[kind.id][1] for outcome in hybrid_outcomes]
    assert "'0.weight' shape (8, 4)" in messages[3], messages[3]


@pytest.mark.parametrize("kind", _LOCAL_KINDS, ids=lambda k: k.id)
def test_bad_input_locally(kind: Kind, tmp_path: Path) -> None:
    """The kind's exception type, naming the culprit and the fix (the previous checkpoint loads)."""
    _check(kind, _outcome(lambda: LOCAL_SCENARIOS[kind.id](tmp_path)))


@pytest.mark.parametrize("name", list(ALLOWED_SCENARIOS))
def test_what_the_checks_let_through(
    name: str, rank_outcomes: list[dict[str, tuple[str, str]]]
) -> None:
    """No check refuses a correct program: these scenarios raise nothing on any rank."""
    for outcome in rank_outcomes:
        assert outcome[name] == ("", ""), outcome[name]


def test_model_mismatch_names_the_ranks_on_each_side(
    rank_outcomes: list[dict[str, tuple[str, str]]],
) -> None:
    """Both ranks raise the same message; it says which rank has which parameter."""
    rank0, rank1 = (o["shapes_differ"][1] for o in rank_outcomes)
    assert rank0 == rank1
    assert "rank 0 has parameter '0.weight' shape (4, 4) float32 requires_grad=True" in rank0
    assert "rank 1 has parameter '0.weight' shape (6, 4) float32 requires_grad=True" in rank0


def test_model_mismatch_message_groups_the_ranks() -> None:
    """With 4 ranks, the majority is one side, the first other rank's group the other."""
    same = ["unit '(root)'", "parameter 'w' shape (4,) float32 requires_grad=True"]
    other = ["unit '(root)'", "parameter 'w' shape (5,) float32 requires_grad=True"]
    third = ["unit '(root)'", "parameter 'v' shape (4,) float32 requires_grad=True"]
    described = [same, other, same, third]
    digests: list[tuple[int, ...]] = [(1,), (2,), (1,), (3,)]
    message = _fingerprint._message(described, digests, [0, 1, 2, 3], "fully_shard")
    assert message.startswith(
        "fully_shard: the ranks do not hold the same model: ranks 0, 2 have parameter 'w' "
        "shape (4,) float32 requires_grad=True, but rank 1 has parameter 'w' shape (5,) "
        "float32 requires_grad=True (the first difference, in unit order). rank 3 differs too."
    ), message


def _listing() -> str:
    """The catalogue as the module docstring lists it, one kind per line."""
    lines = []
    for number, kind in enumerate(CATALOGUE, 1):
        lines.append(f"{number:2}. {kind.what}\n")
        covered = f", also {kind.covered}" if kind.covered else ""
        lines.append(f"    {kind.error.__name__} [{kind.id}]{covered}\n")
    return "".join(lines)


def _docstring_listing(text: str) -> str:
    return text[text.index(_START) + len(_START) : text.index(_END)]


def test_the_generated_list_is_current() -> None:
    """The module docstring lists every kind of the table above, in order."""
    assert _docstring_listing(HERE.read_text()) == _listing(), (
        "run python integration_tests/test_bad_input_catalogue.py"
    )


if __name__ == "__main__":
    text = HERE.read_text()
    head, tail = text[: text.index(_START) + len(_START)], text[text.index(_END) :]
    HERE.write_text(head + _listing() + tail)
    sys.stdout.write(f"listed {len(CATALOGUE)} kinds in {HERE.name}\n")
