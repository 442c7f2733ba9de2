"""Running a configuration under one library, and under both on the ranks of a pool.

[Note: One rank function for both libraries]
:func:`compare_on_rank` runs PyTorch's FSDP and then shard inside the same
call on every rank, each from ``torch.manual_seed(config.seed)``, and
compares the two traces right there: the pool round trip (pickling the
task, waking every rank) is paid once per configuration, and no tensor
travels back, only an :class:`Outcome` of strings. The two runs share the
rank's process group and its cached device meshes (building a 2-D mesh
creates gloo subgroups, which are slow to create and never freed, so a
fuzzing session that builds one per configuration would pile them up).

The user code below is written once against ``fsdp_namespace(impl)``: the
differential principle is that nothing but the import differs. The only
exception is the call that applies FSDP1's own clipping
(``model.clip_grad_norm_``) versus ``torch.nn.utils.clip_grad_norm_`` on
FSDP2's DTensor gradients, which is a front-end difference, the same under
both libraries.

[Note: the wrapper's offload]
PyTorch's FSDP1 ``CPUOffload(offload_params=True)`` needs an accelerator: on
a CPU-only host it fails in its first forward. shard's works there, and
offloading must not change a single value (the optimizer updates the same
fp32 shards, on the CPU). So ``Config.offload`` with the wrapper offloads
under shard only and compares with PyTorch's run without offload: the
tester then covers offload with ``no_sync`` accumulation, mixed precision
and clipping, against PyTorch's numbers.

[Note: resuming]
``Config.resume`` crosses checkpointing with every other dimension the way a
restarted job meets it: at the start of step ``resume_at`` the run takes
``get_state_dict(model, optim)`` (PyTorch's
``torch.distributed.checkpoint.state_dict``, shard's ``shard_checkpoint``:
the same names, only the import differs), builds a new sharded model from
another seed (so that a value the load misses shows in the next step's
loss) and a new optimizer without state, replays the ``requires_grad_``
toggles of the steps before, and calls ``set_state_dict``. ``"native"``
saves and loads with the front end's own methods instead, as Lightning and
accelerate do (``state_dict``/``load_state_dict`` of the model and the
optimizer; the wrapper's under ``SHARDED_STATE_DICT`` with
``optim_state_dict``/``optim_state_dict_to_load``). The old model
and optimizer are dropped. Both libraries must then train on exactly as
before; the state dicts' keys are compared too (``Snapshot.state_keys``).
No file is written: the state dicts are what DCP would save, and DCP's own
round trip is shard-checkpoint's tests' business. ``"in-place"`` loads the
front end's own state dicts, taken before the step's evaluation, back into
the same model and optimizer after it instead (a rollback, or a checkpoint
loaded mid-run): the values stay, but the load must go through whatever the
evaluation left gathered and leave training as it was.

[Note: meta initialisation]
``Config.init="meta"`` starts the run the way fine-tuning jobs load a
pretrained model that no rank could hold whole: every rank builds the model
from the seed (the "pretrained" weights; only rank 0 keeps their state
dict), then builds it again on the meta device, freezes and shards that one,
gives it memory without values (``fully_shard``: ``to_empty`` on the root;
the wrapper: a ``param_init_fn`` calling ``to_empty(recurse=False)``, as
accelerate and transformers pass it), and loads rank 0's full state dict
with ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``.
A value the load misses, a tied weight ``to_empty`` unties, a frozen flag or
a dtype the meta path loses shows in the first step. Resuming builds the
fresh model the same way.

[Note: compiled blocks]
``Config.compile`` compiles every block in place with ``aot_eager``: Dynamo
traces the block's forward (the parameters the unit swaps in and out become
graph inputs, its hooks stay eager) and AOTAutograd builds the joint graph
of forward and backward, but the kernels are eager ATen ones, so compiled
runs compare bitwise as eager ones do and no C++ compiler is needed (CI has
none for Inductor). What it finds is the engine meeting Dynamo: a parameter
object, a storage or a ``requires_grad`` flag the graph's guards or inputs
see differently from PyTorch's, a recompile or a silent fallback. Each run
starts from ``torch._dynamo.reset()``: the pool's ranks outlive
configurations, and a graph cached by the previous one would hide a
recompile. ``fully_shard`` compiles after the checkpoint wrapper and before
sharding (torchtitan's order), the wrapper before wrapping (the wrapper then
adds its checkpoint wrapper around the unit).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
import traceback
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shard_testing.compat import Impl, fsdp_namespace
from shard_testing.differential._compare import Outcome, Snapshot, Trace, compare_traces
from shard_testing.differential._config import Config, ignored_names, side_branch_runs
from shard_testing.differential._models import Block, Net, batch_of

if TYPE_CHECKING:
    from shard_testing import RankPool

__all__ = ["compare_on_rank", "run_config", "run_impl"]

SGD_LR = 0.1
ADAMW_LR = 0.01
_RESUME_SEED = 1000
"""Added to the configuration's seed for the model a resumed run loads into."""
_EVAL_MICRO = 99
"""``batch_of``'s micro-batch index of the validation batch (no training batch has it)."""
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

