"""The differential tester on a fixed sample: shard trains exactly as PyTorch's FSDP does.

Hypothesis draws the configurations (``derandomize=True``: the same sample on
every run and machine) and shrinks a failing one; the failure message ends
with the shrunk configuration as a standalone script. Configurations that
run into a known, reported bug (``KNOWN_BUGS``) are skipped; see
[Note: Known bugs] in ``shard_testing/differential/_known.py``. The explicit
``@example`` cases pin the dimensions the issue lists, whatever the draw.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, assume, example, given, settings

from shard_testing import RankPool
from shard_testing.differential import (
    BlockSpec,
    Config,
    Toggle,
    config_strategy,
    first_discrepancy,
    known_bugs_in,
    run_config,
)
from shard_testing.differential._compare import compare_traces
from shard_testing.differential._run import run_impl


def assert_agrees(pool: RankPool, config: Config) -> None:
    """Run ``config`` under both libraries; fail with every rank's report and the script."""
    outcomes = run_config(pool, config)
    first = first_discrepancy(outcomes)
    if first is not None:
        reports = "\n".join(outcome.report() for outcome in outcomes)
        raise AssertionError(
            f"shard differs from PyTorch: {first}\n{reports}\n"
            f"configuration: {config.brief()}\n"
            f"standalone reproduction (python <file>):\n{config.to_script()}"
        )


SAMPLE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

LORA = BlockSpec(kind="lora")
# Every parameter but the head's, in a one-block model: block 0 is a wholly frozen unit.
_ALL_BUT_HEAD = (
    "embed.weight",
    *(
        f"blocks.0.{layer}.{kind}"
        for layer in ("norm", "up", "down")
        for kind in ("weight", "bias")
    ),
    "norm.weight",
    "norm.bias",
)


