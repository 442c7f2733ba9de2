"""FSDPModule.unshard, reshard and set_reshard_after_backward, seen in the parameters exposed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shard_comms import count_collectives
from shard_runtime import FSDPModule, fully_shard
from shard_testing import RankPool


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _controls() -> dict[str, Any]:
    model = _blocks_model()
    fully_shard(model[2])
    fully_shard(model)
    root: FSDPModule = model  # type: ignore[assignment]
    handle = root.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    unsharded = [type(p).__name__ for p in model.parameters()]
    full_shape = tuple(model[0].weight.shape)
    root.reshard()
    resharded = [type(p).__name__ for p in model.parameters()]
    root.set_reshard_after_backward(False)
    model(torch.ones(2, 4)).sum().backward()
    kept = [isinstance(p, DTensor) for p in model[2].parameters()]
    with count_collectives() as counts:
        model(torch.ones(2, 4))
    root.set_reshard_after_backward(True)
    root.reshard()
    model[2].reshard()  # type: ignore[operator]
    return {
        "unsharded": unsharded,
        "full_shape": full_shape,
        "resharded": resharded,
        "kept_after_backward": kept,
        "gathers_when_kept": counts.calls("all_gather"),
    }


def test_unshard_reshard_and_keep_after_backward(rank_pool: RankPool) -> None:
    """unshard(async_op=True) registers full parameters; reshard_after_backward=False keeps them."""
    result = rank_pool.run(_controls, 2)[0]
    assert result["unsharded"] == ["Parameter"] * 2 + ["DTensor"] * 2 + ["Parameter"] * 2
    assert result["full_shape"] == (6, 4)
    assert result["resharded"] == ["DTensor"] * 6
    assert result["kept_after_backward"] == [False, False]
    assert result["gathers_when_kept"] == 0
