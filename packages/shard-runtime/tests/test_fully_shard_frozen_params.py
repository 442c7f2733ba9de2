"""Fine-tuning trains exactly the parameters that require a gradient, as PyTorch's FSDP does.

Every case runs one script under PyTorch's FSDP and under shard on the same
seeds and data (PyTorch in this test only) and compares losses, which
parameters got a gradient, and the parameters after each optimizer step:
bitwise in fp32, within bf16 rounding under bf16 mixed precision.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from shard_testing import RankPool
from shard_testing.compat import cpu_mesh, fsdp_namespace

_WIDTH = 8


class _LoraBlock(nn.Module):
    """``norm(base(x) + b(a(x)))``: a frozen base and a low-rank adapter in one unit."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.base = nn.Linear(_WIDTH, _WIDTH)
        self.a = nn.Linear(_WIDTH, 2, bias=False)
        self.b = nn.Linear(2, _WIDTH, bias=False)
        self.norm = nn.LayerNorm(_WIDTH)
        self.checkpointed = checkpointed

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.base(x) + self.b(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            out: torch.Tensor = checkpoint(self._body, x, use_reentrant=False)
            return out
        return self._body(x)


class _Net(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(_WIDTH, _WIDTH)
        self.blocks = nn.ModuleList(_LoraBlock(checkpointed) for _ in range(3))
        self.final_norm = nn.LayerNorm(_WIDTH)
        self.head = nn.Linear(_WIDTH, _WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x)).square().mean()


# Which parameters are frozen (by name) before wrapping, and at which step (after wrapping)
# which names change requires_grad to what.
_LORA = ("inp.", "base.", "norm.")
_CASES: dict[str, dict[str, Any]] = {
    "lora": {"frozen": _LORA},
    "lora_no_reshard": {"frozen": _LORA, "reshard_after_forward": False},
    "lora_bf16": {"frozen": _LORA, "bf16": True},
    "lora_checkpointed": {"frozen": _LORA, "checkpointed": True},
    "linear_weights_and_norms": {"frozen": ("inp.", ".weight", "norm.")},
    "first_block_frozen": {"frozen": ("inp.", "blocks.0.")},
    # The root's only trainable parameters are used last; its frozen norm is needed after them.
    "root_frozen_norm_before_head": {"frozen": ("inp.", "final_norm.")},
    "freeze_after_wrap": {"frozen": (), "changes": {1: (("base.", False),)}},
    "unfreeze_after_wrap": {
        "frozen": _LORA,
        "changes": {1: (("blocks.1.base.", True),), 3: (("blocks.1.base.weight", False),)},
    },
    "unfreeze_whole_unit": {
        "frozen": ("inp.", "blocks.0."),
        "changes": {2: (("blocks.0.", True),)},
    },
}


def _set_frozen(model: nn.Module, names: tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        if any(part in name for part in names):
            param.requires_grad_(False)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(impl: str, front_end: str, case: dict[str, Any]) -> dict[str, Any]:
    ns = fsdp_namespace(impl)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = _Net(case.get("checkpointed", False))
    _set_frozen(model, case["frozen"])
    mesh = cpu_mesh()
    if front_end == "fully_shard":
        kwargs: dict[str, Any] = {"mesh": mesh}
        if "reshard_after_forward" in case:
            kwargs["reshard_after_forward"] = case["reshard_after_forward"]
        if case.get("bf16"):
            kwargs["mp_policy"] = ns.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for block in model.blocks:
            ns.fully_shard(block, **kwargs)
        ns.fully_shard(model, **kwargs)
        sharded: nn.Module = model
        warned = False
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded = ns.FullyShardedDataParallel(
                model,
                auto_wrap_policy=importlib.import_module(f"{ns.__name__}.wrap").ModuleWrapPolicy(
                    {_LoraBlock}
                ),
                use_orig_params=True,
                device_id=torch.device("cpu"),
            )
        # Both warn that a unit mixing frozen and trainable parameters spends gradient memory.
        warned = any(
            "requires_grad" in str(w.message) or "frozen" in str(w.message) for w in caught
        )
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.05)
    steps: list[dict[str, Any]] = []
    for step in range(4):
        if case.get("evaluate"):  # a validation forward first: see test_flags_set_...
            with torch.no_grad():
                torch.manual_seed(7 + step)
                sharded(torch.randn(4, _WIDTH))
        for part, value in case.get("changes", {}).get(step, ()):
            for name, param in sharded.named_parameters():
                if part in name:
                    param.requires_grad_(value)
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        loss = sharded(torch.randn(4, _WIDTH))
        loss.backward()
        with_grad = sorted(n for n, p in sharded.named_parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
        params = {n: _full(p) for n, p in sharded.named_parameters()}
        trainable = sorted(n for n, p in sharded.named_parameters() if p.requires_grad)
        steps.append(
            {
                "loss": loss.detach().float(),
                "with_grad": with_grad,
                "params": params,
                "trainable": trainable,
            }
        )
    return {"steps": steps, "warned": warned}


def _compare(front_end: str, name: str) -> list[str]:
    case = _CASES[name]
    torch_run = _train("torch", front_end, case)
    shard_run = _train("shard", front_end, case)
    bf16 = case.get("bf16", False)
    problems: list[str] = []
    if torch_run["warned"] != shard_run["warned"]:
        problems.append(
            f"shard warned about a frozen mix: {shard_run['warned']}, torch: {torch_run['warned']}"
        )
    for step, (ref, got) in enumerate(zip(torch_run["steps"], shard_run["steps"], strict=True)):
        if ref["with_grad"] != got["with_grad"]:
            problems.append(f"step {step}: grads on {got['with_grad']}, torch {ref['with_grad']}")
        for key in ["loss", *ref["params"]]:
            a = ref[key] if key == "loss" else ref["params"][key]
            b = got[key] if key == "loss" else got["params"].get(key)
            if b is None:
                problems.append(f"step {step}: {key} missing")
            elif bf16:
                if not torch.allclose(a, b, rtol=2e-2, atol=1e-2):
                    problems.append(f"step {step}: {key} differs beyond bf16 rounding")
            elif not torch.equal(a, b):
                problems.append(f"step {step}: {key} differs")
    return problems


@pytest.mark.parametrize("name", list(_CASES))
def test_fully_shard_trains_what_requires_grad(rank_pool: RankPool, name: str) -> None:
    """fully_shard with frozen, LoRA-style and re-frozen parameters matches PyTorch step by step."""
    for problems in rank_pool.run(_compare, 2, "fully_shard", name):
        assert problems == []


@pytest.mark.parametrize(
    "name",
    [
        "lora",
        "linear_weights_and_norms",
        "root_frozen_norm_before_head",
        "freeze_after_wrap",
        "unfreeze_after_wrap",
    ],
)
def test_wrapper_trains_what_requires_grad(rank_pool: RankPool, name: str) -> None:
    """The wrapper (use_orig_params=True) with mixed and changing requires_grad matches FSDP1."""
    for problems in rank_pool.run(_compare, 2, "wrapper", name):
        assert problems == []


def _collective_order(frozen: tuple[str, ...], checkpointed: bool) -> list[tuple[str, str, str]]:
    from shard_comms import flight_recorder
    from shard_runtime import fully_shard

    torch.manual_seed(0)
    model = _Net(checkpointed)
    _set_frozen(model, frozen)
    for block in model.blocks:
        fully_shard(block, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    model(torch.randn(4, _WIDTH)).backward()  # the first step sets up the forward order
    recorder = flight_recorder()
    recorder.clear()
    model(torch.randn(4, _WIDTH)).backward()
    return [(e.op, e.label or "", e.phase) for e in recorder.entries()]


@pytest.mark.parametrize(
    ("frozen", "checkpointed"),
    [((), False), (_LORA, False), (_LORA, True)],
    ids=["all_trainable", "lora", "lora_checkpointed"],
)
def test_reduce_scatter_overlaps_the_next_backward(
    rank_pool: RankPool, frozen: tuple[str, ...], checkpointed: bool
) -> None:
    """Each block reduces as soon as its backward is done, before the backward of the block two
    before it gathers: the reduce-scatter overlaps the next backward instead of waiting for the
    end of backward."""
    order = rank_pool.run(_collective_order, 2, frozen, checkpointed)[0]
    reduces = [label for op, label, _ in order if op == "reduce_scatter"]
    # blocks.0 (frozen base, and an input that needs no gradient) and the root (frozen norm
    # needed after its head) reduce at the end of backward, in unit order.
    assert reduces[:2] == ["blocks.2", "blocks.1"], order
    assert sorted(reduces[2:]) == ["_Net", "blocks.0"], order
    gathers = [
        (label, i) for i, (op, label, phase) in enumerate(order) if phase.startswith("backward")
    ]
    position = {label: i for i, (op, label, _) in enumerate(order) if op == "reduce_scatter"}
    first_gather = {label: i for label, i in reversed(gathers)}
    assert position["blocks.2"] < first_gather["blocks.0"], order


def test_frozen_unit_skips_backward_collectives(rank_pool: RankPool) -> None:
    """A unit with every parameter frozen, whose input needs no gradient, neither gathers for
    backward nor reduce-scatters; the frozen root does not reduce either."""
    order = rank_pool.run(_collective_order, 2, ("inp.", "blocks.0."), False)[0]
    backward = [(op, label) for op, label, phase in order if not phase.startswith("forward")]
    assert backward == [
        ("all_gather", "blocks.2"),
        ("all_gather", "blocks.1"),
        ("reduce_scatter", "blocks.2"),
        ("reduce_scatter", "blocks.1"),
        ("reduce_scatter", "_Net"),
    ], order


_TOGGLED = {
    "frozen": _LORA,
    "changes": {
        1: (("blocks.1.base.", True), ("head.", False)),
        2: (("blocks.0.a.", False),),
        3: (("head.", True), ("blocks.1.base.weight", False)),
    },
    "evaluate": True,
}


def _one_process(case: dict[str, Any]) -> list[dict[str, Any]]:
    """``_train``'s steps in one process over every rank's batch, the toggles on the model."""
    torch.manual_seed(0)
    model = _Net(case.get("checkpointed", False))
    _set_frozen(model, case["frozen"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    steps: list[dict[str, Any]] = []
    for step in range(4):
        for part, value in case.get("changes", {}).get(step, ()):
            for name, param in model.named_parameters():
                if part in name:
                    param.requires_grad_(value)
        batches = []
        for rank in range(dist.get_world_size()):
            torch.manual_seed(100 + 10 * step + rank)
            batches.append(torch.randn(4, _WIDTH))
        model(torch.cat(batches)).backward()
        with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps.append({"with_grad": with_grad, "params": params})
    return steps


def _unsharded_face_runs() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    kept = _train("shard", "fully_shard", {**_TOGGLED, "reshard_after_forward": False})
    resharded = _train("shard", "fully_shard", {**_TOGGLED, "reshard_after_forward": True})
    return kept, resharded, _one_process(_TOGGLED)


def test_flags_set_on_the_unsharded_face_are_kept(rank_pool: RankPool) -> None:
    """After a no_grad forward that leaves units unsharded (reshard_after_forward=False),
    named_parameters() gives the unsharded faces; requires_grad_ set on them freezes and
    unfreezes exactly as when it lands on the sharded parameters (reshard_after_forward=True):
    the same gradients, flags and values bit for bit, and the values of one process training
    the plain model on every rank's batch with the same toggles. PyTorch forgets such flags
    (see the differential tester's torch-fully-shard-requires-grad-on-unsharded-face)."""
    for kept, resharded, reference in rank_pool.run(_unsharded_face_runs, 2):
        for step, (got, want) in enumerate(zip(kept["steps"], resharded["steps"], strict=True)):
            assert got["trainable"] == want["trainable"], step
            assert got["with_grad"] == want["with_grad"], step
            assert torch.equal(got["loss"], want["loss"]), step
            for name, value in want["params"].items():
                assert torch.equal(got["params"][name], value), (step, name)
        # and both train as one process does with the same toggles on the plain model
        for step, (got, ref) in enumerate(zip(kept["steps"], reference, strict=True)):
            assert got["with_grad"] == ref["with_grad"], step
            for name, value in ref["params"].items():
                torch.testing.assert_close(got["params"][name], value, msg=f"{step} {name}")
        steps = kept["steps"]
        assert "head.weight" not in steps[1]["with_grad"]
        assert "blocks.1.base.weight" in steps[1]["with_grad"]
        assert "blocks.0.a.weight" not in steps[2]["with_grad"]
        assert "head.weight" in steps[3]["with_grad"]
        assert "blocks.1.base.weight" not in steps[3]["with_grad"]
        assert "blocks.1.base.bias" in steps[3]["trainable"]
