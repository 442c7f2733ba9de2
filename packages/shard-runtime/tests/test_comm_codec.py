"""``set_comm_codec`` on both front ends: what it encodes, what it leaves alone, what it refuses.

The training-level parity of quantized communication (a one-process
reference applying the same quantization, both front ends, a 2-D mesh) is
shard-comm-quant's ``test_quantized_training.py``; here a float16 codec
checks the engine's side: which collectives go encoded (counted bytes),
units whose dtypes no codec takes, switching off, and the errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_comms import count_collectives
from shard_runtime import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard
from shard_runtime._state import get_state
from shard_testing import RankPool
from shard_testing.codecs import HalfCodec
from shard_testing.compat import cpu_mesh

WIDTH = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _step_bytes(model: nn.Module) -> dict[str, int]:
    with count_collectives() as counts:
        model(torch.randn(2, WIDTH)).sum().backward()
    return {k: counts.bytes(k) for k in ("all_gather", "reduce_scatter", "all_reduce")}


def _switching() -> dict[str, Any]:
    model = _model()
    fully_shard(model[0], mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    plain = _step_bytes(model)
    model.set_comm_codec(weights=HalfCodec(), grads=HalfCodec())  # type: ignore[operator]
    both = _step_bytes(model)
    model.set_comm_codec(grads=HalfCodec(), recurse=False)  # type: ignore[operator]
    root_grads_only = _step_bytes(model)
    inner = get_state(model[0])
    root = get_state(model)
    assert inner is not None
    assert root is not None
    feedback = (inner.units[0].feedback_nbytes, root.units[0].feedback_nbytes)
    model.set_comm_codec()  # type: ignore[operator]
    off = _step_bytes(model)
    return {
        "plain": plain,
        "both": both,
        "root_grads_only": root_grads_only,
        "off": off,
        "feedback": feedback,
    }


def test_set_comm_codec_encodes_switches_and_recurses(rank_pool: RankPool) -> None:
    """Encoded bytes are half the float32 ones; recurse=False changes the root only; None is off.

    Each unit (the inner Linear, the root's Linear) has 72 float32 values,
    36 per rank. Error feedback keeps one float32 residual per gradient
    value the unit sends to the other rank (36 values: 144 bytes), on units
    that encode grads.
    """
    (result, _) = rank_pool.run(_switching, 2)
    unit_bytes = 2 * 36 * 4  # a unit's gathered float32 rows, or its full gradient
    plain = {"all_gather": 3 * unit_bytes, "reduce_scatter": 2 * unit_bytes, "all_reduce": 0}
    assert result["plain"] == plain
    assert result["off"] == plain
    assert result["both"] == {k: v // 2 for k, v in plain.items()}
    # recurse=False: the root encodes its gradients only; the inner unit stays as it was.
    assert result["root_grads_only"] == {
        "all_gather": unit_bytes // 2 * 2 + unit_bytes,
        "reduce_scatter": unit_bytes // 2 + unit_bytes // 2,
        "all_reduce": 0,
    }
    assert result["feedback"] == (144, 144)


class _Mixed(nn.Module):
    """A bf16 layer and a float32 one in one unit: the unit gathers its shards as bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Linear(WIDTH, WIDTH, bias=False).to(torch.bfloat16)
        self.high = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(self.low(x.to(torch.bfloat16)).float())


def _mixed() -> dict[str, int]:
    torch.manual_seed(0)
    model = _Mixed()
    fully_shard(model, mesh=cpu_mesh())
    model.set_comm_codec(weights=HalfCodec(), grads=HalfCodec())  # type: ignore[operator]
    return _step_bytes(model)


def test_a_unit_gathering_bytes_gathers_plainly_and_reduces_each_dtype_encoded(
    rank_pool: RankPool,
) -> None:
    """Mixed dtypes gather as bytes, which no codec takes; each gradient dtype still encodes."""
    (result, _) = rank_pool.run(_mixed, 2)
    gathered = 2 * (32 * 2 + 32 * 4)  # two ranks' rows of bf16 and float32 shards, as bytes
    assert result == {
        "all_gather": gathered,
        "reduce_scatter": 64 * 2 + 64 * 2,  # one reduction per dtype, 2 bytes a value each
        "all_reduce": 0,
    }


class _Gather:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
    ) -> Any:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)

    def __repr__(self) -> str:
        return "_Gather()"