# (id of the default process group, mesh shape) -> mesh; see [Note: One rank function ...].
_MESHES: dict[tuple[int, tuple[int, ...]], DeviceMesh] = {}


def run_config(
    pool: RankPool, config: Config, *, bitwise: bool = False, timeout: float | None = None
) -> list[Outcome]:
    """Run ``config`` under both libraries on ``config.world_size`` ranks of ``pool``.

    Returns each rank's :class:`Outcome`. Raises what ``pool.run`` raises
    (``RankFailure`` when a rank crashed or hung in a collective).
    ``bitwise``: see :func:`compare_on_rank`.
    """
    return pool.run(compare_on_rank, config.world_size, config, bitwise, timeout=timeout)


def compare_on_rank(config: Config, bitwise: bool = False) -> Outcome:
    """Train ``config`` with PyTorch, then with shard, on this rank; compare the traces.

    Call on every rank of an initialised process group of ``config.world_size``
    ranks. Warnings are silenced: the libraries word theirs differently and
    pytest's ``filterwarnings = error`` would turn them into failures.

    ``bitwise`` compares mixed-precision runs bitwise too: shard runs the same
    bf16 operations in the same order as PyTorch wherever it is right, so a
    difference within bf16 rounding is still a finding (a gradient accumulated
    in bf16 instead of fp32, say), which AdamW's first step (``lr * sign(g)``)
    can turn into a parameter off by ``2 * lr``.
    """
    if dist.get_world_size() != config.world_size:
        raise ValueError(
            f"the configuration needs {config.world_size} ranks, the process group has "
            f"{dist.get_world_size()}"
        )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = run_impl(config, "torch")
        dist.barrier()
        actual = run_impl(config, "shard")
        dist.barrier()
    rank = dist.get_rank()
    found, total = compare_traces(
        expected, actual, rank=rank, exact=bitwise or not config.mixed_precision
    )
    if total:
        status = "differs"
    elif expected.error is not None:
        step, phase, kind, _ = expected.error
        status = f"both raised {kind} in {phase}" + (f" at step {step}" if step >= 0 else "")
    else:
        status = "ok"
    return Outcome(rank, status, tuple(found), total, time.perf_counter() - start)


