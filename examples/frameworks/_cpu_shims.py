"""Framework-side and torch-side shims that let the examples run on a CPU with gloo.

Nothing here is shard: each shim works around a framework's own CPU limit
and would be needed with PyTorch's ``fully_shard`` too. Shard's code never
does any of this.

- accelerate picks its FSDP path only for accelerators (CUDA, XPU, NPU, ...);
  on CPU ranks it falls back to DDP even when given a
  ``FullyShardedDataParallelPlugin``. :func:`force_accelerate_fsdp` sets the
  shared ``PartialState`` and ``AcceleratorState`` to FSDP once the
  ``Accelerator`` is built, so ``prepare`` takes the ``fully_shard`` path it
  takes on GPUs.
- torchtitan imports triton at import time (``models/moe/kernels.py``, its
  MoE token-permutation kernels) and triton, a GPU compiler, is not installed
  on CPU machines. :func:`stub_torchtitan_moe_kernels` registers that one
  module in ``sys.modules`` with its one public function raising, so the
  import succeeds; the dense llama3 model never calls it. (A stub ``triton``
  instead would make torch itself believe triton is installed.)
- torchtitan falls back to ``device_type = "cuda"`` when no accelerator is
  found (``tools/utils.py``) and its modules bind that name at import time,
  so ``ParallelDims.build_mesh`` asks for a CUDA mesh on a CPU machine.
  :func:`torchtitan_on_cpu` sets ``device_type``/``device_module`` to the CPU
  in every torchtitan module imported so far.
- PyTorch's FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM(1/factor)``
  once a gradient divide factor other than the world size is set (torchtitan
  sets 1.0: it scales the loss by the global token count itself), and gloo
  has no PREMUL_SUM. :func:`gloo_sum_reduction` turns on PyTorch's own
  ``set_force_sum_reduction_for_comms(True)`` on PyTorch's FSDP modules (not
  shard's, which reduce on gloo as they are): reduce with SUM and divide
  locally, by 1.0 here, the same arithmetic.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


def force_accelerate_fsdp(accelerator: Any, plugin: Any) -> None:
    """Make ``accelerator`` prepare models with ``plugin`` (FSDP) on CPU ranks, not with DDP."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    # Every AcceleratorState() copies PartialState's fields over its own: set both.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def stub_torchtitan_moe_kernels() -> None:
    """Stand in for ``torchtitan.models.moe.kernels`` (triton) unless triton is installed."""
    if importlib.util.find_spec("triton") is not None:
        return
    name = "torchtitan.models.moe.kernels"

    def generate_permute_indices(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} needs triton (a GPU); this CPU run stubbed it out")

    stub = types.ModuleType(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    vars(stub).update(generate_permute_indices=generate_permute_indices)
    sys.modules[name] = stub


def torchtitan_on_cpu() -> None:
    """Without a GPU, point torchtitan's ``device_type``/``device_module`` at the CPU."""
    import torch

    if torch.cuda.is_available():
        return
    for module_name, module in list(sys.modules.items()):
        if module_name.partition(".")[0] != "torchtitan" or module is None:
            continue
        if vars(module).get("device_type") == "cuda":
            vars(module).update(device_type="cpu", device_module=torch.cpu)


def gloo_sum_reduction(model: Any) -> None:
    """On gloo, make PyTorch's FSDP2 modules reduce with SUM instead of PREMUL_SUM."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):  # PyTorch's own class, whatever the public name says
            module.set_force_sum_reduction_for_comms(True)
