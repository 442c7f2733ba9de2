"""``FullyShardedDataParallel.summon_full_params``: full parameters between steps.

Each summoned unit all-gathers its flat shard into a full buffer of its own
(not the unit's unsharded buffer, which the next forward owns), shows the
original parameters as views of it and, with ``writeback``, copies this
rank's slice back into the shard on exit. See [Note: parameter names] in
``_wrapper.py`` for the names the parameters have inside.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from shard_comms import all_gather, all_reduce
from shard_runtime._flat_buffer_layout import FlatParamSpec
from shard_runtime._state import UnitState, get_state, states_in
from shard_runtime._unit import ShardedState, TrainingState, Unit
from shard_runtime._wrapper_unit_view import flat_layout_of

__all__ = ["FLAT_PARAM", "SummonMethods", "summon"]

FLAT_PARAM = "_flat_param"  # where a wrapper registers its unit's flat parameter


class SummonMethods:
    """Mixed into ``FullyShardedDataParallel``: ``summon_full_params`` and its flag.

    The summon code recognises a wrapper by this class, so it needs no import
    of the wrapper's module.
    """

    _in_summon: bool = False  # inside summon_full_params; see [Note: parameter names]

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Expose full, full-precision parameters inside the block; write changes back.

        Inside, the summoned wrappers' ``named_parameters()`` list the original
        parameters under their unwrapped names (``blocks.0.up.weight``), as
        ``nn.Parameter`` s of full shape that in-place edits change; with
        ``writeback`` each rank copies its slice back into its shard on exit
        (see [Note: parameter names]). ``recurse=False`` summons this wrapper's
        unit only. ``rank0_only`` gathers everywhere but only rank 0 sees full
        parameters (no ``writeback``: ``NotImplementedError``);
        ``offload_to_cpu`` keeps the full copies on the CPU (warned about
        without ``rank0_only``); ``with_grads`` (``use_orig_params=True`` only,
        else ``NotImplementedError``) also shows full gradients. Entering it
        again for a wrapper already inside is an ``AssertionError``, as in PyTorch.
        """
        with summon(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield


@contextlib.contextmanager
def summon(
    module: nn.Module,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    if rank0_only and writeback:
        raise NotImplementedError(
            "summon_full_params: writeback=True and rank0_only=True is not supported: the other "
            "ranks see no full parameters to write back; pass writeback=False"
        )
    if recurse:
        states = states_in([module])
    else:
        own = get_state(module)
        states = [own] if own is not None else []
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "summon_full_params: offload_to_cpu=True without rank0_only=True puts a full copy "
            "of the parameters in CPU memory on every rank (several per host); pass "
            "rank0_only=True unless every rank needs them",
            UserWarning,
            stacklevel=5,  # the user's ``with``: past two context-manager frames
        )
    for s in states:
        if s.unit.training_state is not TrainingState.IDLE:
            raise AssertionError(
                "summon_full_params: Cannot manually unshard parameters during forward/backward "
                f"(the unit {s.unit.label!r} is computing); call it between steps, outside the "
                "model's forward and backward"
            )
        owner = s.modules[0]
        if isinstance(owner, SummonMethods) and owner._in_summon:
            raise AssertionError(
                f"summon_full_params: the wrapper around {type(owner.module).__name__} is "
                "already inside summon_full_params; its parameters are full there already: "
                "use them without entering the context again"
            )
        layout = flat_layout_of(s)
        if with_grads and not (layout is not None and layout.use_orig_params):
            raise NotImplementedError(
                f"summon_full_params: with_grads=True with use_orig_params=False is not "
                f"supported: the unit {s.unit.label!r} was wrapped with use_orig_params=False; "
                "wrap with use_orig_params=True to see full gradients"
            )
    with contextlib.ExitStack() as stack:
        for s in states:
            stack.enter_context(_summon_unit(s, writeback, rank0_only, offload_to_cpu, with_grads))
        yield


@contextlib.contextmanager
def _summon_unit(
    state: UnitState, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> Iterator[None]:
    wrapper = state.modules[0]
    if not isinstance(wrapper, SummonMethods):
        with _summon_layout(state, writeback, rank0_only, offload_to_cpu, with_grads, None):
            yield
        return
    was_in_summon = wrapper._in_summon
    wrapper._in_summon = True
    try:
        with _summon_layout(state, writeback, rank0_only, offload_to_cpu, with_grads, wrapper):
            yield
    finally:
        wrapper._in_summon = was_in_summon


@contextlib.contextmanager
def _summon_layout(
    state: UnitState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
    wrapper: nn.Module | None,
) -> Iterator[None]:
    unit = state.unit
    layout = flat_layout_of(state)
    if layout is None or layout.is_empty:
        yield  # a fully_shard unit's parameters are not summoned
        return
    if unit.sharded_state is not ShardedState.SHARDED:
        unit.reshard()
    device = unit.compute_device
    shard = layout.shard.to(device)
    full = torch.empty(unit.shard_world * shard.numel(), dtype=shard.dtype, device=device)
    all_gather(full, shard, unit.shard_group, label=f"{unit.comm_label} summon").wait()
    full_grad: torch.Tensor | None = None
    had_grad: list[bool] = []
    if with_grads and _any_rank_has_grads(layout.specs, unit):
        had_grad = [spec.param.grad is not None for spec in layout.specs]
        local_grad = torch.zeros_like(shard)
        for spec, info in zip(layout.shard_specs(), layout.shard_meta.params, strict=True):
            if spec.param.grad is not None:
                local_grad.narrow(0, info.offset_in_range, info.numel_in_range).copy_(
                    spec.param.grad.reshape(-1)
                )
        full_grad = torch.empty_like(full)
        all_gather(
            full_grad, local_grad, unit.shard_group, label=f"{unit.comm_label} summon"
        ).wait()
    if rank0_only and dist.get_rank() != 0:
        yield  # this rank only took part in the gather
        return
    if offload_to_cpu:
        full = full.cpu()
        full_grad = full_grad.cpu() if full_grad is not None else None
    rank = unit.mesh.get_local_rank(unit.mesh.ndim - 1)
    n = shard.numel()
    # Inside, the originals stand in for the flat parameter (see [Note: parameter names]).
    with contextlib.ExitStack() as restore:
        flat = wrapper._parameters.pop(FLAT_PARAM, None) if wrapper is not None else None
        if wrapper is not None and flat is not None:
            restore.callback(wrapper._parameters.__setitem__, FLAT_PARAM, flat)
        restore.enter_context(layout.full_precision_views(full))
        if full_grad is not None:
            for spec, grad in zip(layout.specs, layout.full_views(full_grad), strict=True):
                spec.param.grad = grad
        try:
            yield
        finally:
            if writeback:
                with torch.no_grad():
                    layout.shard.copy_(full[rank * n : (rank + 1) * n])
            if full_grad is not None:
                for spec in layout.specs:
                    spec.param.grad = None
    if full_grad is not None:
        # Back on the shard views: restore each parameter's sharded gradient, and no
        # gradient where there was none (an optimizer treats zeros and None differently).
        layout.accumulate(
            full_grad[rank * n : (rank + 1) * n].to(unit.compute_device), None, zero_unused=False
        )
        for spec, had in zip(layout.specs, had_grad, strict=True):
            if not had:
                spec.param.grad = None


def _any_rank_has_grads(specs: list[FlatParamSpec], unit: Unit) -> bool:
    """Whether some rank of the unit holds a gradient; if none does, none is shown (as PyTorch)."""
    flag = torch.tensor(
        [float(any(spec.param.grad is not None for spec in specs))], device=unit.compute_device
    )
    all_reduce(flag, unit.shard_group, label=f"{unit.comm_label} summon").wait()
    return bool(flag.item())
