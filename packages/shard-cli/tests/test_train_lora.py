"""``shard train --lora`` and ``--freeze``: flags, what trains, the plan's bytes, exact resume.

The flags are checked before any rank starts (exact messages). Training runs
``shard train``'s own rank code (``_Run``: build, adapt, shard, materialise,
AdamW, checkpoint) on two persistent gloo ranks of ``rank_pool``, in
process, which spares the launcher and two fresh interpreters importing
``transformers`` and ``peft`` for each run. On a tiny Llama (``--hf-config``,
no download), ``--lora 8``:

- trains the adapters only: after four steps every base weight in the
  checkpoint is bit for bit the one ``shard train --hf-config`` without
  ``--lora`` starts from, and every adapter has moved;
- resumes exactly: two steps, then ``--resume`` to four, gives the
  uninterrupted run's losses bit for bit;
- holds what ``shard plan`` predicts, on every rank, for ``fully_shard``
  and for the wrapper (which keeps the original parameters when some are
  frozen).

The plan's arithmetic is checked by hand: gradients and AdamW state shrink
to those of the trainable parameters, by exactly their bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shard_cli.__main__ import main, train_parser
from shard_cli._config_file import config_keys, read_config_file
from shard_cli._finetune import Finetuning, finetuned_source
from shard_cli._model_source import build_for_training, load_model_source
from shard_cli._options import TrainOptions, resolve_options
from shard_cli._plan import PlanConfig, estimate_memory, plan_model_units
from shard_cli._strategy import resolve_policy
from shard_cli._train import gpt_source, model_config
from shard_testing import RankPool

pytest.importorskip("transformers")
pytest.importorskip("peft")

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 20
HIDDEN, INTER, LAYERS, VOCAB, RANK = 16, 32, 2, 40, 8
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# (in, out) of each projection LoRA adapts by default.
PROJECTIONS = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, HIDDEN),
    "v_proj": (HIDDEN, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTER),
    "up_proj": (HIDDEN, INTER),
    "down_proj": (INTER, HIDDEN),
}
STEPS = 4


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("lora")
    (where / "data.txt").write_text(TEXT, encoding="utf-8")
    (where / "llama").mkdir()
    (where / "llama" / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    return where


def _options(work: Path, run: str, **changes: Any) -> TrainOptions:
    fields: dict[str, Any] = {
        "hf_config": str(work / "llama" / "config.json"),
        "data": str(work / "data.txt"),
        "lora": RANK,
        "steps": STEPS,
        "batch": 4,
        "seq": 16,
        "lr": 1e-2,
        "sample_chars": 0,
        "ckpt_every": 0,
        "run_dir": str(work / run),
    }
    return TrainOptions(**{**fields, **changes})


# ---------------------------------------------------------------- flags


def _train_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shard train: ")
    return err.removeprefix("shard train: ").strip()


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"lora": 0}, "--lora must be at least 1 (the adapters' rank), got 0"),
        (
            {"lora_alpha": 16.0},
            "--lora-alpha configure LoRA adapters, which need --lora RANK; add --lora 8, say, "
            "or drop them",
        ),
        ({"lora": 8, "lora_alpha": 0.0}, "--lora-alpha must be more than 0, got 0.0"),
        (
            {"lora": 8, "lora_targets": "q_proj,,v_proj"},
            "--lora-targets must name modules, separated by commas (q_proj,v_proj), got "
            "'q_proj,,v_proj'",
        ),
        ({"freeze": [""]}, "--freeze needs a pattern over parameter names, got an empty one"),
    ],
)
def test_flags_out_of_range_are_errors_naming_the_flag(
    given: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_options(given)


def test_flags_parse_into_the_options_and_round_trip_through_config_json() -> None:
    """--lora-targets is split at commas, --freeze repeats; config.json stores lists, and the
    options read back equal."""
    parsed = train_parser().parse_args(
        [
            *("--lora", "4", "--lora-alpha", "8", "--lora-targets", "q_proj, v_proj"),
            *("--freeze", "model.norm.*", "--freeze", "lm_head.*"),
        ]
    )
    options = resolve_options(vars(parsed))
    assert (options.lora, options.lora_alpha) == (4, 8.0)
    assert options.lora_targets == ("q_proj", "v_proj")
    assert options.freeze == ("model.norm.*", "lm_head.*")
    stored = json.loads(json.dumps(options.to_json()))
    assert stored["freeze"] == ["model.norm.*", "lm_head.*"]
    assert TrainOptions.from_json(stored) == options


def test_config_file_takes_freeze_as_a_list_or_one_string(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('lora = 4\nlora_targets = "q_proj,v_proj"\nfreeze = ["a.*", "b.*"]\n')
    given = read_config_file(path, config_keys(train_parser()))
    options = resolve_options(given)
    assert (options.lora, options.lora_targets, options.freeze) == (
        4,
        ("q_proj", "v_proj"),
        ("a.*", "b.*"),
    )
    path.write_text('freeze = "a.*"\n')
    assert resolve_options(read_config_file(path, config_keys(train_parser()))).freeze == ("a.*",)
    path.write_text("freeze = [1]\n")
    with pytest.raises(ValueError, match=r"freeze must be a list of strings, got \[1\]$"):
        read_config_file(path, config_keys(train_parser()))


def test_resume_keeps_the_fine_tuning_of_its_checkpoint(tmp_path: Path) -> None:
    """--lora and --freeze decide what the checkpoint holds: a resume may not change them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = TrainOptions(run_dir=str(run_dir), lora=8, freeze=("a.*",))
    (run_dir / "config.json").write_text(json.dumps(options.to_json()), encoding="utf-8")
    same = resolve_options({"resume": True, "run_dir": str(run_dir), "freeze": ["a.*"]})
    assert (same.lora, same.freeze) == (8, ("a.*",))
    lora = "--resume: --lora 4 differs from the interrupted run's 8 (config.json)"
    with pytest.raises(ValueError, match=f"^{re.escape(lora)}"):
        resolve_options({"resume": True, "run_dir": str(run_dir), "lora": 4})
    freeze = "--resume: --freeze a.*,b.* differs from the interrupted run's a.* (config.json)"
    with pytest.raises(ValueError, match=f"^{re.escape(freeze)}"):
        resolve_options({"resume": True, "run_dir": str(run_dir), "freeze": ["a.*", "b.*"]})


