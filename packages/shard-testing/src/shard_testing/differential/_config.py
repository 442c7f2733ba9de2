"""One training configuration of the differential tester, and the space they are drawn from.

[Note: Drawing configurations]
A :class:`Config` is a frozen dataclass of plain values (strings, ints,
bools, tuples), so that it pickles to the ranks, prints as a Python literal
(``repr``) that a standalone script can paste, and compares and hashes.
:func:`draw_config` builds one from a :class:`Pick`, a function that picks
one of a sequence of options. Hypothesis drives it with
``lambda options: draw(st.sampled_from(options))`` (``config_strategy`` in
``_hypothesis.py``, which the tests and ``tools/fuzz`` use), so that its
shrinking works on the choices and so on the configuration;
``random.Random(seed).choice`` drives it without hypothesis. shard-testing
does not require hypothesis: the space is described here, and the adapter
imports hypothesis only when called (the ``hypothesis`` extra brings it).

Options are listed simplest first, because hypothesis shrinks a
``sampled_from`` towards its first element: a shrunk failure keeps only the
dimensions that matter, the others fall back to fp32, one block, no
checkpointing, no offload and so on.

Each choice depends only on choices drawn before it, so that the generator
can keep to what PyTorch accepts (a ``reshard_after_forward`` int divides
the shard group; HYBRID_SHARD needs a 2-D mesh) while still producing, on
purpose, a few combinations PyTorch refuses (FSDP1 with
``use_orig_params=False`` and mixed ``requires_grad`` in one unit): for those
the comparison is that both libraries raise the same exception type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal, Protocol, TypeVar

__all__ = [
    "BlockSpec",
    "Config",
    "HYBRID",
    "Pick",
    "Toggle",
    "draw_config",
    "random_pick",
]

T = TypeVar("T")

FrontEnd = Literal["fully_shard", "wrapper"]
BlockKind = Literal["mlp", "lora"]
Checkpoint = Literal["none", "inner", "wrapper"]
Precision = Literal["fp32", "bf16", "bf16-reduce-fp32", "bf16-extra"]
Strategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
HYBRID: tuple[Strategy, ...] = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
"""The wrapper's strategies that need a 2-D (replicate, shard) mesh."""
Prefetch = Literal["none", "explicit"]
BackwardPrefetch = Literal["BACKWARD_PRE", "BACKWARD_POST", "none"]
Optimizer = Literal["sgd", "adamw"]
Freeze = Literal["none", "adapters", "bias-norm", "units", "subset"]
Resume = Literal["none", "sharded", "full", "native", "in-place"]
Accumulate = Literal["no-sync", "sync", "no-sync-keep", "no-all-reduce"]
Init = Literal["eager", "meta"]
Ignored = Literal["none", "norm"]
Placement = Literal["dim0", "dim1"]


class Pick(Protocol):
    """Picks one element of a non-empty sequence; see [Note: Drawing configurations]."""

    def __call__(self, options: Sequence[T], /) -> T: ...


@dataclass(frozen=True)
class BlockSpec:
    """One residual block of the model (see ``_models.Block``).

    Attributes:
        kind: ``"mlp"``: LayerNorm, Linear up, tanh, Linear down.
            ``"lora"``: the up projection is a frozen base Linear plus a
            trainable low-rank pair ``b(a(x))`` in the same unit.
        checkpoint: ``"inner"``: the block's body runs under
            ``torch.utils.checkpoint`` (non-reentrant); ``"wrapper"``: the
            block is wrapped in PyTorch's ``checkpoint_wrapper`` before
            sharding; ``"none"``.
        side: the block holds a side Linear that only even steps use, so that
            its parameters get no gradient on odd steps.
    """

    kind: BlockKind = "mlp"
    checkpoint: Checkpoint = "none"
    side: bool = False


@dataclass(frozen=True)
class Toggle:
    """``requires_grad_(requires_grad)`` on the parameter ``name`` after step ``after_step``.

    ``name`` is the clean name (no wrapper prefixes), as in the unwrapped model.
    """

    after_step: int
    name: str
    requires_grad: bool


