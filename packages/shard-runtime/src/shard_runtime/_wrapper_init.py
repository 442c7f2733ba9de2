"""What ``FullyShardedDataParallel.__init__`` does to a module before flattening it.

Four steps, each a pure function the wrapper calls in this order:
:func:`resolve_ignored` (which modules and parameters stay whole),
:func:`materialize_module` (meta-device modules get real storage),
:func:`move_to_device` (everything on the compute device) and, with
``sync_module_states=True``, :func:`sync_module_states` (every rank starts
from the same values). They validate their input the way PyTorch's FSDP1
does, with messages that name the module or parameter and the fix.

Every walk over the module tree is breadth-first from the root and stops at
modules that are already sharded (an inner ``FullyShardedDataParallel`` or a
``fully_shard`` module: their unit owns their tensors) and at ignored modules.

[Note: Meta materialisation keeps ties]
``nn.Module.to_empty`` replaces each meta parameter by a new one, so a
parameter shared by two modules (tied embedding and output weights) ends up
as two unrelated parameters when each module is emptied on its own. Without
``param_init_fn`` we empty the meta tensors ourselves, remembering what each
one became, so every owner of a shared tensor gets the same new tensor. Each
module that owns a meta tensor no earlier module owned then runs its
``reset_parameters()``; a module whose meta tensors are all shared with an
earlier module keeps the values that module gave them, as eager construction
followed by tying would.

A ``param_init_fn`` runs on one module at a time, and the one accelerate and
transformers pass (``to_empty(device=..., recurse=False)``) unties such a
parameter the same way. PyTorch's FSDP1 keeps what it is given: the tied
weights train as two parameters, and with ``sync_module_states`` (rank 0
loaded eagerly, the others on meta) the ranks no longer hold the same
parameters, so the broadcast fails or hangs (pytorch/pytorch#143181;
accelerate re-ties after FSDP's init since huggingface/accelerate#3154). So
before calling ``param_init_fn`` we note which slots share a meta tensor,
and afterwards point every slot of a group that ``param_init_fn`` left apart
at the first owner's new tensor (breadth-first order; its values win, as
with tying after eager construction), where shape and dtype still agree
(``_meta_ties.py``, which shard-checkpoint's load into meta tensors uses too).

[Note: One broadcast per dtype]
``sync_module_states`` copies rank ``src``'s states into one flat buffer per
(device, dtype), broadcasts each buffer once and copies the pieces back, so a
model costs one collective per dtype instead of one per tensor. Unlike
PyTorch's wrapper it accepts CPU tensors (gloo broadcasts them).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shard_comms import broadcast, get_device_handle
from shard_core.errors import DeviceUnavailableError, LayoutError
from shard_runtime._fingerprint import check_same_tensors
from shard_runtime._meta_ties import meta_tie_groups, retie
from shard_runtime._module_tree import modules_breadth_first
from shard_runtime._state import get_state

__all__ = [
    "materialize_module",
    "move_to_device",
    "requested_device",
    "resolve_ignored",
    "sync_module_states",
]

_WHO = "FullyShardedDataParallel"
# A wrapper from another library (PyTorch's, FairScale's): recognised by its class name,
# since product code never imports torch.distributed.fsdp. See _is_sharded.
_FOREIGN_WRAPPER_NAME = "FullyShardedDataParallel"
_MAX_LISTED = 3  # culprits named in one message before "and N more"


# ---------------------------------------------------------------------- ignored states


def resolve_ignored(
    root: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Module] | Iterable[nn.Parameter] | None,
) -> tuple[frozenset[nn.Module], frozenset[nn.Parameter]]:
    """The modules and parameters the wrapper of ``root`` leaves whole.

    Args:
        root: the module being wrapped.
        ignored_modules: modules whose subtrees are not sharded.
        ignored_states: modules, or parameters, not sharded (one kind only).
            At most one of ``ignored_modules`` and ``ignored_states`` is given.

    Returns:
        (the ignored modules with all their submodules, the ignored parameters
        with all parameters of the ignored modules). Already-sharded modules
        inside an ignored module, and their subtrees, are left out.

    Raises:
        ValueError: both arguments given; an entry of the wrong kind
            (parameters in ``ignored_modules``, a mix of modules and parameters
            in ``ignored_states``, anything else); an already-sharded module
            listed; ``root`` itself ignored.
        TypeError: an argument that is not an iterable (a single module or
            parameter, say).
    """
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            f"{_WHO}: Cannot pass both ignored_modules and ignored_states at the same time; "
            "pass everything as ignored_states (it takes modules, or parameters)"
        )
    names = _Names(root)
    if ignored_states is not None:
        entries = _as_list(ignored_states, "ignored_states")
        _check_kinds(entries, "ignored_states", names, allow_params=True)
    else:
        entries = _as_list(ignored_modules, "ignored_modules")
        _check_kinds(entries, "ignored_modules", names, allow_params=False)
    argument = "ignored_states" if ignored_states is not None else "ignored_modules"
    listed_modules = [e for e in entries if isinstance(e, nn.Module)]
    listed_params = [e for e in entries if isinstance(e, nn.Parameter)]
    for index, module in enumerate(entries):
        if isinstance(module, nn.Module) and _is_sharded(module):
            raise ValueError(
                f"{_WHO}: {argument} should not include FSDP modules: {argument}[{index}] "
                f"is {names.module(module)}, which is already sharded; list the modules it "
                "wraps that should stay whole when wrapping it, or leave it out"
            )
    modules: dict[int, nn.Module] = {}
    for top in listed_modules:
        for module in modules_breadth_first(top, _is_sharded):
            modules.setdefault(id(module), module)
    if id(root) in modules:
        raise ValueError(
            f"{_WHO}: the module being wrapped, {type(root).__name__}, is itself ignored by "
            f"{argument}, which would leave nothing to shard; do not wrap it, or ignore only "
            "some of its submodules"
        )
    params: dict[int, nn.Parameter] = {id(p): p for p in listed_params}
    for module in modules.values():
        for param in module.parameters(recurse=False):
            params.setdefault(id(param), param)
    return frozenset(modules.values()), frozenset(params.values())


def _as_list(value: object, argument: str) -> list[object]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor) or (
        isinstance(value, nn.Module) and not isinstance(value, Iterable)
    ):
        raise TypeError(
            f"{_WHO}: {argument} takes an iterable, got a single {type(value).__name__}; "
            f"wrap it in a list: {argument}=[...]"
        )
    if not isinstance(value, Iterable):
        kinds = "modules or of parameters" if argument == "ignored_states" else "modules"
        raise TypeError(
            f"{_WHO}: {argument} takes an iterable of {kinds}, got {type(value).__name__}"
        )
    return list(value)


def _check_kinds(
    entries: list[object], argument: str, names: _Names, *, allow_params: bool
) -> None:
    for index, entry in enumerate(entries):
        if isinstance(entry, nn.Parameter):
            if not allow_params:
                raise ValueError(
                    f"{_WHO}: ignored_modules expects nn.Module entries, but "
                    f"ignored_modules[{index}] is the parameter {names.param(entry)}; pass "
                    "parameters as ignored_states=[...] instead"
                )
        elif not isinstance(entry, nn.Module):
            kinds = "an nn.Module or an nn.Parameter" if allow_params else "an nn.Module"
            raise ValueError(
                f"{_WHO}: {argument}[{index}] is a {type(entry).__name__}, not {kinds}; "
                "buffers and plain tensors are never sharded, so leave them out"
            )
    if allow_params:
        first_module = next((i for i, e in enumerate(entries) if isinstance(e, nn.Module)), None)
        first_param = next((i for i, e in enumerate(entries) if isinstance(e, nn.Parameter)), None)
        if first_module is not None and first_param is not None:
            module = entries[first_module]
            param = entries[first_param]
            assert isinstance(module, nn.Module)
            assert isinstance(param, nn.Parameter)
            raise ValueError(
                f"{_WHO}: ignored_states expects all nn.Parameter or all nn.Module entries, "
                f"but ignored_states[{first_module}] is the module {names.module(module)} and "
                f"ignored_states[{first_param}] the parameter {names.param(param)}; pass only "
                "modules, or only parameters (a module's are module.parameters())"
            )


# ---------------------------------------------------------------------- meta device


def materialize_module(
    module: nn.Module,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    ignored_modules: frozenset[nn.Module],
) -> None:
    """Give every meta-device parameter and buffer of ``module`` real storage and values.

    Without ``param_init_fn``, each meta tensor is replaced by an empty one on
    ``device`` (tensors shared by several modules stay shared) and
    ``reset_parameters()`` runs on each module owning one. See
    [Note: Meta materialisation keeps ties]. With ``param_init_fn``, it is
    called on each module whose subtree still holds a meta tensor when its
    turn comes, breadth-first from ``module`` (the root first), and the
    tensors shared on meta that it left apart are tied again. Modules with
    nothing on meta, ignored modules and already-sharded modules are left
    alone.

    Raises:
        ValueError: ``param_init_fn`` is not callable; a module owning meta
            tensors has no ``reset_parameters()`` (and no ``param_init_fn`` was
            given); ``param_init_fn`` left tensors on meta.
    """
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(
            f"{_WHO}: param_init_fn must be a callable taking a module (it is called on each "
            f"module left on the meta device), got {type(param_init_fn).__name__}"
        )

    def stop(child: nn.Module) -> bool:
        return child in ignored_modules or _is_sharded(child)

    order = modules_breadth_first(module, stop)
    if not any(t.is_meta for m in order for t in _own_states(m)):
        return
    if param_init_fn is None:
        _reset_meta_modules(module, order, device)
        return
    ties = meta_tie_groups(order)
    for target in order:
        if any(t.is_meta for m in modules_breadth_first(target, stop) for t in _own_states(m)):
            param_init_fn(target)
    retie(ties)
    names = _Names(module)
    left = [
        repr(name)
        for m in modules_breadth_first(module, stop)
        for name, t in _named_own_states(m, names)
        if t.is_meta
    ]
    if left:
        raise ValueError(
            f"{_WHO}: param_init_fn left {_listing(left)} on the meta device; it must give each "
            "module it is called on real storage and values, e.g. "
            "module.to_empty(device=..., recurse=False) followed by module.reset_parameters()"
        )


def _reset_meta_modules(root: nn.Module, order: list[nn.Module], device: torch.device) -> None:
    """See [Note: Meta materialisation keeps ties]."""
    names = _Names(root)
    seen: set[int] = set()
    to_reset: list[nn.Module] = []
    missing: list[str] = []
    for m in order:
        fresh: list[str] = []
        for name, t in _named_own_states(m, names):
            if t.is_meta and id(t) not in seen:
                seen.add(id(t))
                fresh.append(name)
        if not fresh:
            continue
        if callable(getattr(m, "reset_parameters", None)):
            to_reset.append(m)
        else:
            missing.append(f"{names.module(m)} ({', '.join(fresh)})")
    if missing:
        raise ValueError(
            f"{_WHO}: cannot initialise the meta-device states of {_listing(missing)}: no "
            "reset_parameters() method; pass param_init_fn=<a function that initialises one "
            "module in place>, or give these modules a reset_parameters() method"
        )
    # old id -> (old, new); the old tensor is kept so that its id is not reused.
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def empty(old: torch.Tensor) -> torch.Tensor:
        entry = made.get(id(old))
        if entry is None:
            new = torch.empty_like(old, device=device)
            if isinstance(old, nn.Parameter):
                new = nn.Parameter(new, requires_grad=old.requires_grad)
                new.__dict__.update(old.__dict__)
            entry = made[id(old)] = (old, new)
        return entry[1]

    for m in order:
        for key, param in m._parameters.items():
            if param is not None and param.is_meta:
                new_param = empty(param)
                assert isinstance(new_param, nn.Parameter)
                m._parameters[key] = new_param
        for key, buf in m._buffers.items():
            if buf is not None and buf.is_meta:
                m._buffers[key] = empty(buf)
    with torch.no_grad():
        for m in to_reset:
            m.reset_parameters()  # type: ignore[operator]


# ---------------------------------------------------------------------- devices


def move_to_device(
    module: nn.Module,
    device_id: int | torch.device | None,
    ignored_params: frozenset[nn.Parameter],
    *,
    ignored_modules: Collection[nn.Module] = frozenset(),
) -> torch.device:
    """Move ``module``'s parameters and buffers to the compute device; return that device.

    The compute device is ``device_id``'s device: an int is an index of the
    current accelerator (``cuda:<id>`` where CUDA is present), a
    ``torch.device`` without index the accelerator's current device. With
    ``device_id=None`` it is the device the parameters are on when that is an
    accelerator, else the current accelerator device, or the CPU on a machine
    without one. Parameters and buffers on the CPU move there in place
    (parameter identities are kept); ignored parameters, the tensors of
    ``ignored_modules`` and of already-sharded modules, and meta tensors stay
    where they are.

    Raises:
        DeviceUnavailableError: ``device_id`` names a device this machine does
            not have.
        LayoutError: the tensors are on several devices (with ``device_id``:
            on an accelerator device other than it); the message names two.
        TypeError: ``device_id`` is not an int, a ``torch.device`` or ``None``.
    """
    target = None if device_id is None else _resolve_device(device_id)
    names = _Names(module)
    states = [
        (name, t)
        for m in modules_breadth_first(module, lambda c: c in ignored_modules or _is_sharded(c))
        for name, t in _named_own_states(m, names)
        if not t.is_meta and not (isinstance(t, nn.Parameter) and t in ignored_params)
    ]
    states = _unique(states)
    first_on: dict[torch.device, str] = {}
    for name, t in states:
        first_on.setdefault(t.device, name)
    cpu = torch.device("cpu")
    if target is None:
        if len(first_on) > 1:
            (a, a_dev), (b, b_dev) = [(n, d) for d, n in first_on.items()][:2]
            accelerator = next((d for d in first_on if d.type != "cpu"), None)
            fix = "move the module to one device first"
            if accelerator is not None and len(first_on) == 2:
                fix = f"pass device_id={accelerator} to move the CPU ones there, or {fix}"
            raise LayoutError(
                f"{_WHO}: the module's parameters and buffers are on several devices: {a!r} on "
                f"{a_dev}, {b!r} on {b_dev}; {fix}"
            )
        on = next(iter(first_on), cpu)
        target = on if on.type != "cpu" else get_device_handle().current_device()
    else:
        for dev, name in first_on.items():
            if dev.type != "cpu" and dev != target:
                raise LayoutError(
                    f"{_WHO}: {name!r} is on {dev} but device_id is {target}; move it to "
                    f"{target} first, or pass device_id={dev}"
                )
    if target.type == "cpu":
        return cpu
    with torch.no_grad():
        for _, t in states:
            if t.device == cpu:
                t.data = t.data.to(target)
                if t.grad is not None:
                    t.grad = t.grad.to(target)
    return target


def requested_device(device_id: object) -> torch.device:
    """The device ``device_id`` asks for; ``None``: the current device of shard's device handle.

    An int is an index on the machine's accelerator (``torch.accelerator``);
    on a machine without one ``None`` is the CPU.

    Raises:
        DeviceUnavailableError: ``device_id`` names a device this machine does
            not have.
        TypeError: ``device_id`` is not an int, a ``torch.device`` or ``None``.
    """
    if device_id is None:
        return get_device_handle().current_device()
    return _resolve_device(device_id)


def _resolve_device(device_id: object) -> torch.device:
    accelerator = torch.accelerator.current_accelerator()
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"{_WHO}: device_id must be an int (an accelerator index), a torch.device or None, "
            f"got {type(device_id).__name__}"
        )
    if isinstance(device_id, str):  # torch.device(...) accepts it, and so does PyTorch's FSDP
        device_id = torch.device(device_id)
    if isinstance(device_id, int):
        if accelerator is None:
            raise DeviceUnavailableError(
                f"{_WHO}: device_id={device_id} is an accelerator index, but torch sees no "
                "accelerator (CUDA or other) on this machine; pass device_id=None or "
                "torch.device('cpu') to run on the CPU"
            )
        device = torch.device(accelerator.type, device_id)
    else:
        device = device_id
    if device.type == "cpu":
        return torch.device("cpu")
    if accelerator is None or device.type != accelerator.type:
        have = "no accelerator" if accelerator is None else f"only {accelerator.type} devices"
        raise DeviceUnavailableError(
            f"{_WHO}: device_id={device} is not available: torch sees {have} on this machine; "
            "pass a device that exists, or None to use the current one"
        )
    count = torch.accelerator.device_count()
    index: int | None = device.index  # None at run time for "cuda" (torch's stub says int)
    if index is None:
        return torch.device(device.type, torch.accelerator.current_device_index())
    if not 0 <= index < count:
        raise DeviceUnavailableError(
            f"{_WHO}: device_id={device} does not exist: this machine has {count} "
            f"{device.type} device(s), indices 0 to {count - 1}"
        )
    return device


# ---------------------------------------------------------------------- sync


def sync_module_states(
    module: nn.Module,
    group: dist.ProcessGroup,
    ignored_params: frozenset[nn.Parameter],
    *,
    src: int = 0,
    ignored_modules: Collection[nn.Module] = frozenset(),
    fingerprint_groups: Sequence[dist.ProcessGroup] | None = None,
) -> None:
    """Overwrite every rank's parameters and buffers with those of rank ``src``, in place.

    ``src`` is a rank within ``group``. Ignored parameters, the tensors of
    ``ignored_modules`` and of already-sharded modules are left alone. One
    broadcast per dtype; CPU tensors work. See [Note: One broadcast per dtype].
    First the ranks of ``fingerprint_groups`` (``None``: ``group``; a mesh's
    axis groups, shard axis first, on the first of several calls; ``[]``:
    none) check that they hold the same tensors (see [Note: model
    fingerprints] in ``_fingerprint.py``).

    Raises:
        ValueError: ``src`` is not a rank of ``group``; a tensor is on meta.
    """
    size = group.size()
    if not 0 <= src < size:
        raise ValueError(
            f"{_WHO}: sync_module_states from src={src}, but the process group has {size} "
            f"rank(s); src is a rank within the group, 0 to {size - 1}"
        )
    names = _Names(module)
    states = _unique(
        [
            (name, t)
            for m in modules_breadth_first(module, lambda c: c in ignored_modules or _is_sharded(c))
            for name, t in _named_own_states(m, names)
            if not (isinstance(t, nn.Parameter) and t in ignored_params)
        ]
    )
    on_meta = [repr(name) for name, t in states if t.is_meta]
    if on_meta:
        raise ValueError(
            f"{_WHO}: cannot sync_module_states: {_listing(on_meta)} on the meta device; "
            "materialise the module first (param_init_fn, or to_empty and reset_parameters)"
        )
    if size == 1:
        return
    # See [Note: model fingerprints] in _fingerprint.py: differing models would
    # otherwise meet in broadcasts of different sizes.
    check_same_tensors(
        states,
        [group] if fingerprint_groups is None else fingerprint_groups,
        f"{_WHO}(sync_module_states=True)",
    )
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, t in states:
        if t.numel() > 0:
            buckets.setdefault((t.device, t.dtype), []).append(t.detach())
    is_src = group.rank() == src
    with torch.no_grad():
        for (device, dtype), tensors in buckets.items():
            if is_src:
                flat = torch.cat([t.reshape(-1) for t in tensors])
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
            broadcast(flat, src=src, group=group, label="sync_module_states")
            if not is_src:
                pieces = torch.split_with_sizes(flat, [t.numel() for t in tensors])
                for t, piece in zip(tensors, pieces, strict=True):
                    t.copy_(piece.view(t.shape))


# ---------------------------------------------------------------------- helpers


def _is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is already sharded: by shard (either front end) or another library.

    Both of shard's front ends leave their hook state on the module they
    manage, so shard's own wrapper is known by that, not by name; a foreign
    wrapper is known by its class name only.
    """
    return get_state(module) is not None or any(
        cls.__name__ == _FOREIGN_WRAPPER_NAME for cls in type(module).__mro__
    )