def test_patterns_and_targets_that_match_nothing_are_refused_before_launch(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked against the model in the launcher: exit 2, the flag and its value named."""
    model = ["--hf-config", str(work / "llama" / "config.json"), "--data", str(work / "data.txt")]
    config = f"transformers config {work / 'llama' / 'config.json'}"
    assert _train_error(capsys, *model, "--freeze", "model.layer.*") == (
        f"--freeze 'model.layer.*' matches no parameter of {config}; patterns are shell-style "
        "(fnmatch: * matches any characters, dots included) over qualified parameter names "
        "such as model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, "
        "model.layers.0.self_attn.k_proj.weight"
    )
    assert _train_error(capsys, *model, "--freeze", "*") == (
        f"--freeze '*' leaves no parameter of {config} to train; freeze fewer parameters "
        "(the patterns match every trainable one)"
    )
    assert _train_error(capsys, *model, "--lora", "8", "--freeze", "*lora_*") == (
        f"--lora 8 with --freeze '*lora_*' leaves no parameter of {config} to train; freeze "
        "fewer parameters (the patterns match every trainable one)"
    )
    assert _train_error(capsys, *model, "--lora", "8", "--lora-targets", "q_proj,qkv") == (
        f"--lora-targets 'qkv' names no module of {config}; give module names or dotted "
        "suffixes of them; its linear layers are named down_proj, gate_proj, k_proj, lm_head, "
        "o_proj, q_proj, up_proj, v_proj"
    )


def test_lora_without_peft_names_the_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)
    assert _train_error(capsys, "--lora", "8", "--run-dir", "never") == (
        "--lora needs the peft package: pip install peft (or, from a shard checkout, pip "
        "install './packages/shard-cli[lora]'; never shard-cli from the public index, an "
        "unrelated project)"
    )


def test_default_targets_are_the_linear_layers_of_the_blocks() -> None:
    """A Llama's seven projections in each layer; shard's GPT's qkv, proj, fc, proj; never
    the embeddings or the head. The base is frozen, the adapters alone train."""
    llama = finetuned_source(
        load_model_source(hf_config="LlamaConfig", hf_args=[f"{k}={v}" for k, v in _args()]),
        Finetuning(lora=RANK),
    )
    with torch.device("meta"):
        model = llama.build()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    expected = {
        f"model.layers.{i}.{'self_attn' if p in attention else 'mlp'}.{p}.lora_{ab}.default.weight"
        for i in range(LAYERS)
        for p in PROJECTIONS
        for ab in "AB"
    }
    assert trainable == expected
    assert llama.description.endswith(
        "+ LoRA rank 8, alpha 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
    )
    options = TrainOptions(preset="tiny", lora=4)
    gpt = finetuned_source(gpt_source(model_config(options, 50), "tiny"), Finetuning.of(options))
    with torch.device("meta"):
        adapted = {n for n, p in gpt.build().named_parameters() if p.requires_grad}
    assert {n.split(".", 2)[2] for n in adapted} == {
        f"{layer}.lora_{ab}.default.weight"
        for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
        for ab in "AB"
    }


def _args() -> list[tuple[str, str]]:
    return [
        (k, json.dumps(v)) for k, v in LLAMA.items() if k not in ("model_type", "architectures")
    ]


# ---------------------------------------------------------------- the plan, by hand


def _rows(rows: int) -> int:
    """Rows of rank 0's shard of ``rows`` over two ranks (padded and local alike, here)."""
    return math.ceil(rows / 2)


def _trainable_bytes(shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """Rank 0's (gradients, AdamW state) of these fp32 matrices under fully_shard over 2 ranks."""
    grads = sum(_rows(rows) * cols * 4 for rows, cols in shapes)
    optim = sum(2 * _rows(rows) * cols * 4 + 4 for rows, cols in shapes)
    return grads, optim


def _plan(finetuning: Finetuning, frontend: str = "fully_shard") -> tuple[int, int, int]:
    source = load_model_source(hf_config="LlamaConfig", hf_args=[f"{k}={v}" for k, v in _args()])
    source = finetuned_source(source, finetuning)
    with torch.device("meta"):
        units = plan_model_units(source.build(), resolve_policy("transformer"))
    config = PlanConfig(
        frontend=frontend,  # type: ignore[arg-type]
        world=2,
        orig_params=any(u.frozen for u in units),
    )
    estimate = estimate_memory(units, config)
    return estimate.params, estimate.grads, estimate.optim


def test_plan_counts_gradients_and_adamw_state_of_trainable_parameters_only() -> None:
    """fully_shard over 2 ranks, rank 0: every parameter is held, but gradients and AdamW
    state only for those that train: the whole model's minus the frozen bytes, exactly."""
    matrices = [(VOCAB, HIDDEN), (VOCAB, HIDDEN)]  # embed_tokens, lm_head
    for _ in range(LAYERS):
        matrices += [(out, inp) for inp, out in PROJECTIONS.values()]
    norms = [(HIDDEN, 1)] * (2 * LAYERS + 1)
    params, grads, optim = _plan(Finetuning())
    assert (grads, optim) == _trainable_bytes(matrices + norms)
    assert params == grads
    # --freeze the embedding: its rows' gradient and AdamW state go, nothing else.
    frozen = _plan(Finetuning(freeze=("model.embed_tokens.*",)))
    embed_grads, embed_optim = _trainable_bytes([(VOCAB, HIDDEN)])
    assert frozen == (params, grads - embed_grads, optim - embed_optim)
    # --lora 8: only A (8 x in) and B (out x 8) of every projection train.
    adapters = [
        shape
        for _ in range(LAYERS)
        for inp, out in PROJECTIONS.values()
        for shape in ((RANK, inp), (out, RANK))
    ]
    lora_params, lora_grads, lora_optim = _plan(Finetuning(lora=RANK))
    assert (lora_grads, lora_optim) == _trainable_bytes(adapters)
    assert lora_params == params + _trainable_bytes(adapters)[0]  # the adapters are held too
    assert (lora_grads, lora_optim) == (8704, 17520)
    assert (grads, optim) == (12960, 26004)


def test_plan_command_prints_trainable_against_total(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [f"--hf-arg={k}={v}" for k, v in _args()]
    base = ["plan", "--hf-config", "LlamaConfig", *args, "--strategy", "full", "--json"]
    assert main([*base, "--lora", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["trainable"], report["parameters"]) == (4352, 10832)
    full = report["strategies"]["full"]
    assert (full["grads"], full["optim"]) == (8704, 17520)
    assert main([*base[:-1], "--lora", "8"]) == 0
    assert "0.01 M parameters (4,352 of 10,832 train, 40.18%)" in capsys.readouterr().out


# ---------------------------------------------------------------- training on two ranks


def _run_on_rank(options_json: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``shard train`` (``run_worker`` without the summary's files)."""
    from shard_cli._train import _Run

    run = _Run(TrainOptions.from_json(options_json))
    run.prepare()
    summary = run.train()
    given = {id(p) for group in run.optim.param_groups for p in group["params"]}
    return {
        "summary": dataclasses.asdict(summary),
        "optimizer_has_frozen": any(
            id(p) in given for p in run.model.parameters() if not p.requires_grad
        ),
        "optimizer_states": len(run.optim.state),
        "trainable_tensors": sum(1 for p in run.model.parameters() if p.requires_grad),
    }


def _train(rank_pool: RankPool, options: TrainOptions) -> list[dict[str, Any]]:
    return rank_pool.run(_run_on_rank, 2, options.to_json(), timeout=240)


def _losses(run_dir: str) -> list[float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.fixture(scope="module")
def uninterrupted(rank_pool: RankPool, work: Path) -> tuple[TrainOptions, list[dict[str, Any]]]:
    options = _options(work, "whole")
    return options, _train(rank_pool, options)


def _assert_plan_is_measured(results: list[dict[str, Any]]) -> None:
    summary = results[0]["summary"]
    held = [{k: r[k] for k in ("params", "grads", "optim")} for r in summary["ranks"]]
    planned = [{k: r[k] for k in ("params", "grads", "optim")} for r in summary["plan"]["ranks"]]
    assert held == planned


def test_lora_trains_the_adapters_only_and_holds_what_the_plan_says(
    uninterrupted: tuple[TrainOptions, list[dict[str, Any]]],
) -> None:
    options, results = uninterrupted
    summary = results[0]["summary"]
    assert (summary["trainable"], summary["parameters"]) == (4352, 10832)
    _assert_plan_is_measured(results)
    for result in results:
        assert not result["optimizer_has_frozen"]
        assert result["optimizer_states"] == result["trainable_tensors"] == 4 * len(PROJECTIONS)
    losses = _losses(options.run_dir)
    assert len(losses) == STEPS
    assert losses[-1] < losses[0]


def test_base_weights_are_the_plain_models_and_never_change(
    uninterrupted: tuple[TrainOptions, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The checkpoint after four steps: every frozen weight equals, bit for bit, the plain
    model's initial one (``shard train --hf-config`` without --lora); every adapter moved
    from its initial value (B from zero)."""
    from shard_checkpoint import consolidate

    options, _ = uninterrupted
    path = consolidate(options.checkpoint_path, tmp_path / "full.pt", fmt="torch")
    trained = {
        k.removeprefix("model."): v for k, v in torch.load(path).items() if k.startswith("model.")
    }
    cpu = torch.device("cpu")
    plain_source = load_model_source(hf_config=options.hf_config)
    plain = build_for_training(plain_source, sharded_later=False, device=cpu, seed=options.seed)
    adapted_source = finetuned_source(plain_source, Finetuning.of(options))
    start = build_for_training(adapted_source, sharded_later=False, device=cpu, seed=options.seed)
    initial = dict(start.state_dict())
    assert set(trained) == set(initial)
    base = {k.replace(".base_layer", ""): v for k, v in trained.items() if "lora_" not in k}
    assert base.keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(base[key], value), key
    adapters = [k for k in trained if "lora_" in k]
    assert len(adapters) == 2 * LAYERS * len(PROJECTIONS) == 28
    for key in adapters:
        assert not torch.equal(trained[key], initial[key]), key
        if "lora_B" in key:
            assert not initial[key].any(), key


def test_resume_continues_to_the_same_losses_bitwise(
    rank_pool: RankPool,
    work: Path,
    uninterrupted: tuple[TrainOptions, list[dict[str, Any]]],
) -> None:
    """Two steps, then --resume to four: the losses are the uninterrupted run's, bit for bit."""
    whole, _ = uninterrupted
    first = _options(work, "resumed", steps=2)
    _train(rank_pool, first)
    resumed = resolve_options({"resume": True, "run_dir": first.run_dir, "steps": STEPS})
    results = _train(rank_pool, resumed)
    assert results[0]["summary"]["steps_run"] == 2
    assert _losses(first.run_dir) == _losses(whole.run_dir)


def test_wrapper_front_end_keeps_original_parameters_and_holds_what_the_plan_says(
    rank_pool: RankPool, work: Path
) -> None:
    """The wrapper mixes frozen bases and adapters in one unit with use_orig_params: gradients
    and AdamW state per adapter, as planned, on every rank."""
    results = _train(rank_pool, _options(work, "wrapper", frontend="wrapper", steps=2))
    _assert_plan_is_measured(results)
    for result in results:
        assert not result["optimizer_has_frozen"]