@settings(SAMPLE, max_examples=50)
@given(config_strategy((2,)))
# requires_grad_ after sharding, both directions, in a LoRA unit and a plain one
@example(
    Config(
        blocks=(LORA, BlockSpec()),
        steps=3,
        toggles=(
            Toggle(0, "blocks.0.up.base.weight", True),
            Toggle(0, "blocks.1.down.weight", False),
            Toggle(1, "blocks.1.down.weight", True),
        ),
    )
)
@example(
    Config(
        front_end="wrapper",
        blocks=(LORA,),
        steps=3,
        toggles=(
            Toggle(0, "blocks.0.up.base.bias", True),
            Toggle(1, "blocks.0.up.a.weight", False),
        ),
    )
)
# LoRA fine-tuning and bias/norm-only training, frozen before sharding
@example(Config(blocks=(LORA, LORA), frozen=("embed.weight", "head.weight"), optimizer="adamw"))
@example(
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(), BlockSpec()),
        frozen=("blocks.0.up.weight", "blocks.0.down.weight", "blocks.1.up.weight"),
    )
)
# tied weights, a branch unused on odd steps, both kinds of activation checkpointing
@example(
    Config(
        tied=True,
        blocks=(BlockSpec(checkpoint="inner", side=True), BlockSpec(checkpoint="wrapper")),
        steps=3,
    )
)
@example(
    Config(
        front_end="wrapper",
        tied=True,
        blocks=(BlockSpec(checkpoint="inner", side=True), BlockSpec(checkpoint="wrapper")),
        steps=3,
    )
)
# mixed precision, accumulation without sync, clipping, CPU offload
@example(
    Config(precision="bf16-reduce-fp32", microbatches=2, clip=0.5, optimizer="adamw", offload=True)
)
@example(Config(precision="bf16-extra", reshard_after_forward=False, microbatches=2))
@example(Config(front_end="wrapper", precision="bf16", microbatches=2, strategy="SHARD_GRAD_OP"))
# accumulation the other ways: every micro-batch reducing (NO_SHARD all-reduces the gradient it
# holds with the new one: seed 2801), kept gathered between micro-batches, replicas reduced last
@example(
    Config(
        front_end="wrapper",
        shard_blocks=False,
        strategy="NO_SHARD",
        microbatches=2,
        accumulate="sync",
    )
)
@example(Config(blocks=(LORA, BlockSpec()), microbatches=2, accumulate="no-sync-keep", steps=3))
@example(
    Config(world_size=4, mesh=(2, 2), blocks=(LORA,), microbatches=2, accumulate="no-all-reduce")
)
# FSDP1's flat parameters, the other strategies, prefetch options
@example(
    Config(
        front_end="wrapper",
        use_orig_params=False,
        strategy="NO_SHARD",
        clip=0.5,
        blocks=(BlockSpec(), BlockSpec()),
        backward_prefetch="BACKWARD_POST",
        forward_prefetch=True,
    )
)
@example(Config(blocks=(BlockSpec(), BlockSpec(), BlockSpec()), prefetch="explicit"))
# the wrapper's CPU offload (shard only) under no_sync with low-precision gradients kept,
# clipping, no limit on all-gathers; a LoRA unit (frozen and trainable original parameters)
@example(
    Config(
        front_end="wrapper",
        blocks=(LORA, BlockSpec()),
        precision="bf16-extra",
        offload=True,
        microbatches=2,
        clip=0.5,
        limit_all_gathers=False,
        forward_prefetch=True,
    )
)
# resuming mid-run from sharded and full state dicts, crossed with a validation forward,
# LoRA, toggles, AdamW, accumulation, mixed precision and both front ends
@example(
    Config(
        blocks=(LORA, BlockSpec()),
        steps=3,
        toggles=(Toggle(0, "blocks.0.up.base.weight", True),),  # its state comes last
        optimizer="adamw",
        evaluate=True,
        resume="sharded",
        resume_at=2,
    )
)
@example(
    Config(
        precision="bf16",
        microbatches=2,
        tied=True,
        resume="full",
        evaluate=True,
        param_groups=True,
        optimizer="adamw",
    )
)
@example(
    Config(
        front_end="wrapper",
        blocks=(LORA,),
        optimizer="adamw",
        resume="sharded",
        evaluate=True,
        param_groups=True,
    )
)
@example(
    Config(
        front_end="wrapper",
        use_orig_params=False,
        strategy="SHARD_GRAD_OP",
        optimizer="adamw",
        resume="full",
        offload=True,
    )
)
# the front end's own state dicts loaded back into the same model after an evaluation that
# left units gathered (fully_shard's load_state_dict raised before its pre-load reshard)
@example(
    Config(reshard_after_forward=False, steps=3, evaluate=True, resume="in-place", resume_at=2)
)
@example(
    Config(
        front_end="wrapper",
        strategy="SHARD_GRAD_OP",
        blocks=(LORA,),
        optimizer="adamw",
        evaluate=True,
        resume="in-place",
    )
)
# checkpoint_wrapper inside the root unit: state dicts keyed without its segment
@example(
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(checkpoint="wrapper"), BlockSpec()),
        shard_blocks=False,
        optimizer="adamw",
        resume="sharded",
    )
)
# zero_grad(set_to_none=False) crossed with a freeze between steps: the wrapper drops the
# frozen parameter's zero gradient (so momentum stops moving it); fully_shard keeps it
@example(
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(), BlockSpec()),
        toggles=(Toggle(0, "embed.weight", False),),
        set_to_none=False,
    )
)
@example(
    Config(
        blocks=(LORA, BlockSpec(side=True)),
        steps=3,
        toggles=(Toggle(0, "blocks.0.up.a.weight", False),),
        set_to_none=False,
        microbatches=2,
    )
)
# A unit kept gathered through a validation forward (SHARD_GRAD_OP), wholly frozen, then
# partly unfrozen: the next forward's views must carry gradients again
@example(
    Config(
        front_end="wrapper",
        frozen=_ALL_BUT_HEAD,
        toggles=(Toggle(0, "blocks.0.norm.weight", True),),
        strategy="SHARD_GRAD_OP",
        evaluate=True,
    )
)
# A wrapper unit wholly frozen between steps (the root: embedding and head tied, norm frozen)
# with zero_grad(set_to_none=False): its parameters' zero gradients go, so momentum stops
@example(
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(side=True),),
        tied=True,
        frozen=("norm.weight", "norm.bias"),
        toggles=(Toggle(0, "embed.weight", False),),
        set_to_none=False,
    )
)
# The same for the root and a unit that is not the root (block 0), both wholly frozen
@example(
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(), BlockSpec(), BlockSpec(kind="lora", side=True)),
        tied=True,
        frozen=(
            *(f"blocks.0.{n}" for n in ("norm.bias", "up.weight", "up.bias", "down.weight")),
            "blocks.0.down.bias",
            "norm.weight",
            "norm.bias",
        ),
        toggles=(Toggle(0, "embed.weight", False), Toggle(0, "blocks.0.norm.weight", False)),
        set_to_none=False,
    )
)
# Weights swapped in around a validation forward where PyTorch gathers again too
@example(Config(blocks=(BlockSpec(), BlockSpec()), evaluate=True, eval_swap=True, clip=0.5))
# Built on meta, loaded from rank 0's full state dict; the final norm kept out of sharding
@example(
    Config(
        init="meta",
        tied=True,
        blocks=(LORA, BlockSpec()),
        frozen=("blocks.1.up.weight",),
        optimizer="adamw",
        resume="full",
        steps=3,
    )
)
@example(Config(front_end="wrapper", init="meta", blocks=(LORA,), offload=True, buffers=True))
@example(Config(init="meta", ignored="norm", precision="bf16", reshard_after_forward=False))
@example(
    Config(
        ignored="norm", microbatches=2, resume="sharded", optimizer="adamw", steps=3, buffers=True
    )
)
@example(Config(front_end="wrapper", ignored="norm", auto_wrap=True, strategy="SHARD_GRAD_OP"))
# Shard(1) through shard_placement_fn, crossed with LoRA, ties and a sharded resume
@example(
    Config(
        placement="dim1",
        blocks=(LORA, BlockSpec()),
        tied=True,
        resume="sharded",
        optimizer="adamw",
        steps=3,
    )
)
# BACKWARD_POST after a forward whose backward never ran: the end-of-backward callback
# reduces the units and must leave no prefetch in flight past the optimizer step
@example(
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(), BlockSpec()),
        backward_prefetch="BACKWARD_POST",
        steps=3,
        evaluate=True,
        eval_no_grad=False,
    )
)
@example(
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(), BlockSpec()),
        strategy="SHARD_GRAD_OP",
        backward_prefetch="BACKWARD_POST",
        steps=3,
        evaluate=True,
        eval_no_grad=False,
    )
)
# Compiled blocks (aot_eager): LoRA under a checkpoint wrapper, resumed; the wrapper's flat
# parameters in bf16
@example(
    Config(
        compile=True,
        blocks=(LORA, BlockSpec(checkpoint="wrapper", side=True)),
        resume="sharded",
        optimizer="adamw",
        steps=3,
    )
)
@example(
    Config(
        front_end="wrapper",
        compile=True,
        blocks=(BlockSpec(checkpoint="wrapper"), LORA),
        use_orig_params=False,
        precision="bf16",
        evaluate=True,
    )
)
def test_sample_on_two_ranks(rank_pool: RankPool, config: Config) -> None:
    """A fixed sample of 2-rank configurations agrees step by step (bitwise in fp32)."""
    assume(not known_bugs_in(config))
    assert_agrees(rank_pool, config)


