"""Tests of the single-process reference: hand-computed training, data helpers, state-dict diffs."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from shard_testing import (
    Batch,
    assert_state_dicts_equal,
    global_batch,
    make_batches,
    train_reference,
)


def _linear() -> nn.Linear:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    return model


def _sgd(parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1)


def _regression_batches() -> list[list[Batch]]:
    rank0 = (torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0]]))
    rank1 = (torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0]]))
    return [[rank0, rank1], [rank0, rank1]]


def _make_one(generator: torch.Generator, batch_size: int) -> Batch:
    inputs = torch.randn(batch_size, 3, generator=generator)
    return inputs, torch.randint(0, 4, (batch_size,), generator=generator)


def test_train_reference_matches_hand_computed_linear_regression() -> None:
    """Two SGD steps of MSE linear regression on two ranks' batches give the hand-computed values.

    Step 0: predictions 1.5 and 2.5 for targets 2 and 1, loss ((-0.5)^2 + 1.5^2) / 2 = 1.25
    (the mean of the per-rank losses 0.25 and 2.25); gradients dW = [-0.5, 1.5], db = 1.0;
    after lr 0.1: W = [1.05, 1.85], b = 0.4. Step 1: predictions 1.45 and 2.25, loss
    (0.55^2 + 1.25^2) / 2 = 0.9325; dW = [-0.55, 1.25], db = 0.7; W = [1.105, 1.725], b = 0.33.
    """
    run = train_reference(
        model_factory=_linear,
        optimizer_factory=_sgd,
        loss_fn=nn.functional.mse_loss,
        batches=_regression_batches(),
    )
    torch.testing.assert_close(run.losses, torch.tensor([1.25, 0.9325]))
    assert list(run.state_dict) == ["weight", "bias"]
    torch.testing.assert_close(run.state_dict["weight"], torch.tensor([[1.105, 1.725]]))
    torch.testing.assert_close(run.state_dict["bias"], torch.tensor([0.33]))


def test_train_reference_returns_detached_cpu_copies() -> None:
    """The returned losses and state dict are detached copies, not the model's live tensors."""
    models: list[nn.Linear] = []

    def factory() -> nn.Linear:
        models.append(_linear())
        return models[-1]

    run = train_reference(
        model_factory=factory,
        optimizer_factory=_sgd,
        loss_fn=nn.functional.mse_loss,
        batches=_regression_batches()[:1],
    )
    assert not run.losses.requires_grad
    assert all(not t.requires_grad and t.device.type == "cpu" for t in run.state_dict.values())
    with torch.no_grad():
        models[0].weight.zero_()
    torch.testing.assert_close(run.state_dict["weight"], torch.tensor([[1.05, 1.85]]))


def test_train_reference_rejects_a_non_scalar_loss() -> None:
    """A loss that is not reduced to a scalar is refused with its shape and the step."""
    with pytest.raises(
        ValueError,
        match=r"^loss_fn returned a tensor of shape \(2, 1\) at step 0; it must return a "
        r"mean-reduced scalar$",
    ):
        train_reference(
            model_factory=_linear,
            optimizer_factory=_sgd,
            loss_fn=lambda out, target: (out - target) ** 2,
            batches=_regression_batches(),
        )


def test_train_reference_rejects_steps_with_different_rank_counts() -> None:
    """Every step must carry one batch per rank."""
    batches = _regression_batches()
    batches[1] = batches[1][:1]
    with pytest.raises(
        ValueError,
        match=r"^step 1 has batches for 1 ranks but step 0 has 2; every step needs one batch "
        r"per rank$",
    ):
        train_reference(
            model_factory=_linear,
            optimizer_factory=_sgd,
            loss_fn=nn.functional.mse_loss,
            batches=batches,
        )


def test_global_batch_concatenates_ranks_in_order() -> None:
    """Each position of the ranks' tuples is concatenated on dim 0 in rank order."""
    x, y = global_batch(_regression_batches()[0])
    assert x.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert y.tolist() == [[2.0], [1.0]]


def test_global_batch_rejects_ranks_with_different_tuples() -> None:
    """Ranks whose batches hold different numbers of tensors are refused."""
    rank0 = (torch.zeros(1, 2), torch.zeros(1))
    rank1 = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1))
    with pytest.raises(
        ValueError,
        match=r"^the batch of rank 1 has 3 tensors but rank 0's has 2; every rank's batch must "
        r"hold the same inputs and target$",
    ):
        global_batch([rank0, rank1])


