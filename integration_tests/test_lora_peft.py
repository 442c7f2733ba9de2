"""LoRA fine-tuning on shard's ``fully_shard`` gives PyTorch's results, frozen weights untouched.

Each test runs one rank function on two gloo ranks. It trains the same
model twice in the same processes, first on PyTorch's ``fully_shard`` and
then on shard's, each from ``torch.manual_seed(0)`` with the same per-rank
batches: ``fully_shard`` on every block, then on the root (as accelerate
and torchtitan do), AdamW on the trainable parameters, three steps. The
rank compares the two runs and returns a small summary of plain values:

- the losses of every step (bitwise equal in fp32; within bf16 rounding
  under a bf16 ``MixedPrecisionPolicy``);
- which parameters were frozen and changed anyway (none may), which
  trainable ones did not change (none may);
- which parameters ended with ``.grad is None`` (PyTorch's set);
- the adapter-only full state dict (``ignore_frozen_params``): PyTorch's
  keys, and the values of gradients, trained parameters and state dict
  equal to PyTorch's.

The workloads: Hugging Face ``peft`` LoRA on a tiny ``LlamaForCausalLM``
built from a config (no download), a hand-written LoRA linear
``base(x) + b(a(x))`` with ``base`` frozen, and a block whose Linear
weights and LayerNorm are frozen while its biases train. Activation
checkpointing (non-reentrant) comes two ways, both of which PyTorch's
``fully_shard`` runs: PyTorch's ``checkpoint_wrapper`` around each block
before ``fully_shard`` (torchtitan's way; the sharding hooks stay outside
the recomputed region), and for the Llama also Hugging Face's
``activation_checkpointing_enable`` (the Trainer's way; the hooks run
inside it). Training passes ``use_cache=False``: a recomputed decoder
layer would append to the KV cache a second time.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor

from shard_testing import RankPool
from shard_testing.compat import Impl, cpu_mesh, fsdp_namespace

peft = pytest.importorskip("peft", reason="peft is not installed (the dev environment has it)")

Workload = Literal["peft_llama", "hand_lora", "frozen_norms"]
# Activation checkpointing: none; PyTorch's checkpoint_wrapper around each block before
# fully_shard (torchtitan's way: the sharding hooks stay outside the recomputed region); or
# Hugging Face's activation_checkpointing_enable (the Trainer's way: each decoder layer's
# __call__, the sharding hooks included, runs inside torch.utils.checkpoint).
Checkpointing = Literal["none", "wrapper", "hf"]

WORLD = 2
STEPS = 3
LR = 1e-2
# torch.testing's defaults for bfloat16 (about two bf16 ulps relative): losses, gradients and
# trained parameters under a bf16 MixedPrecisionPolicy may differ by the rounding of the bf16
# forward and backward; parameters and reductions stay fp32, so fp32 runs compare bitwise.
BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB, SEQ, BATCH = 96, 16, 2
DIM_IN, DIM, LORA_RANK = 6, 9, 3  # odd sizes: the toy models' shards are uneven on two ranks

# transformers 5 deprecated PreTrainedModel.is_gradient_checkpointing; peft (0.21) still reads
# it in PeftModel.__init__. Only that FutureWarning is tolerated.
PEFT_DEPRECATION = "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"


class LoraLinear(nn.Module):
    """``base(x) + b(a(x))``: a frozen linear with a trainable rank-``rank`` adapter."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.a = nn.Linear(dim, rank, bias=False)
        self.b = nn.Linear(rank, dim, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.b(self.a(x))
        return out


class LoraBlock(nn.Module):
    """``x + tanh(proj(x))`` with ``proj`` a :class:`LoraLinear`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = LoraLinear(DIM, LORA_RANK)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + torch.tanh(self.proj(x))
        return out


class NormBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM + 1)
        self.fc2 = nn.Linear(2 * DIM + 1, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))
        return out


class BlockNet(nn.Module):
    """A frozen input projection, two blocks in a ``ModuleList``, a trainable head."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM_IN, DIM)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, 3)
        self.embed.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _build(workload: Workload, hf_checkpointing: bool) -> tuple[nn.Module, nn.ModuleList]:
    """The model (same values on every rank after ``torch.manual_seed``) and its blocks."""
    if workload == "peft_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        llama = LlamaForCausalLM(config)
        llama.set_attn_implementation("eager")  # one attention kernel, the plainest
        if hf_checkpointing:
            llama.activation_checkpointing_enable({"use_reentrant": False})
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
        model: nn.Module = peft.get_peft_model(llama, lora)  # adapters injected in place
        return model, llama.model.layers
    if hf_checkpointing:
        raise ValueError(f"{workload} is no Hugging Face model")
    if workload == "hand_lora":
        net = BlockNet([LoraBlock(), LoraBlock()])
        return net, net.blocks
    net = BlockNet([NormBlock(), NormBlock()])
    frozen = net.blocks[0]
    assert isinstance(frozen, NormBlock)
    frozen.norm.requires_grad_(False)
    frozen.fc1.weight.requires_grad_(False)
    frozen.fc2.weight.requires_grad_(False)
    return net, net.blocks


def _loss(workload: Workload, model: nn.Module, step: int) -> torch.Tensor:
    """This rank's loss at ``step``: each rank and step has its own batch."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    if workload == "peft_llama":
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss: torch.Tensor = model(input_ids=ids, labels=ids, use_cache=False).loss
        return loss
    # 2-D input: the root's output is no view (PyTorch's fully_shard warns about views).
    out: torch.Tensor = model(torch.randn(BATCH * SEQ, DIM_IN, generator=g))
    return out.float().square().mean()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) parameter or gradient (a collective if sharded)."""
    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().clone()


def _model_state_dict(impl: Impl, model: nn.Module) -> dict[str, Any]:
    """The adapter-only full state dict, by PyTorch's DCP helpers or by shard_checkpoint."""
    if impl == "torch":
        from torch.distributed.checkpoint import state_dict as checkpoint
    else:
        import shard_checkpoint as checkpoint  # type: ignore[no-redef]
    options = checkpoint.StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
    )
    return checkpoint.get_model_state_dict(model, options=options)