def _own_states(module: nn.Module) -> Iterator[torch.Tensor]:
    for param in module._parameters.values():
        if param is not None:
            yield param
    for buf in module._buffers.values():
        if buf is not None:
            yield buf


def _named_own_states(module: nn.Module, names: _Names) -> Iterator[tuple[str, torch.Tensor]]:
    prefix = names.prefix(module)
    for key, param in module._parameters.items():
        if param is not None:
            yield prefix + key, param
    for key, buf in module._buffers.items():
        if buf is not None:
            yield prefix + key, buf


def _unique(states: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in states:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _listing(names: list[str]) -> str:
    """``a, b, c and 2 more``: the first few of ``names`` (already formatted) and a count."""
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return f"{shown} and {more} more" if more > 0 else shown


class _Names:
    """Qualified names of a root's modules and parameters, for messages."""

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        # The first name of a module or parameter reachable under several names.
        self._modules: dict[int, str] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            self._modules.setdefault(id(module), name)
        self._params: dict[int, str] = {}
        for name, param in root.named_parameters(remove_duplicate=False):
            self._params.setdefault(id(param), name)

    def prefix(self, module: nn.Module) -> str:
        name = self._modules.get(id(module), "")
        return f"{name}." if name else ""

    def module(self, module: nn.Module) -> str:
        name = self._modules.get(id(module))
        if name is None:
            return f"{type(module).__name__} (not a submodule of {type(self._root).__name__})"
        return f"{type(module).__name__} ({name!r})" if name else type(module).__name__

    def param(self, param: nn.Parameter) -> str:
        name = self._params.get(id(param))
        if name is None:
            return f"of shape {tuple(param.shape)} (not in {type(self._root).__name__})"
        return repr(name)
