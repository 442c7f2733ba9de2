"""The differential tester's own machinery: drawing, comparing, scripts, the known-bug list.

A tester that cannot fail proves nothing: these tests inject differences and
check that the comparison reports them, check that PyTorch against itself
is bitwise equal (so that any difference the sample reports is shard's),
and run a rendered reproduction script.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from shard_testing import RankPool
from shard_testing.differential import (
    KNOWN_BUGS,
    BlockSpec,
    Config,
    Toggle,
    draw_config,
    known_bugs_in,
    signature,
)
from shard_testing.differential._compare import Snapshot, Trace, compare_traces, differs
from shard_testing.differential._config import HYBRID, parameter_names, random_pick
from shard_testing.differential._models import Net
from shard_testing.differential._run import run_impl

DRAWN = [draw_config(random_pick(seed)) for seed in range(300)]

# ---------------------------------------------------------------------- drawing


def test_parameter_names_follow_the_model() -> None:
    """parameter_names (used to draw frozen sets and toggles) is Net's named_parameters."""
    for config in DRAWN[:100]:
        model = Net(config)
        assert [name for name, _ in model.named_parameters()] == parameter_names(config)
        lora_bases = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert lora_bases == {n for n in parameter_names(config) if ".up.base." in n}


def test_drawn_configurations_keep_to_what_pytorch_accepts() -> None:
    """Only the combinations the generator promises: see [Note: Drawing configurations]."""
    for config in DRAWN:
        assert math.prod(config.mesh) == config.world_size
        names = set(parameter_names(config))
        assert set(config.frozen) <= names
        assert {t.name for t in config.toggles} <= names
        assert all(0 <= t.after_step < config.steps - 1 for t in config.toggles)
        if config.front_end == "wrapper":
            assert (config.strategy in HYBRID) == (len(config.mesh) == 2)
            assert config.use_orig_params or not (config.toggles or config.param_groups)
        elif not isinstance(config.reshard_after_forward, bool):
            assert config.mesh[-1] % config.reshard_after_forward == 0
        assert 1 <= config.resume_at < config.steps
    dimensions = ("front_end", "precision", "toggles", "freeze", "resume", "evaluate")
    dimensions += ("param_groups", "set_to_none", "eval_no_grad", "eval_swap", "accumulate")
    dimensions += ("init", "ignored", "buffers")
    values: dict[str, set[str]] = {dimension: set() for dimension in dimensions}
    for config in DRAWN:
        for dimension, seen in values.items():
            seen.add(config.dimensions()[dimension])
    assert values["toggles"] == {"none", "freeze", "unfreeze", "freeze+unfreeze"}
    assert values["freeze"] == {"none", "adapters", "bias-norm", "units", "subset"}
    assert len(values["precision"]) == 4
    assert values["resume"] == {"none", "sharded", "full", "native", "in-place"}
    assert values["accumulate"] == {"-", "no-sync", "sync", "no-sync-keep", "no-all-reduce"}
    assert values["evaluate"] == values["param_groups"] == {"False", "True"}
    assert values["set_to_none"] == values["eval_no_grad"] == {"False", "True"}
    assert values["eval_swap"] == {"False", "True"}
    assert values["init"] == {"eager", "meta"}
    assert values["ignored"] == {"none", "norm"}
    assert values["buffers"] == {"False", "True"}
    placements = {c.placement for c in DRAWN if c.front_end == "fully_shard"}
    assert placements == {"dim0", "dim1"}
    assert all(c.placement == "dim0" for c in DRAWN if c.front_end == "wrapper")
    # See torch-fully-shard-shard1-post-forward-group: never drawn.
    assert not [
        c
        for c in DRAWN
        if c.placement == "dim1"
        and (
            not isinstance(c.reshard_after_forward, bool)
            and 1 < c.reshard_after_forward < c.mesh[-1]
        )
    ]
    assert all(
        config.evaluate or (config.eval_no_grad and not config.eval_swap) for config in DRAWN
    )
    # What each accumulation switches off exists only where it is drawn.
    for config in DRAWN:
        if config.microbatches == 1:
            assert config.accumulate == "no-sync"
        elif config.accumulate in ("no-sync-keep", "no-all-reduce"):
            assert config.front_end == "fully_shard"
            assert config.accumulate == "no-sync-keep" or len(config.mesh) == 2


def test_simplest_choices_come_first() -> None:
    """Always picking the first option gives the default configuration (what shrinking reaches)."""
    assert draw_config(lambda options: options[0]) == Config()


def test_brief_and_script_literal_rebuild_the_configuration() -> None:
    """Config.brief() and the script's CONFIG literal evaluate back to the same configuration."""
    names = {"Config": Config, "BlockSpec": BlockSpec, "Toggle": Toggle}
    for config in DRAWN[:50]:
        assert eval(config.brief(), names) == config
        literal = re.search(r"^CONFIG = (Config\(.*?^\))$", config.to_script(), re.M | re.S)
        assert literal is not None
        assert eval(literal.group(1), names) == config