def _train(
    impl: Impl, workload: Workload, bf16: bool, reshard: bool, checkpointing: Checkpointing
) -> dict[str, Any]:
    """Shard the workload with ``impl``, train ``STEPS`` AdamW steps; values to compare."""
    fsdp = fsdp_namespace(impl)
    torch.manual_seed(0)
    model, blocks = _build(workload, hf_checkpointing=checkpointing == "hf")
    if checkpointing == "wrapper":
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    policy = (
        fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else fsdp.MixedPrecisionPolicy()
    )
    mesh = cpu_mesh()
    for block in blocks:
        fsdp.fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fsdp.fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(workload, model, step)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.item())
        optimizer.step()
    grads = {n: None if p.grad is None else _full(p.grad) for n, p in model.named_parameters()}
    after = {n: _full(p) for n, p in model.named_parameters()}
    state = _model_state_dict(impl, model)
    return {
        "losses": losses,
        "trainable": trainable,
        "before": before,
        "after": after,
        "grads": grads,
        "state_dict": {k: v.detach().clone() for k, v in state.items()},
    }


def _difference(got: torch.Tensor, want: torch.Tensor, bf16: bool) -> str | None:
    """Why ``got`` is not ``want`` (bitwise, or within bf16 rounding), or None."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    if bf16:
        try:
            torch.testing.assert_close(got, want, rtol=BF16_RTOL, atol=BF16_ATOL)
        except AssertionError as exc:
            return " ".join(str(exc).split())
        return None
    if torch.equal(got, want):
        return None
    return f"max abs difference {(got - want).abs().max().item():.3e}"


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    """The plain facts of one run that must equal PyTorch's or hold for both."""
    before, after, trainable = run["before"], run["after"], run["trainable"]
    return {
        "losses": run["losses"],
        "trainable": len(trainable),
        "frozen": len(before) - len(trainable),
        "frozen_changed": sorted(
            n for n in before if n not in trainable and not torch.equal(before[n], after[n])
        ),
        "trainable_unchanged": sorted(n for n in trainable if torch.equal(before[n], after[n])),
        "grad_none": sorted(n for n, g in run["grads"].items() if g is None),
        "state_dict_keys": sorted(run["state_dict"]),
    }