@settings(SAMPLE, max_examples=8)
@given(config_strategy((4,)))
# HSDP on a 2 x 2 mesh, both front ends; an int reshard_after_forward (2 of 4 ranks)
@example(Config(world_size=4, mesh=(2, 2), blocks=(LORA, BlockSpec()), microbatches=2))
@example(Config(front_end="wrapper", world_size=4, mesh=(2, 2), strategy="HYBRID_SHARD", clip=0.5))
@example(
    Config(
        front_end="wrapper",
        world_size=4,
        mesh=(2, 2),
        strategy="_HYBRID_SHARD_ZERO2",
        microbatches=2,
        offload=True,
    )
)
@example(
    Config(
        world_size=4,
        mesh=(4,),
        reshard_after_forward=2,
        prefetch="explicit",
        blocks=(BlockSpec(), BlockSpec()),
    )
)
@example(
    Config(
        front_end="wrapper",
        world_size=4,
        mesh=(2, 2),
        strategy="HYBRID_SHARD",
        optimizer="adamw",
        resume="sharded",
    )
)
@example(Config(world_size=4, mesh=(2, 2), optimizer="adamw", resume="full", evaluate=True))
@example(
    Config(world_size=4, mesh=(2, 2), placement="dim1", microbatches=2, accumulate="no-all-reduce")
)
@example(
    Config(
        world_size=4,
        mesh=(2, 2),
        compile=True,
        blocks=(BlockSpec(), LORA),
        prefetch="explicit",
        microbatches=2,
        accumulate="no-sync-keep",
    )
)
def test_sample_on_four_ranks(rank_pool: RankPool, config: Config) -> None:
    """A fixed sample of 4-rank configurations agrees: 2-D meshes, int reshard_after_forward."""
    assume(not known_bugs_in(config))
    assert_agrees(rank_pool, config)