# ---------------------------------------------------------------------- comparing


def test_differs_is_bitwise_in_fp32() -> None:
    """One ulp is a difference in exact mode; NaNs in the same places are not."""
    a = torch.tensor([1.0, float("nan"), -2.0])
    b = a.clone()
    assert differs(a, b, exact=True) is None
    b[0] = torch.nextafter(a[0], torch.tensor(2.0))
    detail = differs(a, b, exact=True)
    assert detail is not None
    assert "flat index 0" in detail
    assert differs(a, b, exact=False) is None  # within bf16 rounding
    assert differs(a, a[:2], exact=True) == "shape (3,) != (2,)"
    assert differs(a, a.double(), exact=True) == "dtype torch.float32 != torch.float64"
    c = a.clone()
    c[2] = float("nan")
    assert "NaNs in different places" in (differs(a, c, exact=False) or "")


def test_differs_allows_bf16_rounding_only() -> None:
    """Under mixed precision a few bf16 ulps pass and a real error does not."""
    base = torch.randn(64, generator=torch.Generator().manual_seed(0))
    rounded = base.to(torch.bfloat16).float()
    assert differs(base, rounded, exact=False) is None
    assert differs(base, rounded, exact=True) is not None
    assert differs(base, base * 1.1, exact=False) is not None


def _trace() -> Trace:
    snapshot = Snapshot(
        losses=[torch.tensor(1.5)],
        grad_norm=torch.tensor(0.5),
        grads={"a": torch.ones(2), "b": None},
        params={"a": torch.zeros(2), "b": torch.ones(1)},
        optim={"a": {"momentum_buffer": torch.ones(2), "step": 1.0}},
    )
    return Trace(names=["a", "b"], steps=[snapshot, dataclasses.replace(snapshot)])


@pytest.mark.parametrize(
    ("inject", "what", "name"),
    [
        (lambda s: s.losses[0].add_(1e-6), "loss", "micro-batch 0"),
        (lambda s: setattr(s, "grad_norm", torch.tensor(0.25)), "grad_norm", ""),
        (lambda s: s.grads.update(b=torch.zeros(1)), "grad is None", "b"),
        (lambda s: s.grads.update(a=torch.ones(2) * 2), "grad", "a"),
        (lambda s: s.params.update(b=torch.ones(1, dtype=torch.float64)), "param", "b"),
        (lambda s: s.optim["a"].update(step=2.0), "optim", "a['step']"),
        (lambda s: s.optim.pop("a"), "optim", "a"),
        (lambda s: setattr(s, "eval_loss", torch.tensor(2.0)), "eval_loss", ""),
        (lambda s: setattr(s, "state_keys", ("a", "b")), "state_dict keys", ""),
    ],
)
def test_compare_reports_an_injected_difference(inject: object, what: str, name: str) -> None:
    """Each kind of difference in the second step shows as exactly one discrepancy there."""
    expected, actual = _trace(), _trace()
    actual.steps[1] = dataclasses.replace(
        actual.steps[1],
        losses=[t.clone() for t in actual.steps[1].losses],
        grads=dict(actual.steps[1].grads),
        params=dict(actual.steps[1].params),
        optim={k: dict(v) for k, v in actual.steps[1].optim.items()},
    )
    assert compare_traces(expected, actual, rank=0, exact=True) == ([], 0)
    inject(actual.steps[1])  # type: ignore[operator]
    found, total = compare_traces(expected, actual, rank=3, exact=True)
    assert total == 1
    assert (found[0].rank, found[0].step, found[0].what, found[0].name) == (3, 1, what, name)


def test_compare_reports_exceptions_by_type_and_phase() -> None:
    """Both raising the same built-in type in the same phase agrees; anything else differs."""
    expected, actual = _trace(), _trace()
    expected.error = actual.error = (-1, "build", "ValueError", "ValueError: torch's words")
    actual.error = (-1, "build", "ValueError", "LayoutError: shard's words")
    assert compare_traces(expected, actual, rank=0, exact=True)[1] == 0
    actual.error = (0, "backward", "RuntimeError", "RuntimeError: boom")
    (found,), _ = compare_traces(expected, actual, rank=0, exact=True)
    assert found.name == "torch ValueError in build, shard RuntimeError in backward"
    assert signature("wrapper", found) == (
        "wrapper: error (torch ValueError in build, shard RuntimeError in backward)"
    )
    expected.error = None
    (found,), _ = compare_traces(expected, actual, rank=0, exact=True)
    assert found.name == "shard RuntimeError in backward"


def _torch_against_itself(config: Config) -> tuple[int, list[str]]:
    """PyTorch twice (must agree bitwise), then with one gradient off by one ulp."""
    first, second = run_impl(config, "torch"), run_impl(config, "torch")
    assert first.error is None, first.error
    assert second.error is None, second.error
    _, clean = compare_traces(first, second, rank=dist.get_rank(), exact=True)
    grad = second.steps[1].grads["blocks.0.down.bias"]
    assert grad is not None
    grad[0] = torch.nextafter(grad[0], torch.tensor(math.inf))
    found, _ = compare_traces(first, second, rank=dist.get_rank(), exact=True)
    return clean, [str(d) for d in found]