@dataclass(frozen=True)
class Config:
    """One training run that PyTorch's FSDP and shard must agree on, step by step.

    The defaults are the simplest run: ``fully_shard`` on 2 ranks, one MLP
    block, fp32, SGD, two steps. See ``_run.run_impl`` for how each field is
    applied, and :meth:`to_script` for a standalone reproduction.
    """

    front_end: FrontEnd = "fully_shard"
    world_size: int = 2
    mesh: tuple[int, ...] = (2,)
    """``(world,)`` or ``(replicate, shard)`` (named ``"replicate"``, ``"shard"``)."""
    width: int = 8
    batch: int = 2
    blocks: tuple[BlockSpec, ...] = (BlockSpec(),)
    tied: bool = False
    """The head's weight is the embedding's (both in the root unit)."""
    shard_blocks: bool = True
    """Each block is a unit of its own; otherwise the root unit holds everything."""
    frozen: tuple[str, ...] = ()
    """Clean names of parameters frozen before sharding (besides LoRA bases)."""
    toggles: tuple[Toggle, ...] = ()
    precision: Precision = "fp32"
    """``"bf16"``: bf16 parameters, reduction in bf16; ``"bf16-reduce-fp32"``: reduction in
    fp32; ``"bf16-extra"``: bf16 reduction plus fp32 outputs (``fully_shard``'s
    ``output_dtype``) or bf16 gradients kept (the wrapper's ``keep_low_precision_grads``)."""
    reshard_after_forward: bool | int = True
    """``fully_shard`` only: bool, or the size of the group to reshard to."""
    prefetch: Prefetch = "none"
    """``fully_shard`` only: explicit forward and backward prefetch between blocks."""
    strategy: Strategy = "FULL_SHARD"
    """Wrapper only."""
    use_orig_params: bool = True
    """Wrapper only."""
    auto_wrap: bool = False
    """Wrapper only: the blocks become units through ``auto_wrap_policy=ModuleWrapPolicy``
    (checkpoint wrappers applied afterwards, as ``apply_activation_checkpointing`` does)
    instead of one ``FullyShardedDataParallel(block)`` call each."""
    backward_prefetch: BackwardPrefetch = "BACKWARD_PRE"
    """Wrapper only."""
    forward_prefetch: bool = False
    """Wrapper only."""
    limit_all_gathers: bool = True
    """Wrapper only."""
    offload: bool = False
    """CPU offload of parameters. Wrapper: shard only, PyTorch's run keeps them on the
    compute device (its FSDP1 offload needs an accelerator); offloading must not change a
    value, so the comparison still holds. See [Note: the wrapper's offload] in ``_run.py``."""
    optimizer: Optimizer = "sgd"
    param_groups: bool = False
    """Two param groups, as fine-tuning recipes build them: weights, and biases and norms
    at half the learning rate without weight decay (an empty one is left out)."""
    steps: int = 2
    microbatches: int = 1
    """Gradient accumulation over this many micro-batches, as ``accumulate`` says."""
    accumulate: Accumulate = "no-sync"
    """With ``microbatches > 1``, what the micro-batches before the last do.
    ``"no-sync"``: no gradient sync (``set_requires_gradient_sync(False)``, FSDP1's
    ``no_sync()``). ``"sync"``: nothing is switched off, every micro-batch reduces into the
    sharded gradient. ``fully_shard`` only: ``"no-sync-keep"``: no gradient sync and
    ``set_reshard_after_backward(False)``, so the next micro-batch's forward reuses the
    gathered parameters (FSDP2's advice for accumulation); ``"no-all-reduce"`` (2-D mesh):
    ``set_requires_all_reduce(False)``, each micro-batch reduce-scatters and only the last
    all-reduces across replicas."""
    clip: float | None = None
    set_to_none: bool = True
    """``optim.zero_grad(set_to_none=...)`` after each step: ``False`` keeps zero-filled
    gradients, so parameters without a gradient in the next step (frozen since, or on a
    branch that step skips) still have one, and the optimizer still steps them (momentum,
    weight decay), and the next reduction adds to them."""
    seed: int = 0
    evaluate: bool = False
    """Before every step but the first, a validation forward (``model.eval()`` under
    ``torch.no_grad()``, then ``model.train()``) whose loss is compared too."""
    eval_no_grad: bool = True
    """With ``evaluate``: ``False`` runs the validation forward with autograd on and drops
    its graph without a backward (a loss computed for logging without ``torch.no_grad()``),
    so every unit sees a forward whose backward never comes."""
    eval_swap: bool = False
    """With ``evaluate``: swap other weights in for the validation forward and back after
    it, as an EMA or a weight-averaging callback does: every parameter is halved in place
    before it and restored from a copy after it, through the objects ``parameters()``
    gave before. Units the validation forward left gathered must not serve the next
    training forward with the swapped-in values."""
    resume: Resume = "none"
    """At the start of step ``resume_at``: the model's and the optimizer's state dicts
    (``get_state_dict``; ``"full"``: ``full_state_dict=True``; ``"native"``: the front
    end's own ``state_dict`` methods) are loaded into a freshly built, differently
    initialised model and optimizer, which train the remaining steps. ``"in-place"``:
    the front end's own state dicts, taken before that step's evaluation, are loaded
    back into the same model and optimizer after it (into units it left gathered). See
    [Note: resuming] in ``_run.py``."""
    resume_at: int = 1
    init: Init = "eager"
    """``"meta"``: the model is built on the meta device and sharded there, then given
    memory (``fully_shard``: ``model.to_empty(device="cpu")``; the wrapper:
    ``param_init_fn`` calls ``to_empty(recurse=False)`` on each module) and loaded from the
    full state dict of the model ``"eager"`` builds, which only rank 0 holds
    (``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``): how
    a fine-tuning job loads pretrained weights into a model too big for one rank.
    PyTorch's FSDP1 ``sync_module_states`` needs an accelerator, so the wrapper loads the
    same way as ``fully_shard``. See [Note: meta initialisation] in ``_run.py``."""
    ignored: Ignored = "none"
    """``"norm"``: the final LayerNorm stays out of sharding (``fully_shard``'s
    ``ignored_params`` on the root call; the wrapper's ``ignored_states=[norm]``): its
    parameters stay whole on every rank and their gradients are not reduced (each rank
    keeps its own), as for parameters a user manages apart (a replicated norm, an expert
    handled by another parallelism)."""
    placement: Placement = "dim0"
    """``fully_shard`` only. ``"dim1"``: ``shard_placement_fn`` shards every 2-D parameter
    whose second dimension the shard group divides on that dimension (``Shard(1)``, as
    torchtitan does for expert weights); the others keep ``Shard(0)``."""
    buffers: bool = False
    """Each block scales its output by a persistent buffer (``scale``, drawn from the seed):
    buffers are replicated, not sharded, and travel through state dicts, resumes and meta
    initialisation beside the parameters."""
    compile: bool = False
    """Each block is compiled in place (``block.compile(backend="aot_eager")``): under
    ``fully_shard`` after its checkpoint wrapper and before sharding (torchtitan's order),
    under the wrapper before wrapping. See [Note: compiled blocks] in ``_run.py``."""
    freeze: Freeze = field(default="none", compare=False)
    """How ``frozen`` was chosen (for per-dimension counts only)."""

    @property
    def mixed_precision(self) -> bool:
        """Whether compute runs in bf16, so values compare within bf16 rounding."""
        return self.precision != "fp32"

    def to_script(self) -> str:
        """A standalone Python script that runs this configuration under both libraries.

        It spawns ``world_size`` gloo processes on localhost (no torchrun),
        runs PyTorch then shard on the same seeds and prints the first
        discrepancy, or that there is none; see ``_script.render``.
        """
        from shard_testing.differential._script import render

        return render(self)

    def dimensions(self) -> dict[str, str]:
        """The configuration as ``dimension -> value`` strings, for per-dimension counts."""
        out = {
            "front_end": self.front_end,
            "world_size": str(self.world_size),
            "mesh": "2-D" if len(self.mesh) == 2 else "1-D",
            "blocks": str(len(self.blocks)),
            "tied": str(self.tied),
            "shard_blocks": str(self.shard_blocks),
            "freeze": self.freeze,
            "toggles": "+".join(
                sorted({"unfreeze" if t.requires_grad else "freeze" for t in self.toggles})
            )
            or "none",
            "precision": self.precision,
            "offload": str(self.offload),
            "optimizer": self.optimizer,
            "param_groups": str(self.param_groups),
            "steps": str(self.steps),
            "microbatches": str(self.microbatches),
            "accumulate": self.accumulate if self.microbatches > 1 else "-",
            "clip": str(self.clip is not None),
            "set_to_none": str(self.set_to_none),
            "evaluate": str(self.evaluate),
            "eval_no_grad": str(self.eval_no_grad),
            "eval_swap": str(self.eval_swap),
            "resume": self.resume,
            "init": self.init,
            "ignored": self.ignored,
            "buffers": str(self.buffers),
            "compile": str(self.compile),
        }
        for spec in self.blocks:
            out[f"block.{spec.kind}"] = "yes"
            out[f"checkpoint.{spec.checkpoint}"] = "yes"
            if spec.side:
                out["unused_side_branch"] = "yes"
        if self.front_end == "fully_shard":
            out["reshard_after_forward"] = str(self.reshard_after_forward)
            out["prefetch"] = self.prefetch
            out["placement"] = self.placement
        else:
            out["strategy"] = self.strategy
            out["use_orig_params"] = str(self.use_orig_params)
            out["auto_wrap"] = str(self.auto_wrap)
            out["backward_prefetch"] = self.backward_prefetch
            out["forward_prefetch"] = str(self.forward_prefetch)
            out["limit_all_gathers"] = str(self.limit_all_gathers)
        return out

    def brief(self) -> str:
        """Like ``repr``, but only the fields that differ from the defaults (still valid Python)."""
        default = Config()
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if _differs(getattr(self, f.name), getattr(default, f.name))
        ]
        return f"Config({', '.join(parts)})"


