"""Reported shard bugs that the differential CI sample steps around, each with its reason.

[Note: Known bugs]
The tester's purpose is to find where shard differs from PyTorch; the
engine team fixes what it finds. Until a fix lands, a CI sample that keeps
drawing the same known failure says nothing new and hides new ones, so the
CI test skips configurations that :func:`known_bugs_in` matches, and only
those. Each entry names the dimension and value, the symptom and where it
was reported; deleting the entry re-enables the dimension everywhere.
``tools/fuzz`` does not skip anything: it reports known bugs as such.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shard_testing.differential._config import Config, _unit_of, parameter_names

__all__ = ["KNOWN_BUGS", "KnownBug", "known_bugs_in"]


@dataclass(frozen=True)
class KnownBug:
    """A reported difference: which configurations show it, whose bug it is, what happens.

    Attributes:
        name: a short slug, used in reports.
        culprit: ``"shard"`` (the engine team fixes it) or ``"torch"`` (PyTorch
            misbehaves and shard is right; the entry stays until PyTorch fixes it).
        matches: whether a configuration runs into it (may over-approximate).
        symptom: what the tester sees, and the minimal configuration.
    """

    name: str
    culprit: str
    matches: Callable[[Config], bool]
    symptom: str


def _trainable_by_step(config: Config) -> list[set[str]]:
    """The trainable parameters at each step: frozen before sharding, then the toggles."""
    names = parameter_names(config)
    trainable = {n for n in names if n not in config.frozen and ".up.base." not in n}
    by_step = []
    for step in range(config.steps):
        for toggle in config.toggles:
            if toggle.after_step == step - 1:
                (trainable.add if toggle.requires_grad else trainable.discard)(toggle.name)
        by_step.append(set(trainable))
    return by_step


def _root_frees_too_early(config: Config) -> bool:
    """Whether a root module with only frozen parameters runs after trainable parameters of
    other units and before the root's first module with a trainable one (forward order)."""
    if config.front_end != "fully_shard":
        return False
    modules: dict[str, list[str]] = {}  # forward order (dicts keep insertion order)
    for name in parameter_names(config):
        if ".side." not in name:
            modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
    if config.tied:
        modules["head"] = ["embed.weight"]
    order = list(modules.items())
    for trainable in _trainable_by_step(config):
        in_root = [_unit_of(names[0], config) == "" for _, names in order]
        live = [any(n in trainable for n in names) for _, names in order]
        first = next((i for i in range(len(order)) if in_root[i] and live[i]), None)
        if first is None:
            continue  # no root gradient: the root never reshards in backward
        upstream = False
        for i in range(first):
            if live[i]:
                upstream = True
            elif in_root[i] and upstream and order[i][0] != "embed":
                return True
    return False


def _units(config: Config) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for name in parameter_names(config):
        units.setdefault(_unit_of(name, config), set()).add(name)
    return units


def _unfreezes_a_frozen_unit(config: Config) -> bool:
    """A unit with no trainable parameter at the first step gets one later."""
    steps = _trainable_by_step(config)
    return any(
        not (members & steps[0]) and any(members & later for later in steps[1:])
        for members in _units(config).values()
    )


def _some_unit_all_frozen(config: Config) -> bool:
    units: dict[str, set[str]] = {}
    for name in parameter_names(config):
        units.setdefault(_unit_of(name, config), set()).add(name)
    return any(
        not (members & trainable)
        for trainable in _trainable_by_step(config)
        for members in units.values()
    )


KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        name="wrapper-keep-low-precision-grads",
        culprit="shard",
        matches=lambda c: c.front_end == "wrapper" and c.precision == "bf16-extra",
        symptom=(
            "FullyShardedDataParallel with MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, "
            "keep_low_precision_grads=True): shard raises in the first backward "
            "'RuntimeError: attempting to assign a gradient with dtype BFloat16 to a tensor "
            "with grad_dtype Float'; PyTorch trains (SGD) or fails only in AdamW's step. "
            "On 4 ranks (SHARD_GRAD_OP, LoRA units) only some ranks raise and the others "
            "hang in the next collective. "
            "Minimal: Config(front_end='wrapper', precision='bf16-extra')"
        ),
    ),
    KnownBug(
        name="fully-shard-root-reshards-before-frozen-backward",
        culprit="shard",
        matches=_root_frees_too_early,
        symptom=(
            "fully_shard: the root unit's input (token ids) needs no gradient, and when its "
            "only trainable parameter is the last one forward uses (the head, with the "
            "embedding and the final LayerNorm frozen) shard frees the root's unsharded "
            "parameters after the head's gradient, before the frozen LayerNorm's backward "
            "that still reads its weight: 'RuntimeError: The tensor has a non-zero number of "
            "elements, but its data is not allocated yet' in backward; PyTorch trains. "
            "Minimal: Config(frozen=('embed.weight', 'norm.weight', 'norm.bias'))"
        ),
    ),
    KnownBug(
        name="fully-shard-accumulates-in-param-dtype",
        culprit="shard",
        matches=lambda c: (
            c.front_end == "fully_shard"
            and c.precision == "bf16-reduce-fp32"
            and c.microbatches > 1
        ),
        symptom=(
            "fully_shard with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and "
            "set_requires_gradient_sync(False) micro-batches: PyTorch accumulates the unsharded "
            "gradients in reduce_dtype (FSDPParam.to_accumulated_grad_if_needed upcasts to "
            "fp32), shard in bf16, so the reduced gradients differ by bf16 rounding "
            "(-0.0113525390625 vs -0.01141357421875) and AdamW's first step turns near-zero "
            "ones into parameters 2 * lr apart. Minimal: "
            "Config(precision='bf16-reduce-fp32', microbatches=2)"
        ),
    ),
    KnownBug(
        name="wrapper-clip-grad-norm-summation-order",
        culprit="shard",
        matches=lambda c: (
            c.front_end == "wrapper" and c.clip is not None and c.use_orig_params and c.shard_blocks
        ),
        symptom=(
            "FullyShardedDataParallel.clip_grad_norm_ with use_orig_params=True and nested "
            "units: shard sums the per-parameter norms in model.parameters() order, PyTorch in "
            "unit order (self._all_handles: the root's flat_param._params, then each nested "
            "unit's), so the total norm (and every clipped gradient after it) differs in the "
            "last bit for some seeds: 1.0584574937820435 vs 1.058457612991333. Minimal: "
            "Config(front_end='wrapper', blocks=(BlockSpec(kind='lora'),), clip=0.5, seed=2)"
        ),
    ),
    KnownBug(
        name="fully-shard-replica-all-reduce-order",
        culprit="shard",
        matches=lambda c: (
            c.front_end == "fully_shard"
            and len(c.mesh) == 2
            and c.mesh[0] > 2
            and any(spec.side for spec in c.blocks)
        ),
        symptom=(
            "fully_shard on a (4, 1) mesh (replicas only) with a parameter unused in a step: "
            "the gradients after the replica all-reduce differ from PyTorch's in the last bit "
            "(-0.014009188860654831 vs -0.014009187929332256) in the step that leaves the side "
            "branch unused; the same on (2, 1) and (2, 2) is bitwise equal, so the reduced "
            "buffer is likely laid out differently when some gradients are missing (gloo "
            "chunks a 4-rank all-reduce by buffer size, which changes the summation order). "
            "Minimal: Config(world_size=4, mesh=(4, 1), blocks=(BlockSpec(side=True),))"
        ),
    ),
    KnownBug(
        name="torch-hybrid-shard-group-of-one",
        culprit="torch",
        matches=lambda c: (
            c.strategy == "HYBRID_SHARD" and c.front_end == "wrapper" and c.mesh[-1] == 1
        ),
        symptom=(
            "PyTorch's FSDP1 turns HYBRID_SHARD on a (replicate, 1) mesh into NO_SHARD over "
            "the shard group of one rank (_init_utils: 'switching to use NO_SHARD ... since "
            "the world size is 1') and never all-reduces across replicas: each rank keeps "
            "its own gradients. shard reduces across replicas (right). Minimal: "
            "Config(front_end='wrapper', strategy='HYBRID_SHARD', mesh=(2, 1))"
        ),
    ),
    KnownBug(
        name="torch-no-shard-frozen-unit-drops-params",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and c.strategy == "NO_SHARD"
            and c.use_orig_params
            and _some_unit_all_frozen(c)
        ),
        symptom=(
            "PyTorch's FSDP1 NO_SHARD with use_orig_params=True: a unit whose parameters are "
            "all frozen leaves them as plain tensor views after forward (no post-backward "
            "restores them), so they vanish from named_parameters(); shard keeps them "
            "Parameters (right). Minimal: Config(front_end='wrapper', strategy='NO_SHARD', "
            "frozen=('embed.weight', 'norm.weight', 'norm.bias', 'head.weight'))"
        ),
    ),
    KnownBug(
        name="torch-no-shard-no-sync-loses-unfrozen-grad",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and c.strategy == "NO_SHARD"
            and c.microbatches > 1
            and any(t.requires_grad for t in c.toggles)
        ),
        symptom=(
            "PyTorch's FSDP1 NO_SHARD (use_orig_params=True) with no_sync() micro-batches: "
            "for a parameter unfrozen after wrapping, the gradient accumulated under no_sync "
            "is lost (torch -0.0042 where a single-process reference and shard give -0.0399). "
            "Minimal: Config(front_end='wrapper', blocks=(BlockSpec(kind='lora'),), "
            "toggles=(Toggle(0, 'blocks.0.up.base.weight', True),), strategy='NO_SHARD', "
            "microbatches=2)"
        ),
    ),
    KnownBug(
        name="torch-no-shard-no-sync-tied-bf16",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and c.strategy == "NO_SHARD"
            and c.mixed_precision
            and c.microbatches > 1
            and c.tied
        ),
        symptom=(
            "PyTorch's FSDP1 NO_SHARD with bf16 MixedPrecision, tied weights and no_sync() "
            "raises in the next forward ('attempting to assign a gradient with dtype BFloat16 "
            "to a tensor with grad_dtype Float', _flat_param._use_sharded_grad_views); shard "
            "trains. Minimal: Config(front_end='wrapper', tied=True, precision='bf16', "
            "strategy='NO_SHARD', microbatches=2)"
        ),
    ),
    KnownBug(
        name="torch-fully-shard-unfreeze-frozen-unit-bf16",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "fully_shard" and c.mixed_precision and _unfreezes_a_frozen_unit(c)
        ),
        symptom=(
            "PyTorch's fully_shard with bf16 param_dtype: a unit whose parameters were all "
            "frozen at the first forward, one of them unfrozen later, raises in that backward "
            "('attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype "
            "Float', foreach_reduce); shard trains. Minimal: Config(precision='bf16', "
            "frozen=('blocks.0.norm.weight', 'blocks.0.norm.bias', 'blocks.0.up.weight', "
            "'blocks.0.up.bias', 'blocks.0.down.weight', 'blocks.0.down.bias'), "
            "toggles=(Toggle(0, 'blocks.0.norm.weight', True),))"
        ),
    ),
)
"""Every known, reported difference the CI sample avoids; see [Note: Known bugs]."""


def known_bugs_in(config: Config) -> list[str]:
    """The names of the known bugs ``config`` would run into."""
    return [bug.name for bug in KNOWN_BUGS if bug.matches(config)]