@pytest.mark.parametrize(
    "config",
    [
        # FSDP2 averages in each collective: a deferred replica all-reduce adds averaged partials.
        Config(world_size=3, mesh=(1, 3), microbatches=2, accumulate="no-all-reduce"),
        # FSDP1's HYBRID_SHARD divides once over every data-parallel rank, split around the sum.
        Config(front_end="wrapper", world_size=3, mesh=(1, 3), strategy="HYBRID_SHARD"),
    ],
    ids=["fully-shard-deferred-all-reduce", "wrapper-hybrid"],
)
def test_a_shard_group_of_three_on_a_2d_mesh(rank_pool: RankPool, config: Config) -> None:
    """A shard group that is not a power of two divides where each PyTorch FSDP divides."""
    assert not known_bugs_in(config)
    assert_agrees(rank_pool, config)


@pytest.mark.parametrize(
    "config",
    [
        Config(front_end="wrapper", use_orig_params=False, blocks=(LORA,)),
        Config(front_end="wrapper", use_orig_params=False, frozen=("blocks.0.up.weight",)),
    ],
    ids=["lora-unit", "half-frozen-unit"],
)
def test_refused_configurations_are_refused_alike(rank_pool: RankPool, config: Config) -> None:
    """FSDP1 flat parameters with mixed requires_grad: both libraries raise the same type."""
    outcomes = run_config(rank_pool, config)
    assert first_discrepancy(outcomes) is None
    assert all(outcome.status == "both raised ValueError in build" for outcome in outcomes)


def _shard_against_shard(reference: Config, config: Config, eval_loss: bool = True) -> list[str]:
    """shard training ``config`` against shard training ``reference``: every discrepancy.

    Where PyTorch fails, shard's own run of the plain variant is the reference. State-dict
    keys are not compared (only a resumed run has them), nor, without ``eval_loss``, the
    validation losses.
    """
    with warnings.catch_warnings():
        # As compare_on_rank: a warning one rank gives (clip_grad_norm_ on a rank without
        # gradients) must not end that rank's run alone.
        warnings.simplefilter("ignore")
        expected = run_impl(reference, "shard")
        actual = run_impl(config, "shard")
    assert expected.error is None, expected.error
    assert actual.error is None, actual.error
    for snapshot in (*expected.steps, *actual.steps):
        snapshot.state_keys = ()
        if not eval_loss:
            snapshot.eval_loss = None
    found, _ = compare_traces(expected, actual, rank=dist.get_rank(), exact=True)
    return [str(d) for d in found]


def _resumed_against_uninterrupted(config: Config) -> list[str]:
    """shard resuming at ``config.resume_at`` against shard training straight through."""
    return _shard_against_shard(dataclasses.replace(config, resume="none"), config)


_UNDER_CHECKPOINT_WRAPPER = [
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(checkpoint="wrapper"), BlockSpec()),
        use_orig_params=orig,
        optimizer="adamw",
        steps=3,
        resume=resume,
        resume_at=2,
    )
    for orig in (True, False)
    for resume in ("sharded", "full")
]


@pytest.mark.parametrize(
    "config",
    _UNDER_CHECKPOINT_WRAPPER,
    ids=["orig-sharded", "orig-full", "flat-sharded", "flat-full"],
)
def test_resuming_wrapper_units_under_checkpoint_wrapper_changes_nothing(
    rank_pool: RankPool, config: Config
) -> None:
    """Where PyTorch cannot load its own state dicts (torch-dcp-fsdp1-checkpoint-wrapper-
    optimizer-load), shard resumed trains bit for bit as shard uninterrupted."""
    assert "torch-dcp-fsdp1-checkpoint-wrapper-optimizer-load" in known_bugs_in(config)
    assert rank_pool.run(_resumed_against_uninterrupted, 2, config) == [[], []]


def _dropped_graph_against_no_grad(config: Config) -> list[str]:
    """shard evaluating with autograd on (graph dropped) against shard under no_grad."""
    return _shard_against_shard(dataclasses.replace(config, eval_no_grad=True), config)


