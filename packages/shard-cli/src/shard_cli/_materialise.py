"""Build a model with its parameters on the meta device, shard it, then give each shard values.

A model larger than one rank's memory cannot be built whole before it is
sharded. ``shard train --hf-config`` therefore builds it under
:func:`parameters_on_meta` (parameters are shapes only; buffers, small and
often computed in ``__init__``, are real), shards it, and then
:func:`materialise` gives every rank's shards storage and values, one unit
at a time.

[Note: initial values independent of the world size]
Two ranks must start from the weights one process starts from, or their
losses cannot match. Each module is initialised by its own function (for a
Hugging Face model its ``_init_weights``) on full-size tensors, with the
global generators seeded from ``(seed, the module's qualified name)`` alone;
each rank keeps its own slice of the result. Nothing depends on the world
size, on which unit a module is in, or on the order units are visited. A
parameter that two modules own (tied embeddings: ``lm_head.weight is
model.embed_tokens.weight``) is one tensor during its unit's pass, so every
owner's initialisation writes the same tensor, in the same order, as on the
unsharded model.

[Note: one unit at a time]
A unit is a module sharded by ``fully_shard`` together with its descendants
that no inner ``fully_shard`` claimed (the root unit: whatever is left). Its
pass swaps full-size tensors in for the unit's sharded parameters, runs the
initialisation of each of its modules in post-order (children before their
parent, as ``transformers`` does), copies each rank's slice into the shard
and puts the sharded parameters back. The full tensors of one unit are all
that exist beyond the shards, so the peak is one unit's full size, not the
model's. A model with no sharded module (one process, the reference) is one
unit and its parameters are the full tensors: nothing is copied. This
relies on a module's initialisation writing only parameters of its own
unit: its own, and its children's (``transformers``' convention); one that
wrote another unit's parameter would write a sharded tensor.

[Note: ties survive]
``nn.Module._apply`` (what ``to_empty`` runs) replaces a plain parameter
that changes device by a new ``Parameter`` per owning module, so a tied
pair would come out as two tensors; a sharded (DTensor) parameter is
swapped in place and stays one. The owners of each parameter are recorded
before and tied again after, so both kinds come out as they went in.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shard_runtime import FSDPModule

__all__ = [
    "ModuleInit",
    "hf_module_init",
    "materialise",
    "module_seed",
    "parameters_on_meta",
]

ModuleInit = Callable[[nn.Module, nn.Module], None]
"""Initialises ``module``'s own parameters in place: ``init(root, module)``."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with every parameter on the meta device and every buffer real.

    Buffers stay on the CPU because a model computes some of them in its
    constructor (rotary frequencies) and no initialisation function would
    recompute them; they are small. A parameter is created on the CPU by
    its module's constructor (``torch.empty``: memory is reserved, not
    touched) and moved to meta as it is registered, so the model never
    holds more than one real parameter at a time.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and type(param) is nn.Parameter:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    setattr(nn.Module, "register_parameter", register_on_meta)  # noqa: B010 (a method, patched)
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register)  # noqa: B010


def hf_module_init(root: nn.Module, module: nn.Module) -> None:
    """A ``transformers`` model's own initialisation of one module (``_init_weights``)."""
    init = getattr(root, "_init_weights", None)
    if not callable(init):
        raise ValueError(
            f"{type(root).__name__} has no _init_weights: it is not a transformers "
            "PreTrainedModel, so shard cannot initialise it after building it on the meta device"
        )
    init(module)


def module_seed(seed: int, name: str) -> int:
    """The generator seed for the module called ``name``: a stable hash of ``(seed, name)``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def materialise(
    model: nn.Module,
    *,
    device: torch.device,
    seed: int,
    init: ModuleInit,
    param_device: torch.device | None = None,
    seed_name: Callable[[str], str] | None = None,
) -> None:
    """Give ``model``'s meta tensors storage and values from ``init``, unit by unit.

    ``model`` is plain or sharded by ``fully_shard`` (every rank calls this
    with the same arguments; no collective runs). Meta tensors get storage
    on ``param_device`` (default ``device``; the CPU for offloaded shards),
    full tensors are initialised on ``device``, and real buffers move to
    ``device`` with their values. See [Note: initial values independent of
    the world size] and [Note: one unit at a time]. ``seed_name`` maps a
    module's qualified name to the name its generator is seeded by (default:
    the name itself).

    Raises:
        ValueError: a tensor is still on the meta device afterwards (named),
            or a sharded parameter's slice does not fit its shard.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    with torch.no_grad():
        home = param_device or device
        model._apply(  # type: ignore[no-untyped-call]
            lambda t: torch.empty_like(t, device=home) if t.is_meta else t.to(device)
        )
        # See [Note: ties survive]: _apply gives each owner of a plain parameter its own.
        for (module, name), *others in owners.values():
            for other, other_name in others:
                other._parameters[other_name] = module._parameters[name]
        names = {id(m): name for name, m in model.named_modules()}
        for unit in _units(model):
            _initialise_unit(
                model, unit, names, device=device, seed=seed, init=init, seed_name=seed_name
            )
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(
            f"tensors still on the meta device after initialisation: {', '.join(left)}; "
            "the model's initialisation must give every parameter and buffer a value"
        )


def _units(model: nn.Module) -> list[list[nn.Module]]:
    """The modules of each unit, each list in post-order; see [Note: one unit at a time]."""
    units: dict[int, list[nn.Module]] = {}
    seen: set[int] = set()

    def visit(module: nn.Module, unit: int) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, FSDPModule):
            unit = id(module)
        for child in module.children():
            visit(child, unit)
        units.setdefault(unit, []).append(module)

    visit(model, id(model))
    return list(units.values())


def _initialise_unit(
    root: nn.Module,
    modules: list[nn.Module],
    names: dict[int, str],
    *,
    device: torch.device,
    seed: int,
    init: ModuleInit,
    seed_name: Callable[[str], str] | None,
) -> None:
    """One unit's pass: full tensors in, initialise each module, slices out, shards back."""
    full: dict[int, nn.Parameter] = {}
    sharded: dict[int, DTensor] = {}
    fqns: dict[int, str] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in modules:
        for name, registered in module._parameters.items():
            param: torch.Tensor | None = registered
            if registered is None or not isinstance(param, DTensor):
                continue
            if id(param) not in full:
                tensor = torch.empty(param.shape, dtype=param.dtype, device=device)
                full[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
                sharded[id(param)] = param
                fqns[id(param)] = f"{names[id(module)]}.{name}".lstrip(".")
            swapped.append((module, name, registered))
            module._parameters[name] = full[id(param)]
    try:
        devices = [device] if device.type != "cpu" else []
        for module in modules:
            with torch.random.fork_rng(devices=devices, device_type=device.type):
                name = names[id(module)]
                torch.manual_seed(module_seed(seed, seed_name(name) if seed_name else name))
                init(root, module)
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
    for key, param in sharded.items():
        local = param.to_local()
        whole = full.pop(key).detach()  # dropped once its slice is copied
        slices = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
        mine = slices.to_local()
        if mine.shape != local.shape:
            raise ValueError(
                f"parameter {fqns[key]!r}: the slice of the full "
                f"{tuple(param.shape)} tensor for this rank is {tuple(mine.shape)}, but its shard "
                f"is {tuple(local.shape)}; shard train initialises only dim-0 (or replicated) "
                "shards of the parameter's full shape"
            )
        local.copy_(mine)
