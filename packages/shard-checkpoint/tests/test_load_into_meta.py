"""A full state dict loaded into tensors still on the meta device lands in new storage.

A module the wrapper ignores is never materialised by its ``param_init_fn``,
so after a meta-device build its tensors are still on meta when the
pretrained weights are loaded; copying into them would keep nothing (and the
first forward would fail far away). See [Note: loading into the meta device]
in ``_model.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shard_checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict
from shard_runtime import FullyShardedDataParallel
from shard_testing import RankPool


class _TiedWithNorm(nn.Module):
    """An embedding, a hidden layer, a norm kept out of sharding and a head tied to the
    embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.hidden = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight


def _to_empty_alone(module: nn.Module) -> None:
    module.to_empty(device=torch.device("cpu"), recurse=False)


def _load(broadcast: bool, ignore: str) -> dict[str, Any]:
    torch.manual_seed(0)
    eager = _TiedWithNorm()
    with torch.no_grad():
        eager.norm.weight.uniform_()  # values a reset would not give back
    full = {k: v.clone() for k, v in eager.state_dict().items()}
    with torch.device("meta"):
        net = _TiedWithNorm()
    net.norm.weight.requires_grad_(False)
    ignored = [net.norm] if ignore == "norm" else [net.norm, net.embed, net.head]
    model = FullyShardedDataParallel(net, param_init_fn=_to_empty_alone, ignored_states=ignored)
    given = full if not broadcast or dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_model_state_dict(model, given, options=options)
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "differing": sorted(k for k in full if not torch.equal(loaded[k], full[k])),
        "on_meta": sorted(n for n, p in model.named_parameters() if p.is_meta),
        "norm_requires_grad": net.norm.weight.requires_grad,
        "tied": net.head.weight is net.embed.weight,
    }


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast-from-rank0", "every-rank"])
@pytest.mark.parametrize("ignore", ["norm", "norm-and-tied-pair"])
def test_full_state_dict_into_meta_tensors(
    rank_pool: RankPool, broadcast: bool, ignore: str
) -> None:
    """Every value arrives; requires_grad and ties between meta slots are kept."""
    for result in rank_pool.run(_load, 2, broadcast, ignore):
        assert result == {
            "differing": [],
            "on_meta": [],
            "norm_requires_grad": False,
            "tied": True,
        }
