"""The encoded collectives (comm codecs) on gloo ranks, against the same arithmetic by hand.

A float16 codec stands in for a plugin's: it loses something (so error
feedback has work to do) and its decode is a plain cast, so every expected
value is computed here exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shard_comms import (
    DefaultGradReducer,
    ErrorFeedback,
    count_collectives,
    resolve_comm_codec,
)
from shard_comms.plumbing import encoded_all_gather, encoded_all_reduce, encoded_reduce_scatter
from shard_core.errors import CommError, UnknownPluginNameError
from shard_core.protocols import CommCodec
from shard_testing import RankPool
from shard_testing.codecs import HalfCodec

N = 10  # elements per rank: 10 over 3 ranks makes uneven all-reduce chunks


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _values(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s values: not representable in float16, so encoding loses something."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)) * 3 + 1e-4


def _gather_everywhere(world_dtype: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, world_dtype)
    output = torch.full((world * N,), float("nan"), dtype=dtype)
    with count_collectives() as counts:
        handle = encoded_all_gather(
            HalfCodec(), output, _values(rank, N).to(dtype), async_op=True, label="u"
        )
        handle.wait()
    return {"output": output, "calls": counts.calls("all_gather"), "bytes": counts.bytes()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_encoded_all_gather_decodes_every_rank_own_included(
    rank_pool: RankPool, dtype: str
) -> None:
    """Each rank's row is the decoded shard of that rank, this rank's too; one counted gather."""
    world = 3
    results = rank_pool.run(_gather_everywhere, world, dtype)
    torch_dtype = getattr(torch, dtype)
    expected = torch.cat([_half(_values(r, N).to(torch_dtype)) for r in range(world)])
    for result in results:
        assert torch.equal(result["output"], expected.to(torch_dtype))
        assert result["calls"] == 1
        assert result["bytes"] == world * 2 * N  # the encoded rows, not 4 bytes a value


def _scatter_twice(divide: float) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    feedback = ErrorFeedback()
    outputs = []
    for step in range(2):
        grad = _values(rank + 10 * step, world * N)
        output = torch.empty(N)
        with count_collectives() as counts:
            encoded_reduce_scatter(
                HalfCodec(), output, grad, feedback=feedback, pre_divide=divide, async_op=True
            ).wait()
        outputs.append(output)
    residual = feedback.residual("scatter", world - 1, N, torch.device("cpu")).clone()
    return {"outputs": outputs, "residual": residual, "bytes": counts.bytes("reduce_scatter")}


def test_encoded_reduce_scatter_sums_decoded_rows_with_error_feedback(
    rank_pool: RankPool,
) -> None:
    """Rank j gets the float32 sum of row j of every rank's decoded gradient (its own exact).

    The second step adds what the first one lost; a rank keeps no residual
    for its own row, which it never sends. The counters see the encoded rows sent.
    """
    world, divide = 3, 3.0
    results = rank_pool.run(_scatter_twice, world, divide)
    residuals = [torch.zeros(world, N) for _ in range(world)]
    for step in range(2):
        sent = []
        for r in range(world):
            target = _values(r + 10 * step, world * N).view(world, N) + residuals[r]
            decoded = _half(target)
            residuals[r] = target - decoded
            residuals[r][r] = 0.0
            sent.append(decoded)
        for j, result in enumerate(results):
            rows = [
                _values(i + 10 * step, world * N).view(world, N)[j] if i == j else sent[i][j]
                for i in range(world)
            ]
            expected = torch.sum(torch.stack(rows), dim=0) / divide
            assert torch.equal(result["outputs"][step], expected), (step, j)
    for j, result in enumerate(results):
        # the residual holds the rows this rank sends, its own row left out
        assert torch.equal(result["residual"], torch.cat([residuals[j][:j], residuals[j][j + 1 :]]))
        assert result["bytes"] == world * 2 * N


def _all_reduce(numel: int) -> dict[str, Any]:
    rank = dist.get_rank()
    tensor = _values(rank, numel)
    feedback = ErrorFeedback()
    with count_collectives() as counts:
        encoded_all_reduce(HalfCodec(), tensor, feedback=feedback, post_divide=2.0)
    return {"tensor": tensor, "bytes": counts.bytes("all_reduce"), "calls": counts.calls()}


def test_encoded_all_reduce_is_equal_on_every_rank(rank_pool: RankPool) -> None:
    """Chunks of an uneven split are reduced by their owner and re-encoded: all ranks agree."""
    world, numel = 3, N  # chunks of 4, 4 and 2 (+2 padding)
    results = rank_pool.run(_all_reduce, world, numel)
    chunk = 4
    rows = [torch.zeros(world, chunk) for _ in range(world)]
    for r in range(world):
        rows[r].view(-1)[:numel] = _values(r, numel)
    partials = [
        torch.sum(
            torch.stack([rows[i][k] if i == k else _half(rows[i][k]) for i in range(world)]), 0
        )
        for k in range(world)
    ]
    expected = (torch.cat([_half(p) for p in partials])[:numel]) / 2.0
    for result in results:
        assert torch.equal(result["tensor"], expected)
        assert result["calls"] == 1
        assert result["bytes"] == world * 2 * chunk


def _world_of_one() -> dict[str, Any]:
    group = dist.new_group([dist.get_rank()])
    values = _values(0, N)
    gathered = torch.empty(N)
    reduced = torch.empty(N)
    summed = values.clone()
    with count_collectives() as counts:
        encoded_all_gather(HalfCodec(), gathered, values, group)
        encoded_reduce_scatter(HalfCodec(), reduced, values, group, pre_divide=2.0)
        encoded_all_reduce(HalfCodec(), summed, group, post_divide=4.0)
    return {"gathered": gathered, "reduced": reduced, "summed": summed, "calls": counts.calls()}


def test_a_world_of_one_encodes_nothing(rank_pool: RankPool) -> None:
    """Nothing crosses the wire in a group of one: exact copies and divisions, nothing counted."""
    (result,) = rank_pool.run(_world_of_one, 1)
    values = _values(0, N)
    assert torch.equal(result["gathered"], values)
    assert torch.equal(result["reduced"], values / 2.0)
    assert torch.equal(result["summed"], values / 4.0)
    assert result["calls"] == 0


def _bad_calls() -> list[str]:
    messages = []
    calls = [
        lambda: encoded_all_gather(HalfCodec(), torch.empty(5), torch.zeros(3)),
        lambda: encoded_reduce_scatter(HalfCodec(), torch.empty(4), torch.zeros(9)),
        lambda: encoded_all_reduce(HalfCodec(), torch.zeros(4, dtype=torch.int64)),
        lambda: DefaultGradReducer(codec=HalfCodec(), custom_reduce_scatter=object(), label="u"),  # type: ignore[arg-type]
    ]
    for call in calls:
        try:
            call()
        except CommError as exc:
            messages.append(str(exc))
    return messages


def test_bad_encoded_calls_name_the_sizes_and_the_fix(rank_pool: RankPool) -> None:
    """Mismatched sizes, a dtype no codec takes, and a codec beside a custom reduce-scatter."""
    messages = rank_pool.run(_bad_calls, 2)[0]
    assert messages == [
        "encoded_all_gather: output has 5 elements (contiguous: True) but 2 ranks each "
        "contributing 3 need a contiguous 6; size the output as world size * shard elements",
        "encoded_reduce_scatter: grad has 9 elements and the output 4 (contiguous: True) on 2 "
        "ranks, which needs 8 and a contiguous output; pad the flat gradient to a multiple of "
        "the world size and size the output as its 1/world-size slice",
        "encoded_all_reduce: torch.int64 cannot be encoded (a codec takes torch.bfloat16, "
        "torch.float16, torch.float32, torch.float64); run the plain collective",
        "DefaultGradReducer(u): a comm codec and a custom reduce-scatter both replace the "
        "reduce-scatter; set one of them",
    ]


def test_resolve_comm_codec_takes_names_pairs_and_codecs() -> None:
    """None is none, a codec is itself, names go to the registry, anything else is a TypeError."""
    codec = HalfCodec()
    assert isinstance(codec, CommCodec)
    assert resolve_comm_codec(None) is None
    assert resolve_comm_codec(codec) is codec
    with pytest.raises(UnknownPluginNameError, match=r"^no comm codec is registered as 'int7'"):
        resolve_comm_codec("int7")
    with pytest.raises(UnknownPluginNameError, match=r"^no comm codec is registered as 'int7'"):
        resolve_comm_codec(("int7", {"block_size": 64}))
    with pytest.raises(
        TypeError,
        match=r"^comm codec 8 \(int\) is neither a registered codec name, a \(name, options\) "
        r"pair nor a CommCodec; pass a name such as 'int8' \(pip install "
        r"\./plugins/shard-comm-quant\), \('int8', \{'block_size': 128\}\), or an object with "
        r"encoded_nbytes\(\), encode\(\) and decode\(\)$",
    ):
        resolve_comm_codec(8)  # type: ignore[arg-type]


def test_error_feedback_resets_when_the_shape_changes() -> None:
    """A residual asked for in another shape starts again from zeros; nbytes counts them all."""
    feedback = ErrorFeedback()
    first = feedback.residual("scatter", 2, 3, torch.device("cpu"))
    first += 1
    assert feedback.residual("scatter", 2, 3, torch.device("cpu")) is first
    again = feedback.residual("scatter", 2, 4, torch.device("cpu"))
    assert torch.equal(again, torch.zeros(2, 4))
    feedback.residual("replicas", 1, 5, torch.device("cpu"))
    assert feedback.nbytes == (8 + 5) * 4
    feedback.clear()
    assert feedback.nbytes == 0