_FORWARD_WITHOUT_BACKWARD = [
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(), BlockSpec()),
        shard_blocks=shard_blocks,
        precision="bf16",
        use_orig_params=orig,
        strategy=strategy,
        toggles=(Toggle(0, "embed.weight", False),) if orig else (),
        clip=0.5,
        steps=3,
        evaluate=True,
        eval_no_grad=False,
    )
    for orig, shard_blocks, strategy in (
        (True, False, "FULL_SHARD"),
        (True, True, "SHARD_GRAD_OP"),
        (False, False, "FULL_SHARD"),
    )
]
# A wholly frozen unit kept gathered, then partly unfrozen: PyTorch sets the flag on a view
_FORWARD_WITHOUT_BACKWARD.append(
    Config(
        front_end="wrapper",
        frozen=_ALL_BUT_HEAD,
        toggles=(Toggle(0, "blocks.0.norm.weight", True),),
        strategy="SHARD_GRAD_OP",
        clip=0.5,
        evaluate=True,
        eval_no_grad=False,
    )
)


@pytest.mark.parametrize(
    "config",
    _FORWARD_WITHOUT_BACKWARD,
    ids=["orig-root", "orig-grad-op", "flat-root", "orig-unfreeze"],
)
def test_a_forward_without_backward_changes_nothing(rank_pool: RankPool, config: Config) -> None:
    """Where PyTorch's FSDP1 fails after a forward whose backward never runs (the two
    torch-fsdp1-forward-without-backward bugs), shard trains bit for bit as it does after
    the same evaluation under torch.no_grad()."""
    assert any("forward-without-backward" in name for name in known_bugs_in(config))
    assert rank_pool.run(_dropped_graph_against_no_grad, 2, config) == [[], []]


def _swapped_against_plain(config: Config) -> list[str]:
    """shard swapping weights around its evaluations against shard evaluating as they are
    (the validation losses differ, by design; the training must not)."""
    plain = dataclasses.replace(config, eval_swap=False)
    return _shard_against_shard(plain, config, eval_loss=False)


_SWAPPED_AROUND_EVALUATION = [
    Config(
        front_end="wrapper",
        blocks=(BlockSpec(), BlockSpec()),
        steps=3,
        evaluate=True,
        eval_swap=True,
        optimizer="adamw",
    ),
    Config(
        front_end="wrapper",
        strategy="SHARD_GRAD_OP",
        use_orig_params=False,
        steps=3,
        evaluate=True,
        eval_swap=True,
        eval_no_grad=False,
    ),
    Config(
        reshard_after_forward=False,
        precision="bf16",
        steps=3,
        evaluate=True,
        eval_swap=True,
        clip=0.5,
    ),
]


@pytest.mark.parametrize(
    "config", _SWAPPED_AROUND_EVALUATION, ids=["wrapper-root", "wrapper-grad-op", "kept"]
)
def test_weights_swapped_around_evaluation_change_nothing(
    rank_pool: RankPool, config: Config
) -> None:
    """Where PyTorch trains the next forward on the weights swapped in for the evaluation
    (torch-kept-unsharded-copy-reused-after-write), shard trains bit for bit as without
    the swap."""
    assert "torch-kept-unsharded-copy-reused-after-write" in known_bugs_in(config)
    assert rank_pool.run(_swapped_against_plain, 2, config) == [[], []]


def _compiled_against_eager(config: Config) -> list[str]:
    """shard with its blocks compiled against shard running them eagerly."""
    return _shard_against_shard(dataclasses.replace(config, compile=False), config)


_COMPILED_AFTER_A_STEP = [
    Config(front_end="wrapper", blocks=(BlockSpec(side=True),), set_to_none=False, steps=3),
    Config(
        front_end="wrapper",
        blocks=(LORA, BlockSpec()),
        strategy="SHARD_GRAD_OP",
        precision="bf16-reduce-fp32",
        set_to_none=False,
        evaluate=True,
        optimizer="adamw",
    ),
]


@pytest.mark.parametrize("config", _COMPILED_AFTER_A_STEP, ids=["side-branch", "evaluate"])
def test_blocks_compiled_again_after_a_step_train_as_eager_ones(
    rank_pool: RankPool, config: Config
) -> None:
    """Where PyTorch's FSDP1 fails to compile a block again once gradients are kept
    (torch-fsdp1-compile-again-kept-grad), shard's compiled blocks train bit for bit as
    its eager ones."""
    compiled = dataclasses.replace(config, compile=True)
    assert "torch-fsdp1-compile-again-kept-grad" in known_bugs_in(compiled)
    assert rank_pool.run(_compiled_against_eager, 2, compiled) == [[], []]