def test_make_batches_is_deterministic_per_seed() -> None:
    """The same seed gives the same tensors, another seed others; the layout is [step][rank]."""
    first = make_batches(7, 2, 3, 4, _make_one)
    again = make_batches(7, 2, 3, 4, _make_one)
    other = make_batches(8, 2, 3, 4, _make_one)
    assert [len(step) for step in first] == [3, 3]
    for step in range(2):
        for rank in range(3):
            inputs, target = first[step][rank]
            assert inputs.shape == (4, 3)
            assert target.shape == (4,)
            torch.testing.assert_close(inputs, again[step][rank][0], rtol=0, atol=0)
            torch.testing.assert_close(target, again[step][rank][1], rtol=0, atol=0)
            assert not torch.equal(inputs, other[step][rank][0])
    assert not torch.equal(first[0][0][0], first[0][1][0])


def test_make_batches_rejects_batches_of_the_wrong_size() -> None:
    """make_one must return tensors of batch_size rows; the message names step and rank."""

    def short(generator: torch.Generator, batch_size: int) -> Batch:
        return torch.zeros(batch_size, 2), torch.zeros(batch_size - 1)

    with pytest.raises(
        ValueError,
        match=r"^make_one \(step 0, rank 0\) returned tensors of \[4, 3\] rows; expected 4 each$",
    ):
        make_batches(0, 1, 2, 4, short)


def test_make_batches_rejects_a_non_tuple() -> None:
    """make_one must return a tuple of inputs and target."""
    with pytest.raises(
        ValueError,
        match=r"^make_one \(step 0, rank 0\) must be a tuple of at least two tensors "
        r"\(inputs\.\.\., target\), got \[\]$",
    ):
        make_batches(0, 1, 1, 1, lambda generator, batch_size: [])  # type: ignore[arg-type,return-value]


def test_make_batches_rejects_non_positive_counts() -> None:
    """Counts below one are refused with their name."""
    with pytest.raises(ValueError, match=r"^world_size must be >= 1, got 0$"):
        make_batches(0, 1, 0, 1, _make_one)


def test_assert_state_dicts_equal_accepts_close_values() -> None:
    """Values one fp32 ulp apart pass at default tolerances, though exact equality sees them."""
    expected = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
    actual = {"w": torch.tensor([1.0, 2.0 + 2.0**-22]), "b": torch.tensor(3.0)}
    assert not torch.equal(actual["w"], expected["w"])
    assert_state_dicts_equal(actual, expected)
    with pytest.raises(AssertionError, match=r"^state dicts differ in 1 of 2 entries \['w'\]"):
        assert_state_dicts_equal(actual, expected, rtol=0.0, atol=0.0)


def test_assert_state_dicts_equal_names_the_first_differing_entry() -> None:
    """The message counts differing entries and gives the first one's max abs difference."""
    expected = {
        "a": torch.zeros(2),
        "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "z": torch.ones(1),
    }
    actual = {
        "a": torch.zeros(2),
        "w": torch.tensor([[1.0, 2.0], [3.5, 4.25]]),
        "z": torch.zeros(1),
    }
    with pytest.raises(
        AssertionError,
        match=r"^state dicts differ in 2 of 3 entries \['w', 'z'\]; first 'w': max abs "
        r"difference 0\.5 at index \(1, 0\) \(actual 3\.5, expected 3\.0\)$",
    ):
        assert_state_dicts_equal(actual, expected)


def test_assert_state_dicts_equal_reports_different_keys() -> None:
    """Missing and unexpected keys are listed."""
    with pytest.raises(
        AssertionError,
        match=r"^state dicts have different keys: missing \['b'\], unexpected \['c'\]$",
    ):
        assert_state_dicts_equal(
            {"a": torch.zeros(1), "c": torch.zeros(1)},
            {
                "a": torch.zeros(1),
                "b": torch.zeros(1),
            },
        )


@pytest.mark.parametrize(
    ("actual", "detail"),
    [
        (torch.zeros(3), r"shape \(3,\) != expected \(2,\)"),
        (torch.zeros(2, dtype=torch.float64), r"dtype torch\.float64 != expected torch\.float32"),
    ],
)
def test_assert_state_dicts_equal_reports_shape_and_dtype(
    actual: torch.Tensor, detail: str
) -> None:
    """A shape or dtype mismatch is named with both values."""
    with pytest.raises(AssertionError, match=rf"; first 'w': {detail}$"):
        assert_state_dicts_equal({"w": actual}, {"w": torch.zeros(2)})


def test_assert_state_dicts_equal_honours_tolerances() -> None:
    """Explicit tolerances widen or narrow what counts as equal."""
    expected = {"w": torch.tensor([1.0])}
    actual = {"w": torch.tensor([1.25])}
    assert_state_dicts_equal(actual, expected, rtol=0.0, atol=0.3)
    with pytest.raises(AssertionError, match=r"max abs difference 0\.25 at index \(0,\) "):
        assert_state_dicts_equal(actual, expected, rtol=0.0, atol=0.1)