def _differs(value: object, default: object) -> bool:
    """``value != default``, telling ``1`` from ``True`` (``reshard_after_forward``)."""
    return value != default or type(value) is not type(default)


def side_branch_runs(step: int) -> bool:
    """Whether the blocks' side branches take part in ``step``'s training forwards: on even
    steps only, so their parameters get no gradient on odd ones."""
    return step % 2 == 0


def parameter_names(config: Config) -> list[str]:
    """The clean names of the model's parameters, in ``named_parameters`` order.

    Tied weights appear once (under the embedding), as ``named_parameters``
    lists them. Kept in step with ``_models.Net`` by a unit test.
    """
    names = ["embed.weight"]
    for index, spec in enumerate(config.blocks):
        prefix = f"blocks.{index}."
        names += [prefix + "norm.weight", prefix + "norm.bias"]
        if spec.kind == "lora":
            names += [prefix + "up.base.weight", prefix + "up.base.bias"]
            names += [prefix + "up.a.weight", prefix + "up.b.weight"]
        else:
            names += [prefix + "up.weight", prefix + "up.bias"]
        names += [prefix + "down.weight", prefix + "down.bias"]
        if spec.side:
            names += [prefix + "side.weight", prefix + "side.bias"]
    names += ["norm.weight", "norm.bias"]
    if not config.tied:
        names.append("head.weight")
    return names


