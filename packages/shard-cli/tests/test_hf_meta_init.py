"""``shard train --hf-config`` builds the model on meta and fills the shards unit by unit.

Three things are proved on a tiny Llama whose input and output embeddings
are tied: the sharded model's initial weights equal, bit for bit, those of
one process that initialises the unsharded model with the same function
(at 2 and 3 ranks: even and uneven shards; a 2-D replicate x shard mesh; the
wrapper front end, which gets the same values whole before it flattens); the
tie survives (``lm_head`` and ``embed_tokens`` share one parameter after
materialisation, and training keeps them equal); and a rank's peak memory
while building, sharding and initialising a model of sixteen 4 MiB layers
grows by its shards and a few layers (under a quarter of the model), never
by the whole model (the control, building it whole, does).

Peaks are measured by ``shard_testing.memory.PeakMeter`` as in shard-checkpoint's
``tests/test_memory.py``, after the same steps on a tiny model so that one-time
costs (imports, caches) are not counted.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shard_checkpoint import StateDictOptions, get_model_state_dict
from shard_cli._materialise import hf_module_init, materialise, parameters_on_meta
from shard_cli._model_source import build_for_training, load_model_source, materialise_sharded
from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard
from shard_testing import RankPool
from shard_testing.memory import MIB, PeakMeter, can_measure_peak

transformers = pytest.importorskip("transformers")

SEED = 3
TINY: dict[str, Any] = {
    "vocab_size": 37,
    "hidden_size": 16,
    "intermediate_size": 40,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
# Sixteen layers of 4 MiB (fp32), a small tied embedding: the layers dominate.
BIG: dict[str, Any] = {
    **TINY,
    "vocab_size": 64,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def _meta_model(sizes: dict[str, Any]) -> nn.Module:
    config = transformers.LlamaConfig(**sizes)
    with parameters_on_meta():
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
    return model


def _reference(sizes: dict[str, Any]) -> nn.Module:
    model = _meta_model(sizes)
    materialise(model, device=torch.device("cpu"), seed=SEED, init=hf_module_init)
    return model


def _fully_shard(model: nn.Module, replicas: int = 0) -> nn.Module:
    """Each layer and the root sharded over all ranks, or over ``world / replicas`` (HSDP)."""
    world = dist.get_world_size()
    if replicas:
        shape = (replicas, world // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sharded_initialisation(frontend: str) -> dict[str, Any]:
    """Build on meta, shard, materialise (as shard train does); the full weights and the tie."""
    args = [f"{key}={json.dumps(value)}" for key, value in TINY.items()]
    source = load_model_source(hf_config="LlamaConfig", hf_args=args)
    cpu = torch.device("cpu")
    per_param = frontend.startswith("fully_shard")
    model = build_for_training(source, sharded_later=per_param, device=cpu, seed=SEED)
    on_meta = all(p.is_meta for p in model.parameters())
    if per_param:
        model = _fully_shard(model, replicas=2 if frontend == "fully_shard_hsdp" else 0)
    else:
        policy = ModuleWrapPolicy({transformers.models.llama.modeling_llama.LlamaDecoderLayer})
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True)
    materialise_sharded(model, source, device=cpu, seed=SEED)
    inner = model.module if isinstance(model, FullyShardedDataParallel) else model
    head, embed = inner.lm_head.weight, inner.model.embed_tokens.weight
    tied = head is embed
    options = StateDictOptions(full_state_dict=True)
    # Cloned: with one rank per shard group a full tensor may be the parameter itself.
    initial = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    # One AdamW step: the tied parameter gets both modules' gradients and stays one tensor.
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.arange(16).reshape(2, 8) % TINY["vocab_size"]
    model(input_ids=tokens).logits.float().pow(2).mean().backward()
    optim.step()
    stepped = get_model_state_dict(model, options=options)
    first = dist.get_rank() == 0
    return {
        "on_meta": on_meta,
        "tied": tied,
        "dtensor": isinstance(embed, DTensor),
        "still_tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
        "initial": initial if first else None,
        "stepped": stepped if first else None,
    }


def _reference_and_one_step() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = _reference(TINY)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.arange(16).reshape(2, 8) % TINY["vocab_size"]
    model(input_ids=tokens).logits.float().pow(2).mean().backward()
    optim.step()
    return initial, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("world", "frontend"),
    [(2, "fully_shard"), (3, "fully_shard"), (2, "fully_shard_hsdp"), (2, "wrapper")],
)
def test_initial_weights_and_tie_match_one_process(
    rank_pool: RankPool, world: int, frontend: str
) -> None:
    """Built on meta and initialised per module, the sharded tied Llama starts bit for bit as
    one process's model and stays close after one AdamW step, lm_head and embed_tokens one
    parameter throughout."""
    results = rank_pool.run(_sharded_initialisation, world, frontend)
    initial, stepped = _reference_and_one_step()
    for result in results:
        assert result["on_meta"] == (frontend != "wrapper")
        assert result["tied"]
        assert result["still_tied"]
        assert result["dtensor"] == (frontend != "wrapper")
    assert list(results[0]["initial"]) == list(initial)
    for key, value in initial.items():
        assert torch.equal(results[0]["initial"][key], value), key
    for key, value in stepped.items():
        assert not torch.equal(value, initial[key]) or "norm" in key, key
        torch.testing.assert_close(results[0]["stepped"][key], value, rtol=1e-5, atol=1e-6)


def test_initial_weights_differ_by_seed_and_module() -> None:
    """Each module draws from its own stream: no two layers, and no two seeds, start equal."""
    model = _reference(TINY)
    other = _meta_model(TINY)
    materialise(other, device=torch.device("cpu"), seed=SEED + 1, init=hf_module_init)
    layers = model.model.layers  # type: ignore[union-attr]
    q0, q1 = layers[0].self_attn.q_proj.weight, layers[1].self_attn.q_proj.weight
    assert not torch.equal(q0, q1)
    assert not torch.equal(q0, other.model.layers[0].self_attn.q_proj.weight)  # type: ignore[union-attr]
    assert torch.equal(layers[0].input_layernorm.weight, torch.ones(TINY["hidden_size"]))
    std = q0.std().item()
    assert 0.015 < std < 0.025  # LlamaConfig's initializer_range, 0.02
    inv_freq = model.model.rotary_emb.inv_freq  # type: ignore[union-attr]
    assert torch.equal(
        inv_freq,
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).model.rotary_emb.inv_freq,
    )


def _build_measured(sizes: dict[str, Any], whole: bool) -> tuple[int, int]:
    """Peak growth of building (on meta, sharded, materialised; or whole) and bytes held."""
    meter = PeakMeter()
    meter.start()
    if whole:
        model = _reference(sizes)
    else:
        model = _fully_shard(_meta_model(sizes))
        materialise(model, device=torch.device("cpu"), seed=SEED, init=hf_module_init)
    growth = meter.growth()
    held = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters()
    )
    return growth, held


def _meta_peak(whole: bool) -> tuple[int, int]:
    _build_measured(TINY, whole)  # one-time costs: imports, caches
    return _build_measured(BIG, whole)


@pytest.mark.skipif(
    not can_measure_peak(),
    reason="needs Linux's clear_refs and glibc's mallopt to measure peak memory honestly",
)
def test_building_costs_the_shards_and_one_unit_not_the_model(rank_pool: RankPool) -> None:
    """A rank's peak grows by its shards plus a few layers (under a quarter of the model, 16
    layers); building the model whole (the control) costs all of it."""
    layer = 4 * (4 * 256 * 256 + 3 * 256 * 1024)
    model_bytes = 16 * layer  # and a few KiB of norms and embedding
    for growth, held in rank_pool.run(_meta_peak, 2, False):
        print(f"meta build: peak +{growth / MIB:.1f} MiB, shards {held / MIB:.1f} MiB")
        assert held < 0.55 * model_bytes
        # A whole model would be the shards plus the other half; one unit is a sixteenth.
        assert growth < held + model_bytes / 4
    [(whole, _)] = rank_pool.run(_meta_peak, 1, True)
    print(f"whole build: peak +{whole / MIB:.1f} MiB, model {model_bytes / MIB:.1f} MiB")
    assert whole > 0.9 * model_bytes
