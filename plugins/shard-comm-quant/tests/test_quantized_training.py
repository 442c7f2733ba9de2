"""Training with quantized communication, on gloo ranks, against a one-process reference.

The reference trains the same model in this process and applies the same
quantization where the ranks communicate: every rank's shard of every weight
is encoded and decoded before forward (all ranks compute with the same
decoded weights), each rank's gradient is computed on its own batch, encoded
row by row with its own error-feedback residual (its own row exact), summed
in float32 in rank order, divided as the engine divides, and on a 2-D mesh
all-reduced across replicas from encoded chunks. The optimizer steps on the
full-precision weights. Both front ends, a 1-D mesh of 2 ranks and a
(replicate 2, shard 2) mesh of 4, must give its losses, and bitwise its
weights and AdamW state; state dicts, ``summon_full_params`` and a checkpoint
give the full-precision weights, never the decoded ones.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shard_comm_quant import BlockQuantCodec
from shard_comms import count_collectives
from shard_comms.plumbing import divide_factors
from shard_runtime import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from shard_testing import RankPool

DIM, LAYERS, BATCH, STEPS, LR = 16, 3, 4, 3, 0.02
BLOCK = 32  # a weight's shard row (128 or 64 elements) holds several blocks
WEIGHTS = ("int8", {"block_size": BLOCK})
GRADS = {"int8": ("int8", {"block_size": BLOCK}), "int4": ("int4", {"block_size": BLOCK})}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def batches(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank] -> (x, y)``, the same in every process."""
    g = torch.Generator().manual_seed(7)
    return [
        [
            (torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g))
            for _ in range(world)
        ]
        for _ in range(STEPS)
    ]


# ---------------------------------------------------------------------- the reference