def _unit_of(name: str, config: Config) -> str:
    """The unit a parameter lands in: ``blocks.<i>`` or the root (``""``)."""
    if config.shard_blocks and name.startswith("blocks."):
        return ".".join(name.split(".")[:2])
    return ""


def ignored_names(config: Config) -> frozenset[str]:
    """The parameters kept out of sharding (``Config.ignored``): in no unit."""
    return frozenset(("norm.weight", "norm.bias")) if config.ignored == "norm" else frozenset()


def _subset(pick: Pick, items: Sequence[str]) -> tuple[str, ...]:
    return tuple(item for item in items if pick((False, True)))


def draw_config(pick: Pick, *, world_sizes: Sequence[int] = (2, 4)) -> Config:
    """One configuration, every choice made by ``pick``; see [Note: Drawing configurations].

    ``world_sizes`` lists the world sizes allowed (the first is what a
    shrunk configuration falls back to).
    """
    front_end: FrontEnd = pick(("fully_shard", "wrapper"))
    world = pick(tuple(world_sizes))
    mesh: tuple[int, ...] = (world,)
    strategy: Strategy = "FULL_SHARD"
    use_orig_params = True
    if front_end == "wrapper":
        use_orig_params = pick((True, False))
        strategy = pick(("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", *HYBRID))
        if strategy in HYBRID:
            mesh = _two_dim(pick, world)
    elif pick((False, True)):
        mesh = _two_dim(pick, world)
    width = pick((8, 16))
    batch = pick((2, 4))
    block_count = pick((1, 2, 3))
    kinds: tuple[BlockKind, ...] = ("mlp", "lora")
    blocks = tuple(
        BlockSpec(
            kind=pick(kinds),
            checkpoint=pick(("none", "inner", "wrapper")),
            side=pick((False, True)),
        )
        for _ in range(block_count)
    )
    tied = pick((False, True))
    shard_blocks = pick((True, False))
    base = Config(
        front_end=front_end,
        world_size=world,
        mesh=mesh,
        width=width,
        batch=batch,
        blocks=blocks,
        tied=tied,
        shard_blocks=shard_blocks,
    )
    names = parameter_names(base)
    freeze: Freeze = pick(("none", "adapters", "bias-norm", "units", "subset"))
    frozen = _frozen(pick, freeze, names, base)
    steps = pick((2, 3, 4))
    toggles: tuple[Toggle, ...] = ()
    # Toggling requires_grad on FSDP1's flat parameters is not a thing users do.
    if not (front_end == "wrapper" and not use_orig_params) and pick((False, True)):
        toggles = _toggles(pick, names, frozen, steps)
    precision: Precision = pick(("fp32", "bf16", "bf16-reduce-fp32", "bf16-extra"))
    shard_size = mesh[-1]
    reshard: bool | int = True
    prefetch: Prefetch = "none"
    backward_prefetch: BackwardPrefetch = "BACKWARD_PRE"
    forward_prefetch = False
    limit_all_gathers = True
    auto_wrap = False
    if front_end == "fully_shard":
        divisors = tuple(d for d in range(1, shard_size + 1) if shard_size % d == 0)
        reshard = pick((True, False, *divisors))
        prefetch = pick(("none", "explicit"))
    else:
        backward_prefetch = pick(("BACKWARD_PRE", "BACKWARD_POST", "none"))
        forward_prefetch = pick((False, True))
        limit_all_gathers = pick((True, False))
        auto_wrap = shard_blocks and pick((False, True))
    evaluate = pick((False, True))
    eval_no_grad = pick((True, False)) if evaluate else True
    eval_swap = pick((False, True)) if evaluate else False
    resume: Resume = pick(("none", "sharded", "full", "native", "in-place"))
    microbatches = pick((1, 2))
    accumulate: Accumulate = "no-sync"
    if microbatches > 1:
        ways: list[Accumulate] = ["no-sync", "sync"]
        if front_end == "fully_shard":
            ways.append("no-sync-keep")
            if len(mesh) == 2:
                ways.append("no-all-reduce")
        accumulate = pick(ways)
    # base holds the model's shape (the parameter names above come from it); add the rest.
    config = replace(
        base,
        frozen=frozen,
        toggles=toggles,
        precision=precision,
        reshard_after_forward=reshard,
        prefetch=prefetch,
        strategy=strategy,
        use_orig_params=use_orig_params,
        auto_wrap=auto_wrap,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        limit_all_gathers=limit_all_gathers,
        offload=pick((False, True)),
        optimizer=pick(("sgd", "adamw")),
        # FSDP1's flat parameters cannot be split into groups by original parameter.
        param_groups=use_orig_params and pick((False, True)),
        steps=steps,
        microbatches=microbatches,
        accumulate=accumulate,
        clip=pick((None, 0.5)),
        set_to_none=pick((True, False)),
        seed=pick(tuple(range(4))),
        freeze=freeze,
        evaluate=evaluate,
        eval_no_grad=eval_no_grad,
        eval_swap=eval_swap,
        resume=resume,
        resume_at=pick(tuple(range(1, steps))) if resume != "none" else 1,
    )
    # Drawn last, so the configurations drawn before this dimension existed keep their values.
    config = replace(config, init=pick(("eager", "meta")), ignored=pick(("none", "norm")))
    # PyTorch fails on some ranks, and hangs the others, with Shard(1) and a post-forward
    # group smaller than the shard group (known bug torch-fully-shard-shard1-post-forward-group).
    if front_end == "fully_shard" and not 1 < reshard < shard_size:
        config = replace(config, placement=pick(("dim0", "dim1")))
    config = replace(config, buffers=pick((False, True)))
    # One in four: a compiled configuration takes several times an eager one's time.
    return replace(config, compile=pick((False, False, False, True)))