def test_the_reference_agrees_with_itself_and_one_ulp_shows(rank_pool: RankPool) -> None:
    """Two PyTorch runs of the same configuration are bitwise equal; a 1-ulp change is reported."""
    config = Config(blocks=(BlockSpec(kind="lora", checkpoint="inner", side=True),), clip=0.5)
    for rank, (clean, found) in enumerate(rank_pool.run(_torch_against_itself, 2, config)):
        assert clean == 0
        assert len(found) == 1
        assert found[0].startswith(f"rank {rank}, step 1: grad blocks.0.down.bias: differs bitwise")


def _resume_that_loads_nothing(config: Config) -> list[str]:
    """PyTorch resuming, against PyTorch whose ``set_state_dict`` loads nothing."""
    from torch.distributed.checkpoint import state_dict as api

    loaded = run_impl(config, "torch")
    original = api.set_state_dict
    api.set_state_dict = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        lost = run_impl(config, "torch")
    finally:
        api.set_state_dict = original
    assert loaded.error is None, loaded.error
    found, _ = compare_traces(loaded, lost, rank=dist.get_rank(), exact=True)
    return [f"{d.step} {d.what}" for d in found]


@pytest.mark.parametrize("resume", ["sharded", "full"])
def test_a_resume_that_loads_nothing_shows(rank_pool: RankPool, resume: str) -> None:
    """The resumed model starts from other weights, so a load that is lost is reported."""
    config = Config(steps=3, resume=resume, resume_at=1, evaluate=True)  # type: ignore[arg-type]
    for found in rank_pool.run(_resume_that_loads_nothing, 2, config):
        assert found[:2] == ["1 loss", "1 eval_loss"]


def _meta_against_eager(config: Config, load: bool) -> list[str]:
    """PyTorch from meta against PyTorch built eagerly; ``load=False`` drops the load."""
    from torch.distributed.checkpoint import state_dict as api

    eager = run_impl(dataclasses.replace(config, init="eager"), "torch")
    original = api.set_model_state_dict
    if not load:
        api.set_model_state_dict = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        meta = run_impl(dataclasses.replace(config, init="meta"), "torch")
    finally:
        api.set_model_state_dict = original
    assert eager.error is None, eager.error
    assert meta.error is None, meta.error
    found, _ = compare_traces(eager, meta, rank=dist.get_rank(), exact=True)
    return sorted({f"{d.step} {d.what}" for d in found})


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_meta_initialisation_loads_rank_0s_weights_and_a_lost_load_shows(
    rank_pool: RankPool, front_end: str
) -> None:
    """init="meta" trains as the eager build does; without its load it does not."""
    config = Config(front_end=front_end, blocks=(BlockSpec(kind="lora"),))  # type: ignore[arg-type]
    for found in rank_pool.run(_meta_against_eager, 2, config, True):
        assert found == []
    for found in rank_pool.run(_meta_against_eager, 2, config, False):
        assert found[:1] == ["0 grad"]


# ---------------------------------------------------------------------- scripts


def _load(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import the script as a module (registered, so the pool can send its functions by file)."""
    spec = importlib.util.spec_from_file_location("differential_repro_script", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_script_compiles_and_runs_on_the_ranks(
    rank_pool: RankPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """to_script() is valid Python whose rank body compares the configuration and reports."""
    config = Config(front_end="wrapper", blocks=(BlockSpec(side=True),), steps=3)
    path = tmp_path / "repro.py"
    path.write_text(config.to_script(), encoding="utf-8")
    compile(path.read_text(encoding="utf-8"), str(path), "exec")
    module = _load(path, monkeypatch)
    assert config == module.CONFIG
    assert rank_pool.run(module.check_on_rank, 2) == [0, 0]


# ---------------------------------------------------------------------- known bugs


def test_known_bugs_are_documented_and_match_their_minimal_configuration() -> None:
    """Each entry names its culprit and a minimal configuration it matches (the re-enable test)."""
    assert len({bug.name for bug in KNOWN_BUGS}) == len(KNOWN_BUGS)
    names = {"Config": Config, "BlockSpec": BlockSpec, "Toggle": Toggle}
    for bug in KNOWN_BUGS:
        assert bug.culprit in {"shard", "torch"}
        minimal = re.search(r"Minimal: (Config\(.*\))$", bug.symptom)
        assert minimal is not None, bug.name
        config = eval(minimal.group(1), names)
        assert bug.name in known_bugs_in(config)
    assert known_bugs_in(Config()) == []


def test_brief_tells_an_int_from_a_bool() -> None:
    """``reshard_after_forward=1`` equals ``True`` as a value, but not as a configuration:
    the brief form (reports, shrunk configurations) keeps it."""
    assert Config(reshard_after_forward=1).brief() == "Config(reshard_after_forward=1)"
    assert Config(reshard_after_forward=True).brief() == "Config()"