def run_impl(config: Config, impl: Impl) -> Trace:
    """Train ``config`` under ``impl`` on this rank, recording a snapshot after every step.

    Never raises for what the library raises: the exception ends the run
    and is recorded in ``Trace.error`` with the step and the phase.
    """
    trace = Trace()
    step, phase = -1, "build"
    if config.compile:  # See [Note: compiled blocks].
        import torch._dynamo

        torch._dynamo.reset()
    try:
        try:
            model, optim = _build(config, impl)
        except Exception:
            _built_everywhere(False)
            raise
        if not _built_everywhere(True):
            raise RuntimeError("another rank raised while building the model")
        trace.names = [name for name, _ in model.named_parameters()]
        for step in range(config.steps):
            snapshot = Snapshot()
            if config.resume not in ("none", "in-place") and step == config.resume_at:
                phase = "state_dict"
                model_state, optim_state = _save(model, optim, config, impl)
                snapshot.state_keys = _state_keys(model_state, optim_state)
                phase = "load_state_dict"
                model, optim = _build(config, impl, seed=config.seed + _RESUME_SEED)
                for before in range(1, step):
                    _toggle(model, config, before)
                _load(model, optim, model_state, optim_state, config, impl)
                del model_state, optim_state
            in_place = config.resume == "in-place" and step == config.resume_at
            if in_place:
                phase = "state_dict"
                model_state, optim_state = _save(model, optim, config, impl)
                snapshot.state_keys = _state_keys(model_state, optim_state)
            if config.evaluate and step > 0:
                phase = "evaluate"
                snapshot.eval_loss = _evaluate(model, config, step)
            if in_place:
                phase = "load_state_dict"
                _load(model, optim, model_state, optim_state, config, impl)
                del model_state, optim_state
            phase = "requires_grad_"
            _toggle(model, config, step)
            for micro in range(config.microbatches):
                last = micro == config.microbatches - 1
                tokens, targets = batch_of(config, step, micro, dist.get_rank())
                phase = "forward"
                with _gradient_sync(model, config, last):
                    logits = model(tokens, side_branch_runs(step))
                    loss = _loss(logits, targets) / config.microbatches
                    phase = "backward"
                    loss.backward()  # type: ignore[no-untyped-call]
                snapshot.losses.append(_local(loss))
            if config.clip is not None:
                phase = "clip_grad_norm_"
                snapshot.grad_norm = _local(_clip(model, config))
            phase = "snapshot"
            snapshot.grads = {
                _clean(n): None if p.grad is None else _local(p.grad)
                for n, p in model.named_parameters()
            }
            phase = "optimizer step"
            optim.step()
            optim.zero_grad(set_to_none=config.set_to_none)
            phase = "snapshot"
            snapshot.params = {_clean(n): _local(p) for n, p in model.named_parameters()}
            snapshot.optim = _optim_state(model, optim)
            trace.steps.append(snapshot)
    except Exception as exc:
        kind = next(c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins")
        trace.error = (step if phase != "build" else -1, phase, kind, _describe(exc))
    return trace


def _built_everywhere(built: bool) -> bool:
    """Whether every rank built its model: a build that fails on some ranks only (a load
    from rank 0 that the others refuse) would leave the rest waiting in the first
    all-gather until the collective timeout."""
    flag = torch.tensor([1 if built else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _describe(exc: BaseException) -> str:
    """``Type: message (at package/file.py:line in function)``: where a fix would start.

    The frame named is the innermost one in ``shard_*`` or ``torch`` code, so
    that a report points into the library rather than into the tester.
    """
    message = str(exc).split("\n")[0]
    if len(message) > 300:
        message = message[:300] + " ..."
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if "/shard_" in f.filename or "/torch/" in f.filename]
    where = ""
    if inside:
        frame = inside[-1]
        path = "/".join(frame.filename.split("/")[-2:])
        where = f" (at {path}:{frame.lineno} in {frame.name})"
    return f"{type(exc).__name__}: {message}{where}"


def mesh_for(config: Config) -> DeviceMesh:
    """The CPU mesh of ``config`` over the default process group, built once per shape."""
    key = (id(dist.group.WORLD), config.mesh)
    mesh = _MESHES.get(key)
    if mesh is None:
        names = ("replicate", "shard") if len(config.mesh) == 2 else None
        mesh = init_device_mesh("cpu", config.mesh, mesh_dim_names=names)
        _MESHES[key] = mesh
    return mesh


def _build(
    config: Config, impl: Impl, *, seed: int | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its optimizer: the user code a drop-in must accept unchanged.

    The weights come from ``seed`` (``config.seed`` unless given).
    """
    ns = fsdp_namespace(impl)
    torch.manual_seed(config.seed if seed is None else seed)
    model = Net(config)
    pretrained: dict[str, Any] | None = None
    if config.init == "meta":  # See [Note: meta initialisation].
        pretrained = {}
        if dist.get_rank() == 0:
            pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.device("meta"):
            model = Net(config)
    for name, param in model.named_parameters():
        if name in config.frozen:
            param.requires_grad_(False)
    sharded = _fully_shard(ns, model, config) if config.front_end == "fully_shard" else None
    if sharded is None:
        sharded = _wrap(ns, model, config)
    if pretrained is not None:
        if config.front_end == "fully_shard":
            sharded.to_empty(device="cpu")
        api = importlib.import_module(_STATE_DICT_MODULES[impl])
        options = api.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        api.set_model_state_dict(sharded, pretrained, options=options)
    groups = _param_groups(sharded, config)
    optim: torch.optim.Optimizer
    if config.optimizer == "sgd":
        optim = torch.optim.SGD(groups, lr=SGD_LR, momentum=0.9)
    else:
        optim = torch.optim.AdamW(groups, lr=ADAMW_LR, weight_decay=0.1)
    return sharded, optim


def _param_groups(model: nn.Module, config: Config) -> list[dict[str, Any]]:
    """One group of every parameter, or weights and (biases, norms) as ``param_groups`` says."""
    if not config.param_groups:
        return [{"params": list(model.parameters())}]
    lr = SGD_LR if config.optimizer == "sgd" else ADAMW_LR
    weights: list[nn.Parameter] = []
    others: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        clean = _clean(name)
        (others if clean.endswith(".bias") or "norm." in clean else weights).append(param)
    groups: list[dict[str, Any]] = [{"params": weights}] if weights else []
    if others:
        groups.append({"params": others, "lr": lr / 2, "weight_decay": 0.0})
    return groups


def _checkpoint_wrapper(module: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped: nn.Module = checkpoint_wrapper(module)
    return wrapped


def _fully_shard(ns: ModuleType, model: Net, config: Config) -> nn.Module:
    bf16 = torch.bfloat16
    policy = {
        "fp32": ns.MixedPrecisionPolicy(),
        "bf16": ns.MixedPrecisionPolicy(param_dtype=bf16),
        "bf16-reduce-fp32": ns.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32),
        "bf16-extra": ns.MixedPrecisionPolicy(
            param_dtype=bf16, reduce_dtype=bf16, output_dtype=torch.float32
        ),
    }[config.precision]
    offload = ns.CPUOffloadPolicy(pin_memory=False) if config.offload else ns.OffloadPolicy()
    kwargs: dict[str, Any] = {
        "mesh": mesh_for(config),
        "reshard_after_forward": config.reshard_after_forward,
        "mp_policy": policy,
        "offload_policy": offload,
    }
    if config.placement == "dim1":
        kwargs["shard_placement_fn"] = functools.partial(_shard_dim1, config.mesh[-1])
    units: list[nn.Module] = []
    for index, spec in enumerate(config.blocks):
        block: nn.Module = model.blocks[index]
        if spec.checkpoint == "wrapper":
            block = _checkpoint_wrapper(block)
            model.blocks[index] = block
        if config.compile:  # See [Note: compiled blocks].
            block.compile(backend="aot_eager")
        if config.shard_blocks:
            ns.fully_shard(block, **kwargs)
            units.append(block)
    ignored = {model.get_parameter(name) for name in ignored_names(config)}
    ns.fully_shard(model, **kwargs, ignored_params=ignored or None)
    if config.prefetch == "explicit" and units:
        root: Any = model
        root.set_modules_to_forward_prefetch(units[:1])
        for index, unit in enumerate(units):
            unit_: Any = unit
            unit_.set_modules_to_forward_prefetch(units[index + 1 : index + 2])
            unit_.set_modules_to_backward_prefetch(units[max(0, index - 1) : index])
    return model


def _shard_dim1(shard_size: int, param: nn.Parameter) -> Shard | None:
    """``Config.placement="dim1"``: ``Shard(1)`` where the shard group divides dimension 1."""
    if param.ndim == 2 and param.shape[1] % shard_size == 0:
        return Shard(1)
    return None


def _wrap(ns: ModuleType, model: Net, config: Config) -> nn.Module:
    bf16 = torch.bfloat16
    precision = {
        "fp32": None,
        "bf16": ns.MixedPrecision(param_dtype=bf16),
        "bf16-reduce-fp32": ns.MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32),
        "bf16-extra": ns.MixedPrecision(
            param_dtype=bf16, reduce_dtype=bf16, keep_low_precision_grads=True
        ),
    }[config.precision]
    kwargs: dict[str, Any] = {
        "sharding_strategy": ns.ShardingStrategy[config.strategy],
        "use_orig_params": config.use_orig_params,
        "mixed_precision": precision,
        # See [Note: the wrapper's offload].
        "cpu_offload": ns.CPUOffload(offload_params=True)
        if config.offload and ns.__name__ == "shard_runtime"
        else None,
        "backward_prefetch": None
        if config.backward_prefetch == "none"
        else ns.BackwardPrefetch[config.backward_prefetch],
        "forward_prefetch": config.forward_prefetch,
        "limit_all_gathers": config.limit_all_gathers,
        "device_id": torch.device("cpu"),
    }
    if config.init == "meta":  # See [Note: meta initialisation].
        kwargs["param_init_fn"] = _to_empty_on_cpu
    if len(config.mesh) == 2:
        kwargs["device_mesh"] = mesh_for(config)
    if config.compile:  # See [Note: compiled blocks].
        for each in model.blocks:
            each.compile(backend="aot_eager")
    if config.auto_wrap:
        policy = importlib.import_module(f"{ns.__name__}.wrap").ModuleWrapPolicy({Block})
        root: Any = ns.FullyShardedDataParallel(
            model, auto_wrap_policy=policy, **kwargs, ignored_states=_ignored_modules(model, config)
        )
        blocks = root.module.blocks
        for index, spec in enumerate(config.blocks):
            if spec.checkpoint == "wrapper":  # apply_activation_checkpointing's order
                blocks[index] = _checkpoint_wrapper(blocks[index])
        wrapped: nn.Module = root
        return wrapped
    for index, spec in enumerate(config.blocks):
        block: nn.Module = model.blocks[index]
        if config.shard_blocks:
            block = ns.FullyShardedDataParallel(block, **kwargs)
        if spec.checkpoint == "wrapper":  # what apply_activation_checkpointing does after wrapping
            block = _checkpoint_wrapper(block)
        model.blocks[index] = block
    wrapped = ns.FullyShardedDataParallel(
        model, **kwargs, ignored_states=_ignored_modules(model, config)
    )
    return wrapped


def _ignored_modules(model: Net, config: Config) -> list[nn.Module] | None:
    """The wrapper's ``ignored_states`` for ``config.ignored``."""
    return [model.norm] if config.ignored == "norm" else None


def _to_empty_on_cpu(module: nn.Module) -> None:
    """The wrapper's ``param_init_fn`` for a meta model whose values are loaded afterwards."""
    module.to_empty(device=torch.device("cpu"), recurse=False)


_STATE_DICT_MODULES: dict[Impl, str] = {
    "torch": "torch.distributed.checkpoint.state_dict",
    "shard": "shard_checkpoint",
}


def _state_dict_api(config: Config, impl: Impl) -> tuple[ModuleType, Any]:
    """Where ``impl`` keeps ``get_state_dict`` and ``set_state_dict``, and the options
    ``config.resume`` asks for (``full_state_dict`` for ``"full"``).

    Imported when asked for, as :func:`fsdp_namespace` does: shard-testing does
    not depend on shard-checkpoint.
    """
    api = importlib.import_module(_STATE_DICT_MODULES[impl])
    return api, api.StateDictOptions(full_state_dict=config.resume == "full")


_NATIVE = ("native", "in-place")
"""The resumes through the front end's own ``state_dict`` and ``load_state_dict`` methods."""


def _save(
    model: nn.Module, optim: torch.optim.Optimizer, config: Config, impl: Impl
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state dicts, taken the way ``config.resume`` says.

    ``"native"``: the front end's own methods, as Lightning and accelerate call them:
    ``model.state_dict()`` and ``optim.state_dict()`` under ``fully_shard``; under the
    wrapper ``SHARDED_STATE_DICT`` with ``FullyShardedDataParallel.optim_state_dict``.
    Otherwise ``get_state_dict`` (``full_state_dict`` for ``"full"``).
    """
    if config.resume in _NATIVE:
        if config.front_end == "fully_shard":
            return model.state_dict(), optim.state_dict()
        ns = fsdp_namespace(impl)
        fsdp = ns.FullyShardedDataParallel
        with fsdp.state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT):
            return model.state_dict(), fsdp.optim_state_dict(model, optim)
    api, options = _state_dict_api(config, impl)
    saved: tuple[dict[str, Any], dict[str, Any]] = api.get_state_dict(model, optim, options=options)
    return saved


def _load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
    config: Config,
    impl: Impl,
) -> None:
    """Load what :func:`_save` gave into a model and optimizer (fresh ones, or for
    ``"in-place"`` the same), the same way."""
    if config.resume in _NATIVE:
        if config.front_end == "fully_shard":
            model.load_state_dict(model_state)
            optim.load_state_dict(optim_state)
            return
        ns = fsdp_namespace(impl)
        fsdp = ns.FullyShardedDataParallel
        with fsdp.state_dict_type(model, ns.StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(model_state)
            optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim, optim_state))
        return
    api, options = _state_dict_api(config, impl)
    api.set_state_dict(
        model, optim, model_state_dict=model_state, optim_state_dict=optim_state, options=options
    )


def _state_keys(model_state: dict[str, Any], optim_state: dict[str, Any]) -> tuple[str, ...]:
    """Every key of both state dicts, in their order: a drop-in's dicts iterate alike.

    The model's keys, then ``state.<fqn>.<name>``, ``param_groups.<i>.<option>``
    and any other top-level key of the optimizer's.
    """
    keys = list(model_state)
    for fqn, entry in optim_state.get("state", {}).items():
        keys += [f"state.{fqn}.{name}" for name in entry]
    for index, group in enumerate(optim_state.get("param_groups", [])):
        keys += [f"param_groups.{index}.{option}" for option in group]
    keys += [str(key) for key in optim_state if key not in ("state", "param_groups")]
    return tuple(keys)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy of a (batch, sequence, vocabulary) output."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _evaluate(model: nn.Module, config: Config, step: int) -> torch.Tensor:
    """The loss of a validation batch in eval mode, under ``torch.no_grad()`` unless
    ``config.eval_no_grad`` is False (then the graph is dropped without a backward);
    with ``config.eval_swap`` on halved weights, restored after it."""
    tokens, targets = batch_of(config, step, _EVAL_MICRO, dist.get_rank())
    params = list(model.parameters())
    kept: list[torch.Tensor] = []
    if config.eval_swap:
        with torch.no_grad():
            kept = [p.detach().clone() for p in params]
            for p in params:
                p.mul_(0.5)
    model.eval()
    try:
        with torch.no_grad() if config.eval_no_grad else contextlib.nullcontext():
            loss = _loss(model(tokens, False), targets)
    finally:
        model.train()
    if config.eval_swap:
        with torch.no_grad():
            for p, value in zip(params, kept, strict=True):
                p.copy_(value)
    return _local(loss)


def _clean(name: str) -> str:
    """A parameter name without the wrappers' prefixes: the unwrapped model's name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _toggle(model: nn.Module, config: Config, step: int) -> None:
    """Apply the toggles due before ``step`` (those after the previous step)."""
    due = [t for t in config.toggles if t.after_step == step - 1]
    if not due:
        return
    params = {_clean(n): p for n, p in model.named_parameters()}
    for toggle in due:
        params[toggle.name].requires_grad_(toggle.requires_grad)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, config: Config, last: bool) -> Iterator[None]:
    """What ``config.accumulate`` switches off for a micro-batch before the last one."""
    unit: Any = model
    if config.microbatches == 1 or config.accumulate == "sync":
        yield
    elif config.front_end == "wrapper":
        if last:
            yield
        else:
            with unit.no_sync():
                yield
    else:
        if config.accumulate == "no-all-reduce":
            unit.set_requires_all_reduce(last)
        else:
            unit.set_requires_gradient_sync(last)
        if config.accumulate == "no-sync-keep":
            unit.set_reshard_after_backward(last)
        yield


def _clip(model: nn.Module, config: Config) -> torch.Tensor:
    assert config.clip is not None
    if config.front_end == "wrapper":
        unit: Any = model
        norm: torch.Tensor = unit.clip_grad_norm_(config.clip)
        return norm
    return torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of this rank's part: a DTensor's local shard, a scalar norm whole."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor() if tensor.dim() == 0 else tensor.to_local()
    return tensor.detach().to("cpu", copy=True)


def _optim_state(
    model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, dict[str, torch.Tensor | float]]:
    names = {id(p): _clean(n) for n, p in model.named_parameters()}
    out: dict[str, dict[str, torch.Tensor | float]] = {}
    for group in optim.param_groups:
        for param in group["params"]:
            state = optim.state.get(param)
            if not state:
                continue
            out[names.get(id(param), f"<unnamed {tuple(param.shape)}>")] = {
                key: _local(value) if isinstance(value, torch.Tensor) else float(value)
                for key, value in state.items()
            }
    return out