def _errors() -> list[str]:
    messages = []
    model = _model()
    fully_shard(model[0], mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    model[0].set_custom_all_gather(_Gather())  # type: ignore[operator]
    attempts = [
        lambda: model.set_comm_codec(weights=HalfCodec()),  # type: ignore[operator]
        lambda: model.set_comm_codec(weights="int7"),  # type: ignore[operator]
        lambda: model.set_comm_codec(grads=HalfCodec(), error_feedback=1),  # type: ignore[operator]
        lambda: model.set_comm_codec(grads=3),  # type: ignore[operator]
    ]
    model.set_comm_codec(grads=HalfCodec())  # type: ignore[operator]
    attempts.append(lambda: model.set_custom_reduce_scatter(_Gather()))  # type: ignore[operator]
    wrapped = FullyShardedDataParallel(_model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    wrapped.set_comm_codec(grads="int8")
    attempts.append(lambda: wrapped.register_comm_hook("bf16_compress"))
    for attempt in attempts:
        try:
            attempt()
        except (ValueError, TypeError, LookupError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    # nothing changed where a check failed: the inner unit still gathers through _Gather
    inner = get_state(model[0])
    assert inner is not None
    assert inner.units[0].weight_codec is None
    return messages


def test_set_comm_codec_refuses_what_replaces_the_same_collective(rank_pool: RankPool) -> None:
    """Codecs and custom collectives or comm hooks exclude each other, both ways, by name."""
    messages = rank_pool.run(_errors, 2)[0]
    assert len(messages) == 6
    assert messages[0] == (
        "ValueError: set_comm_codec(0): weights=HalfCodec() cannot be combined with a custom "
        "all-gather (_Gather()) on this unit: both replace the same collective; set one of them"
    )
    assert messages[1].startswith(
        "UnknownPluginNameError: no comm codec is registered as 'int7'; registered: 'int4', "
        "'int8'. Did you mean"
    )
    assert messages[2] == "TypeError: set_comm_codec: error_feedback must be a bool, got 1 (int)"
    assert messages[3].startswith("TypeError: comm codec 3 (int) is neither a registered codec")
    assert messages[4] == (
        "ValueError: set_custom_reduce_scatter(Sequential): this unit encodes its grads with "
        "HalfCodec() "
        "(set_comm_codec); a custom reduce-scatter would replace the same collective: call "
        "set_comm_codec(grads=None) first, or keep the codec"
    )
    assert messages[5].startswith(
        "ValueError: register_comm_hook(Sequential): this unit encodes its grads with "
        "BlockQuantCodec(bits=8, block_size=256) (set_comm_codec); a comm hook would replace"
    )


@pytest.mark.parametrize("frontend", ["fully_shard", "wrapper"])
def test_world_of_one_sends_nothing_to_encode(rank_pool: RankPool, frontend: str) -> None:
    """A single rank trains exactly as without a codec: nothing crosses the wire."""
    results = rank_pool.run(_one_rank, 1, frontend)
    assert results[0][0] == results[0][1]


def _one_rank(frontend: str) -> tuple[list[float], list[float]]:
    losses = []
    for codec in (None, HalfCodec()):
        model: nn.Module = _model()
        if frontend == "wrapper":
            model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        else:
            fully_shard(model[0], mesh=cpu_mesh())
            fully_shard(model, mesh=cpu_mesh())
        model.set_comm_codec(weights=codec, grads=codec)  # type: ignore[operator]
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for step in range(3):
            x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            run.append(loss.item())
        losses.append(run)
    return losses[0], losses[1]