def _compare(
    workload: Workload,
    bf16: bool,
    reshard: bool,
    checkpointing: Checkpointing,
    candidate: Impl = "shard",
) -> dict[str, Any]:
    """Train on PyTorch's fully_shard, then on ``candidate``'s; the summaries and differences.

    ``candidate="torch"`` compares PyTorch with itself, which checks the test: every check
    passed that way when it was written, and perturbing the second run (its learning rate, one
    frozen shard, one gradient, a state-dict key or value) failed the matching check.
    """
    reference = _train("torch", workload, bf16, reshard, checkpointing)
    result = _train(candidate, workload, bf16, reshard, checkpointing)
    differences: list[str] = []
    for kind in ("grads", "after", "state_dict"):
        for name, want in reference[kind].items():
            got = result[kind].get(name)
            if want is None or got is None:
                continue  # a missing gradient or key shows in the summaries
            why = _difference(got, want, bf16)
            if why is not None:
                differences.append(f"{kind} {name}: {why}")
    return {
        "torch": _summary(reference),
        "candidate": _summary(result),
        "differences": differences,
    }


def _check(summaries: list[dict[str, Any]], bf16: bool) -> None:
    """Every rank's candidate run matches PyTorch's; PyTorch's own run is a sound reference."""
    for rank, summary in enumerate(summaries):
        reference, result = summary["torch"], summary["candidate"]
        # The reference itself: frozen weights stay, adapters train, only rank 0 holds the
        # offloaded full state dict and it holds exactly the trainable parameters.
        assert reference["trainable"] > 0
        assert reference["frozen"] > 0
        assert reference["frozen_changed"] == []
        assert reference["trainable_unchanged"] == []
        assert len(reference["state_dict_keys"]) == (reference["trainable"] if rank == 0 else 0)

        assert result["frozen_changed"] == [], f"rank {rank}: frozen weights changed"
        assert result["trainable_unchanged"] == [], f"rank {rank}: adapters did not train"
        for key in ("grad_none", "state_dict_keys"):
            got, want = result[key], reference[key]
            assert got == want, (
                f"rank {rank}: {key}: only shard has {sorted(set(got) - set(want))}, "
                f"only PyTorch has {sorted(set(want) - set(got))}"
            )
        if bf16:
            torch.testing.assert_close(
                result["losses"], reference["losses"], rtol=BF16_RTOL, atol=BF16_ATOL
            )
        else:
            hexed = [[float.hex(x) for x in s["losses"]] for s in (result, reference)]
            assert hexed[0] == hexed[1], f"rank {rank}: losses"
        assert summary["differences"] == [], f"rank {rank}: values differ from PyTorch's"


@pytest.mark.filterwarnings(PEFT_DEPRECATION)
@pytest.mark.parametrize("checkpointing", ["none", "wrapper", "hf"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_peft_llama_lora(
    rank_pool: RankPool, bf16: bool, reshard: bool, checkpointing: Checkpointing
) -> None:
    """peft LoRA on a tiny Llama trains exactly as on PyTorch's fully_shard: losses, untouched
    base weights, trained adapters, the same missing gradients and adapter-only state dict."""
    summaries = rank_pool.run(_compare, WORLD, "peft_llama", bf16, reshard, checkpointing)
    _check(summaries, bf16)


@pytest.mark.parametrize(
    ("bf16", "checkpointing"),
    [(False, "none"), (True, "none"), (False, "wrapper")],
    ids=["fp32", "bf16", "fp32-wrapper"],
)
@pytest.mark.parametrize("workload", ["hand_lora", "frozen_norms"])
def test_frozen_parts_of_a_unit(
    rank_pool: RankPool, workload: Workload, bf16: bool, checkpointing: Checkpointing
) -> None:
    """A hand-written LoRA linear (frozen base) and a block with frozen Linear weights and
    LayerNorm train as on PyTorch's fully_shard, frozen parameters bitwise unchanged."""
    summaries = rank_pool.run(_compare, WORLD, workload, bf16, True, checkpointing)
    _check(summaries, bf16)