def _round_trip(
    codec: BlockQuantCodec, rows: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    encoded = torch.empty(rows.shape[0], codec.encoded_nbytes(rows.shape[1]), dtype=torch.uint8)
    codec.encode(rows, encoded, residual)
    decoded = torch.empty(rows.shape, dtype=torch.float32)
    codec.decode(encoded, decoded)
    return decoded


def _encoded_sum(
    codec: BlockQuantCodec, sent: list[torch.Tensor], residuals: list[torch.Tensor]
) -> list[torch.Tensor]:
    """What each rank gets from an encoded reduce-scatter of every rank's ``(k, n)`` rows.

    Rank ``i`` encodes all its rows with its residual (its own row's residual
    stays zero), rank ``j`` sums row ``j`` of everyone's decoded rows in rank
    order, its own exact.
    """
    decoded = []
    for i, (rows, residual) in enumerate(zip(sent, residuals, strict=True)):
        decoded.append(_round_trip(codec, rows, residual))
        residual[i].zero_()
    return [
        torch.sum(
            torch.stack([sent[i][j] if i == j else decoded[i][j] for i in range(len(sent))]),
            dim=0,
        )
        for j in range(len(sent))
    ]


class Reference:
    """The one-process model of the quantized run; see the module docstring."""

    def __init__(self, world: int, replicate: int, grads: str) -> None:
        self.world, self.replicate, self.shard = world, replicate, world // replicate
        self.weight_codec = BlockQuantCodec(8, BLOCK)
        self.grad_codec = BlockQuantCodec(8 if grads == "int8" else 4, BLOCK)
        self.model = build()
        self.compute = build()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=LR)
        n = DIM * DIM // self.shard
        self.n, self.m = n, -(-n // replicate)
        zeros = torch.zeros
        self.scatter_residual = [
            [zeros(self.shard, n) for _ in range(LAYERS)] for _ in range(world)
        ]
        self.replica_residual = [
            [zeros(replicate, self.m) for _ in range(LAYERS)] for _ in range(world)
        ]
        self.sum_residual = [[zeros(1, self.m) for _ in range(LAYERS)] for _ in range(world)]

    def step(self, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        with torch.no_grad():
            for full, compute in zip(self.model.layers, self.compute.layers, strict=True):
                rows = full.weight.detach().reshape(self.shard, self.n)
                compute.weight.copy_(_round_trip(self.weight_codec, rows).view(DIM, DIM))
        grads, losses = [], []
        for x, y in batch:
            self.compute.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(self.compute(x), y)
            loss.backward()
            losses.append(loss.item())
            grads.append([layer.weight.grad.detach().clone() for layer in self.compute.layers])  # type: ignore[union-attr]
        pre, post = divide_factors(self.world)
        for u, layer in enumerate(self.model.layers):
            layer.weight.grad = self._reduce(u, grads, pre, post).view(DIM, DIM)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    def _reduce(
        self, u: int, grads: list[list[torch.Tensor]], pre: float, post: float
    ) -> torch.Tensor:
        """Unit ``u``'s averaged gradient as the ranks reduce it: shard rows, then replicas."""
        hybrid = self.replicate > 1
        by_replica = []  # [replica][shard row]
        for r in range(self.replicate):
            ranks = [r * self.shard + i for i in range(self.shard)]
            sums = _encoded_sum(
                self.grad_codec,
                [grads[d][u].reshape(self.shard, self.n) for d in ranks],
                [self.scatter_residual[d][u] for d in ranks],
            )
            by_replica.append([total / (pre if hybrid else pre * post) for total in sums])
        if not hybrid:
            return torch.stack(by_replica[0])
        return torch.stack(
            [
                self._replica_all_reduce(u, j, [rows[j] for rows in by_replica], post)
                for j in range(self.shard)
            ]
        )

    def _replica_all_reduce(
        self, u: int, j: int, values: list[torch.Tensor], post: float
    ) -> torch.Tensor:
        ranks = [r * self.shard + j for r in range(self.replicate)]
        chunks = []
        for value in values:
            padded = torch.zeros(self.replicate * self.m)
            padded[: self.n] = value
            chunks.append(padded.view(self.replicate, self.m))
        partials = _encoded_sum(
            self.grad_codec, chunks, [self.replica_residual[d][u] for d in ranks]
        )
        summed = torch.cat(
            [
                _round_trip(self.grad_codec, partial.view(1, self.m), self.sum_residual[d][u])[0]
                for partial, d in zip(partials, ranks, strict=True)
            ]
        )
        return summed[: self.n] / post


def reference(world: int, replicate: int, grads: str) -> tuple[list[float], Reference]:
    ref = Reference(world, replicate, grads)
    losses = [ref.step(batch) for batch in batches(world)]
    return losses, ref


# ---------------------------------------------------------------------- the ranks


def _train(frontend: str, replicate: int, grads: str, check_dir: str | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if replicate > 1:
        mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("r", "s"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model: nn.Module = build()
    if frontend == "fully_shard":
        for layer in model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_comm_codec(weights=WEIGHTS, grads=GRADS[grads])  # type: ignore[operator]
    else:
        strategy = ShardingStrategy.HYBRID_SHARD if replicate > 1 else ShardingStrategy.FULL_SHARD
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            sharding_strategy=strategy,
            device_mesh=mesh,
        )
        model.set_comm_codec(weights=WEIGHTS, grads=GRADS[grads])
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    counts = None
    for step, batch in enumerate(batches(world)):
        x, y = batch[rank]
        with count_collectives() as step_counts:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        if step == 0:
            counts = step_counts
        optim.step()
        optim.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    assert counts is not None
    result: dict[str, Any] = {
        "losses": losses,
        "bytes": {k: counts.bytes(k) for k in ("all_gather", "reduce_scatter", "all_reduce")},
    }
    if frontend == "fully_shard":
        result["weights"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        result["exp_avg"] = {
            name: optim.state[p]["exp_avg"].full_tensor() for name, p in model.named_parameters()
        }
        for layer in model.layers:  # type: ignore[union-attr]
            layer.unshard()
        result["unsharded"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        for layer in model.layers:  # type: ignore[union-attr]
            layer.reshard()
        if check_dir is not None:
            path = os.path.join(check_dir, "ckpt")
            dcp.save(model.state_dict(), checkpoint_id=path)
            plain = build()
            for layer in plain.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(plain, mesh=mesh)
            state = plain.state_dict()
            dcp.load(state, checkpoint_id=path)
            result["loaded"] = {k: v.full_tensor() for k, v in state.items()}
    else:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            result["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            result["summoned"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def _check(results: list[dict[str, Any]], world: int, replicate: int, grads: str) -> None:
    ref_losses, ref = reference(world, replicate, grads)
    ref_weights = {
        f"layers.{i}.weight": layer.weight.detach() for i, layer in enumerate(ref.model.layers)
    }
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses))
        assert list(result["weights"]) == list(ref_weights), rank
        for name, value in ref_weights.items():
            # The sharded master weights are the full-precision reference weights, bitwise...
            assert torch.equal(result["weights"][name], value), (rank, name)
            # ...and not values on the int8 grid (what forward computed with).
            grid = _round_trip(ref.weight_codec, value.reshape(ref.shard, ref.n)).view(DIM, DIM)
            assert not torch.equal(value, grid)
            for other in ("summoned", "loaded"):
                if other in result:
                    assert torch.equal(result[other][name], value), (rank, other, name)
            if "unsharded" in result:
                assert torch.equal(result["unsharded"][name], grid), (rank, name)
        if "exp_avg" in result:
            for p, name in zip(ref.model.parameters(), ref_weights, strict=True):
                exp_avg = ref.optim.state[p]["exp_avg"]
                assert result["exp_avg"][name].dtype == torch.float32
                assert torch.equal(result["exp_avg"][name], exp_avg), (rank, name)


def _expected_bytes(world: int, replicate: int, grads: str) -> dict[str, int]:
    """Bytes shard's counters see in the first step: encoded rows, not float32 ones."""
    shard = world // replicate
    n = DIM * DIM // shard
    weight_row = BlockQuantCodec(8, BLOCK).encoded_nbytes(n)
    grad_codec = BlockQuantCodec(8 if grads == "int8" else 4, BLOCK)
    m = -(-n // replicate)
    return {
        # forward and backward all-gather of every layer
        "all_gather": 2 * LAYERS * shard * weight_row,
        "reduce_scatter": LAYERS * shard * grad_codec.encoded_nbytes(n),
        "all_reduce": LAYERS * replicate * grad_codec.encoded_nbytes(m) if replicate > 1 else 0,
    }


@pytest.mark.parametrize(
    ("frontend", "world", "replicate", "grads"),
    [
        ("fully_shard", 2, 1, "int8"),
        ("wrapper", 2, 1, "int4"),
        ("fully_shard", 4, 2, "int4"),
        ("wrapper", 4, 2, "int8"),
    ],
    ids=["fully_shard-2", "wrapper-2-int4", "fully_shard-2x2-int4", "wrapper-hybrid-2x2"],
)
def test_quantized_training_matches_the_quantizing_reference(
    rank_pool: RankPool, frontend: str, world: int, replicate: int, grads: str
) -> None:
    """Losses, weights and AdamW state equal the reference; full-precision values stay so.

    The counters see the encoded bytes: int8 weights, int8/int4 gradients
    (about a quarter / an eighth of float32, plus one scale per block).
    """
    with tempfile.TemporaryDirectory() as tmp:
        check_dir = tmp if (frontend, replicate) == ("fully_shard", 1) else None
        results = rank_pool.run(_train, world, frontend, replicate, grads, check_dir)
    _check(results, world, replicate, grads)
    expected = _expected_bytes(world, replicate, grads)
    for result in results:
        assert result["bytes"] == expected