def _toggles(
    pick: Pick, names: Sequence[str], frozen: Sequence[str], steps: int
) -> tuple[Toggle, ...]:
    """One to three ``requires_grad_`` changes between steps, freezing or unfreezing.

    An unfreeze picks among the parameters frozen before sharding (LoRA bases
    included), a freeze among the trainable ones, so that both directions
    change something.
    """
    frozen_now = set(frozen) | {n for n in names if ".up.base." in n}
    toggles: list[Toggle] = []
    for _ in range(pick((1, 2, 3))):
        after_step = pick(tuple(range(steps - 1)))
        unfreeze = pick((False, True))
        candidates = sorted(frozen_now if unfreeze else set(names) - frozen_now, key=names.index)
        if not candidates:
            unfreeze = not unfreeze
            candidates = sorted(
                frozen_now if unfreeze else set(names) - frozen_now, key=names.index
            )
        name = pick(candidates)
        toggles.append(Toggle(after_step=after_step, name=name, requires_grad=unfreeze))
        frozen_now.symmetric_difference_update({name})
    return tuple(sorted(toggles, key=lambda t: t.after_step))


def _two_dim(pick: Pick, world: int) -> tuple[int, ...]:
    """A ``(replicate, shard)`` shape of ``world`` ranks; ``(2, world // 2)`` first."""
    shapes = [(2, world // 2)] if world % 2 == 0 else []
    shapes += [(r, world // r) for r in range(1, world + 1) if world % r == 0 and r != 2]
    return pick(tuple(shapes))


def _frozen(pick: Pick, freeze: Freeze, names: Sequence[str], config: Config) -> tuple[str, ...]:
    if freeze == "adapters":  # LoRA fine-tuning: only the low-rank pairs and the head train
        head = "embed.weight" if config.tied else "head.weight"
        return tuple(n for n in names if ".up.a." not in n and ".up.b." not in n and n != head)
    if freeze == "bias-norm":  # BitFit-style: biases and norms train
        return tuple(
            n for n in names if not (n.endswith(".bias") or ".norm." in n or n.startswith("norm."))
        )
    if freeze == "units":  # whole units frozen: valid for FSDP1's flat parameters
        units = sorted({_unit_of(n, config) for n in names})
        chosen = set(_subset(pick, units))
        return tuple(n for n in names if _unit_of(n, config) in chosen)
    if freeze == "subset":
        return _subset(pick, names)
    return ()


def random_pick(seed: int) -> Pick:
    """A :class:`Pick` from ``random.Random(seed)``: configurations without hypothesis."""
    import random

    rng = random.Random(seed)

    def pick(options: Sequence[T], /) -> T:
        return options[rng.randrange(len(options))]

    return pick
