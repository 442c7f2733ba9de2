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

from shard_testing.differential._config import (
    HYBRID,
    Config,
    _unit_of,
    ignored_names,
    parameter_names,
    side_branch_runs,
)

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


def _not_power_of_two(size: int) -> bool:
    """A group size whose collectives sum (and average) in orders that depend on where an
    element sits: see the two fully-shard entries of ``KNOWN_BUGS``."""
    return size & (size - 1) != 0


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


def _units(config: Config) -> dict[str, set[str]]:
    """Each unit's parameters (ignored ones are in none)."""
    units: dict[str, set[str]] = {}
    ignored = ignored_names(config)
    for name in parameter_names(config):
        if name not in ignored:
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
    return any(
        not (members & trainable)
        for trainable in _trainable_by_step(config)
        for members in _units(config).values()
    )


def _resumes_through_dcp(config: Config) -> bool:
    """The run resumes through ``get_state_dict``/``set_state_dict``, whose bugs these are.

    The front ends' own methods (``"native"``) are not that code.
    """
    return config.resume in ("sharded", "full")


def _fsdp1_unit_under_checkpoint_wrapper(config: Config) -> bool:
    """A wrapper unit's names carry a checkpoint_wrapper segment: the wrapper around a block's
    own unit, or inside a unit with use_orig_params=False (PyTorch's state-dict code looks
    such units' keys up by names that keep it)."""
    return any(spec.checkpoint == "wrapper" for spec in config.blocks) and (
        config.shard_blocks or not config.use_orig_params
    )


def _forward_without_backward(config: Config) -> bool:
    """The wrapper runs validation forwards with autograd on whose backward never runs."""
    return config.front_end == "wrapper" and config.evaluate and not config.eval_no_grad


def _keeps_gathered_units(config: Config) -> bool:
    """PyTorch keeps some unit gathered after a validation forward: the wrapper's root, or
    fully_shard's units (in full, or the post-forward group's rows)."""
    reshard = config.reshard_after_forward
    if config.front_end == "wrapper" or reshard is False:
        return True
    # An int equal to the shard group's size reshards fully, except 1 (a group of one).
    return not isinstance(reshard, bool) and (reshard < config.mesh[-1] or reshard == 1)


def _frozen_after_training_at_resume(config: Config) -> bool:
    """A parameter trained before the resume is frozen when ``set_state_dict`` loads the dicts."""
    if not _resumes_through_dcp(config):
        return False
    steps = _trainable_by_step(config)
    at_load = steps[config.resume_at - 1]
    return any(name not in at_load for trained in steps[: config.resume_at - 1] for name in trained)


def _trainable_without_state_at_resume(config: Config) -> bool:
    """A parameter trainable when ``set_state_dict`` loads has never had a gradient, so the
    saved optimizer state has none for it (unfrozen, then only on the side branch's odd
    steps)."""
    if config.front_end != "fully_shard" or not _resumes_through_dcp(config):
        return False  # the wrapper's optimizer state dict goes through FSDP1's own code
    steps = _trainable_by_step(config)

    def stepped(name: str) -> bool:
        return any(
            name in steps[step] and (".side." not in name or side_branch_runs(step))
            for step in range(config.resume_at)
        )

    return any(not stepped(name) for name in steps[config.resume_at - 1])


KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        name="fully-shard-reduce-layout-with-unused-params",
        culprit="shard",
        matches=lambda c: (
            c.front_end == "fully_shard"
            and any(spec.side for spec in c.blocks)
            and ((len(c.mesh) == 2 and c.mesh[0] > 2) or _not_power_of_two(c.mesh[-1]))
        ),
        symptom=(
            "fully_shard with a parameter unused in a step, over more than two ranks in one "
            "collective: the reduced gradients differ from PyTorch's in the last bit in the "
            "step that leaves the side branch unused (replicas of 4: -0.014009188860654831 "
            "vs -0.014009187929332256; a shard group of 3: -0.013190082274377346 vs "
            "-0.013190080411732197). PyTorch's FSDP2 packs only the gradients present into "
            "the reduce-scatter input; shard packs every trainable parameter's, zero-filled "
            "where absent, so an element sits elsewhere in the buffer, and gloo sums each "
            "chunk of a buffer over 3 or more ranks in an order that depends on the chunk "
            "(forcing reduce_scatter_single instead of shard's all-reduce changes nothing). "
            "Bitwise on 2 ranks, on a shard group of 4, and without unused parameters; "
            "also Config(world_size=4, mesh=(4, 1), blocks=(BlockSpec(side=True),)). "
            "Minimal: Config(world_size=3, mesh=(3,), blocks=(BlockSpec(), BlockSpec(side=True)))"
        ),
    ),
    KnownBug(
        name="torch-hybrid-shard-group-of-one",
        culprit="torch",
        matches=lambda c: c.strategy in HYBRID and c.front_end == "wrapper" and c.mesh[-1] == 1,
        symptom=(
            "PyTorch's FSDP1 turns HYBRID_SHARD (and _HYBRID_SHARD_ZERO2) on a (replicate, 1) "
            "mesh into NO_SHARD over "
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
            "restores them), so they vanish from named_parameters(); where the unit trained "
            "in an earlier step, PyTorch's next forward fails instead ('AssertionError: "
            "as_params=True type(prim_param)=<class 'torch.Tensor'>'). shard keeps them "
            "Parameters (right). With the norm ignored, freezing embed.weight and head.weight "
            "is enough. Minimal: Config(front_end='wrapper', strategy='NO_SHARD', "
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
            and c.accumulate == "no-sync"
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
        name="torch-keep-low-precision-grads-tied-orig-params",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and c.precision == "bf16-extra"
            and c.use_orig_params
            and c.tied
        ),
        symptom=(
            "PyTorch's FSDP1 with MixedPrecision(keep_low_precision_grads=True), "
            "use_orig_params=True and tied weights raises in the first backward on the ranks "
            "whose shard holds a piece of the tied parameter ('attempting to assign a gradient "
            "with dtype BFloat16 to a tensor with grad_dtype Float', "
            "_flat_param._use_sharded_grad_views) and not on the others, whose next collective "
            "then mismatches (gloo aborts the process); shard trains. Minimal: "
            "Config(front_end='wrapper', tied=True, precision='bf16-extra', "
            "use_orig_params=True)"
        ),
    ),
    KnownBug(
        name="torch-adamw-low-precision-grads-some-ranks",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper" and c.precision == "bf16-extra" and c.optimizer == "adamw"
        ),
        symptom=(
            "FSDP1 keep_low_precision_grads leaves bf16 gradients on fp32 parameters; AdamW "
            "refuses them ('expected dtype float for `end` but got dtype c10::BFloat16'), but "
            "only on the ranks whose shard holds a trainable piece (with most parameters "
            "frozen, not every rank does), so the other ranks' next collective loses its peer "
            "and the run crashes. shard raises the same error in the same step "
            "(test_keep_low_precision_grads_matches_pytorch). Minimal: "
            "Config(front_end='wrapper', world_size=4, mesh=(4,), precision='bf16-extra', "
            "optimizer='adamw')"
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
            and c.accumulate == "no-sync"
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
    KnownBug(
        name="torch-fully-shard-requires-grad-on-unsharded-face",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "fully_shard"
            and c.evaluate
            and bool(c.toggles)
            and c.reshard_after_forward is not True
        ),
        symptom=(
            "PyTorch's fully_shard with reshard_after_forward=False (or an int): after a "
            "forward under torch.no_grad() the module's parameters are the unsharded ones, so "
            "requires_grad_ on what named_parameters() gives lands there and is forgotten: "
            "an unfreeze gives no gradient, a freeze holds for one step and the parameter "
            "trains again in the next. shard carries the flag to the sharded parameter "
            "(right: test_flags_set_on_the_unsharded_face_are_kept). Minimal: "
            "Config(steps=3, toggles=(Toggle(0, 'blocks.0.up.weight', False),), "
            "reshard_after_forward=False, evaluate=True)"
        ),
    ),
    KnownBug(
        name="torch-dcp-drops-frozen-optimizer-state",
        culprit="torch",
        matches=_frozen_after_training_at_resume,
        symptom=(
            "PyTorch's set_optimizer_state_dict (torch.distributed.checkpoint.state_dict) "
            "skips every parameter with requires_grad=False when it loads: the saved state of "
            "a parameter trained and then frozen is silently dropped (the saved dict has it), "
            "so unfreezing it later restarts its moments (pytorch/pytorch#192202, fix proposed "
            "in #192307). shard loads what was saved (right). Minimal: "
            "Config(steps=3, toggles=(Toggle(0, 'blocks.0.up.weight', False),), "
            "resume='sharded', resume_at=2)"
        ),
    ),
    KnownBug(
        name="torch-dcp-refuses-state-missing-for-unstepped-param",
        culprit="torch",
        matches=_trainable_without_state_at_resume,
        symptom=(
            "PyTorch's set_optimizer_state_dict (torch.distributed.checkpoint.state_dict) "
            "under fully_shard raises 'Missing optimizer state for parameter ... The "
            "parameter requires gradients but has no saved optimizer state' when a "
            "trainable parameter never had a gradient before the save (unfrozen, then "
            "unused), although the optimizer had no state for it to save and torch.optim's "
            "own load_state_dict accepts that. "
            "shard loads the dicts and trains on (right). Minimal: Config(blocks="
            "(BlockSpec(side=True),), frozen=('blocks.0.side.weight',), toggles=(Toggle(0, "
            "'blocks.0.side.weight', True),), steps=3, resume='sharded', resume_at=2)"
        ),
    ),
    KnownBug(
        name="torch-fsdp1-low-precision-grads-optimizer-state-dict",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and c.use_orig_params
            and c.precision == "bf16-extra"
            and c.resume != "none"
            and bool(c.frozen or c.toggles)
        ),
        symptom=(
            "PyTorch's FSDP1 optimizer state dict with use_orig_params=True and "
            "MixedPrecision(keep_low_precision_grads=True), when a rank's shard holds no "
            "trainable piece (most parameters frozen): 'AssertionError: Expected dtype == "
            "info.dtype, got torch.float32 != torch.bfloat16' (fsdp/_optim_utils.py, "
            "_convert_all_state_info; not raised when every rank holds a trainable piece). "
            "shard gives the state dict. Minimal: "
            "Config(front_end='wrapper', shard_blocks=False, frozen=('embed.weight', "
            "'blocks.0.norm.weight', 'blocks.0.norm.bias', 'blocks.0.up.weight', "
            "'blocks.0.up.bias', 'blocks.0.down.weight', 'blocks.0.down.bias', 'norm.weight', "
            "'norm.bias'), precision='bf16-extra', resume='sharded')"
        ),
    ),
    KnownBug(
        name="torch-dcp-fsdp1-checkpoint-wrapper-optimizer-load",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and _resumes_through_dcp(c)
            and _fsdp1_unit_under_checkpoint_wrapper(c)
        ),
        symptom=(
            "PyTorch's set_state_dict cannot load the optimizer state get_state_dict gave "
            "for FSDP1 units under checkpoint_wrapper (around a block's own unit, or inside "
            "a unit with use_orig_params=False): 'Missing optimizer state for parameter "
            "blocks.0._fsdp_wrapped_module.norm.weight' (it looks the state up by a name "
            "that keeps a wrapper segment the saved names do not have; cf. "
            "pytorch/pytorch#124546). shard saves the plain model's names and loads them. "
            "Minimal: Config(front_end='wrapper', blocks=(BlockSpec(checkpoint='wrapper'),), "
            "resume='sharded')"
        ),
    ),
    KnownBug(
        name="torch-broadcast-from-rank0-fsdp1-checkpoint-wrapper",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and c.init == "meta"
            and _fsdp1_unit_under_checkpoint_wrapper(c)
        ),
        symptom=(
            "PyTorch's set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True) "
            "fails on every rank but 0 for FSDP1 units under checkpoint_wrapper (around a "
            "block's own unit, or inside a unit with use_orig_params=False): 'Error(s) in "
            "loading state_dict for FullyShardedDataParallel: Missing key(s) in state_dict: "
            '"blocks.0.norm.weight", ...\', while rank 0 loads and goes on into the first '
            "all-gather alone (the tester keeps the ranks in step after the build, so the run "
            "ends instead of hanging). shard loads on every rank. "
            "Minimal: Config(front_end='wrapper', blocks=(BlockSpec(checkpoint='wrapper'),), "
            "init='meta')"
        ),
    ),
    KnownBug(
        name="torch-fsdp1-param-init-fn-unties",
        culprit="torch",
        matches=lambda c: c.front_end == "wrapper" and c.init == "meta" and c.tied,
        symptom=(
            "PyTorch's FSDP1 calls param_init_fn on one module at a time, and the one "
            "accelerate and transformers pass (to_empty(device=..., recurse=False)) gives the "
            "tied head its own tensor: PyTorch then trains head.weight and embed.weight as two "
            "parameters (named_parameters lists both; with sync_module_states the broadcast "
            "fails or hangs: pytorch/pytorch#143181, worked around by "
            "huggingface/accelerate#3154). shard ties them again after param_init_fn (see "
            "[Note: Meta materialisation keeps ties] in shard_runtime/_wrapper_init.py). "
            "Minimal: Config(front_end='wrapper', tied=True, init='meta')"
        ),
    ),
    KnownBug(
        name="torch-fsdp1-ignored-module-meta-load",
        culprit="torch",
        matches=lambda c: c.front_end == "wrapper" and c.init == "meta" and c.ignored != "none",
        symptom=(
            "PyTorch's FSDP1 with a module in ignored_states and the model built on the meta "
            "device: param_init_fn is not called on the ignored module, and "
            "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True) leaves it "
            "without rank 0's values: the first loss is nan on every rank (torch nan, shard "
            "2.303035259246826). shard gives the meta tensors storage and assigns the values "
            "(the same run from eager weights is bitwise shard's). "
            "Minimal: Config(front_end='wrapper', init='meta', ignored='norm')"
        ),
    ),
    KnownBug(
        name="torch-fully-shard-shard1-post-forward-group",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "fully_shard"
            and c.placement == "dim1"
            and not isinstance(c.reshard_after_forward, bool)
            and 1 < c.reshard_after_forward < c.mesh[-1]
        ),
        symptom=(
            "PyTorch's fully_shard with Shard(1) parameters (shard_placement_fn) and an int "
            "reshard_after_forward between 1 and the shard group's size: the first forward "
            "fails on some ranks in to_sharded_post_forward ('setStorage: sizes [6, 8], "
            "strides [8, 1], storage offset 0, and itemsize 4 requiring a storage size of "
            "192 are out of bounds for storage of size 176') and the other ranks wait in "
            "the next all-gather until the collective timeout. shard trains. Not drawn by "
            "the generator (each would hang a fuzzing run for a minute). "
            "Minimal: Config(world_size=4, mesh=(4,), reshard_after_forward=2, placement='dim1')"
        ),
    ),
    KnownBug(
        name="torch-fsdp1-forward-without-backward-lists-views",
        culprit="torch",
        matches=lambda c: _forward_without_backward(c) and c.use_orig_params and bool(c.toggles),
        symptom=(
            "PyTorch's FSDP1 with use_orig_params=True, after a forward with autograd on "
            "whose backward never runs (a loss computed for logging without "
            "torch.no_grad()): named_parameters() gives the units' unsharded views, which "
            "are not leaves, so requires_grad_ on them raises 'you can only change "
            "requires_grad flags of leaf variables' (units that stay unsharded: the root, "
            "SHARD_GRAD_OP, NO_SHARD), or, in a unit that was wholly frozen, an unfreeze "
            "lands on the view (a leaf of its own there) and the parameter gets no gradient "
            "in the next step. shard lists the original parameters (right: "
            "test_a_forward_without_backward_keeps_named_parameters). Minimal: "
            "Config(front_end='wrapper', blocks=(BlockSpec(),) * 3, toggles=(Toggle(0, "
            "'embed.weight', False),), strategy='SHARD_GRAD_OP', evaluate=True, "
            "eval_no_grad=False)"
        ),
    ),
    KnownBug(
        name="torch-fsdp1-forward-without-backward-mixed-precision",
        culprit="torch",
        matches=lambda c: _forward_without_backward(c) and c.mixed_precision,
        symptom=(
            "PyTorch's FSDP1 under MixedPrecision, after a forward with autograd on whose "
            "backward never runs: the next step's backward leaves every gradient None "
            "(use_orig_params=True; clip_grad_norm_ gives 0.0), or the optimizer step fails "
            "with 'The size of tensor a (244) must match the size of tensor b (488)' (the "
            "flat gradient left at the unsharded size; use_orig_params=False). In fp32 "
            "PyTorch trains on. shard trains as after a no_grad evaluation (right: "
            "test_a_forward_without_backward_changes_nothing). Minimal: "
            "Config(front_end='wrapper', shard_blocks=False, precision='bf16', "
            "use_orig_params=False, evaluate=True, eval_no_grad=False)"
        ),
    ),
    KnownBug(
        name="torch-fsdp1-compile-again-kept-grad",
        culprit="torch",
        matches=lambda c: (
            c.front_end == "wrapper"
            and c.compile
            and c.use_orig_params
            and not c.set_to_none
            and c.steps > 1
            and (c.evaluate or any(spec.side for spec in c.blocks))
        ),
        symptom=(
            "PyTorch's FSDP1 (use_orig_params=True) with compiled blocks and gradients kept "
            "between steps (zero_grad(set_to_none=False)): when Dynamo compiles a block "
            "again after the first step (the side branch switches, or model.eval() for a "
            "validation forward), it fails in the forward with InternalTorchDynamoError "
            "'attempting to assign a gradient of size [184] to a tensor of size [368]' (the "
            "flat parameter is unsharded, its kept gradient sharded) or, in bf16, 'a "
            "gradient with dtype float to a tensor with grad_dtype BFloat16'. shard's "
            "compiled blocks train as its eager ones (right: "
            "test_blocks_compiled_again_after_a_step_train_as_eager_ones). Minimal: "
            "Config(front_end='wrapper', blocks=(BlockSpec(side=True),), set_to_none=False, "
            "compile=True)"
        ),
    ),
    KnownBug(
        name="torch-kept-unsharded-copy-reused-after-write",
        culprit="torch",
        matches=lambda c: c.evaluate and c.eval_swap and _keeps_gathered_units(c),
        symptom=(
            "PyTorch's FSDP1 (the root, under every strategy; every unit under "
            "SHARD_GRAD_OP and NO_SHARD) and FSDP2 (reshard_after_forward=False; an int "
            "below the shard group's size, or 1, keeps the post-forward group's rows) keep the "
            "units a validation forward gathered, and the next training forward reuses that "
            "copy even though the parameters were written in between: weights swapped in "
            "for the evaluation and restored after it (an EMA callback) stay in effect for "
            "the next forward, whose loss and gradients belong to the swapped-in values "
            "(an optimizer step or load_state_dict after the evaluation is lost the same "
            "way). shard gathers again when the shards were written (right: "
            "test_weights_swapped_around_evaluation_change_nothing, test_kept_copy.py). "
            "Minimal: Config(front_end='wrapper', evaluate=True, eval_swap=True)"
        ),
    ),
)
"""Every known, reported difference the CI sample avoids; see [Note: Known bugs]."""


def known_bugs_in(config: Config) -> list[str]:
    """The names of the known bugs ``config`` would run into."""
    return [bug.name for bug in KNOWN_BUGS if bug.matches(config)]
