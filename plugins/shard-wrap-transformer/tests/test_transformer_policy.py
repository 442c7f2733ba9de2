"""The transformer wrap policy and block detection, registered in memory like its entry point."""

from __future__ import annotations

import logging

import pytest
from torch import nn

import shard_wrap_transformer
from shard_core import Registry, WrapPlanError, WrapTarget, make_plugin_manager, plan_wraps
from shard_core.protocols import WrapPolicy
from shard_wrap_transformer import (
    BlockList,
    TransformerBlockPolicy,
    detect_block_class,
    find_block_list,
)
from shard_wrap_transformer import plugin as transformer_plugin


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)  # 216 elements
        self.proj = nn.Linear(8, 8)  # 72 elements


class Block(nn.Module):
    """584 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)  # 16 elements
        self.attn = Attention()  # 288 elements
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))  # 280 elements


class Toy(nn.Module):
    """A toy decoder: embed 128, three Blocks in ``layers``, norm 16, head 128."""

    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([Block() for _ in range(num_layers)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)  # 72 elements


class MoEBlock(nn.Module):
    """A block holding its own ModuleList of four experts (288 elements), 304 in all."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.experts = nn.ModuleList([Expert() for _ in range(4)])


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([MoEBlock(), MoEBlock()])


class EncoderDecoder(nn.Module):
    """Two block lists: encoder.layers (2 Blocks, 1168) and decoder.layers (3 MoEBlocks, 912)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([Block(), Block()])
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([MoEBlock() for _ in range(3)])


class SubBlock(Block):
    pass


class NoBlocks(nn.Module):
    """ModuleLists, none of which qualifies: mixed classes, a single entry, no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed = nn.ModuleList([Block(), SubBlock()])
        self.single = nn.ModuleList([Block()])
        self.drops = nn.ModuleList([nn.Dropout(), nn.Dropout()])


def registry() -> Registry:
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(transformer_plugin, name="wrap-transformer")
    return Registry(pm)


def summary(plan: list[WrapTarget]) -> list[tuple[str, int]]:
    return [(t.name, t.numel) for t in plan]


TOY_PLAN = [("layers.0", 584), ("layers.1", 584), ("layers.2", 584), ("", 272)]


def test_plugin_registers_transformer() -> None:
    """The plugin module's hook adds "transformer" next to the built-in policies."""
    reg = registry()
    assert reg.wrap_policies()["transformer"] is TransformerBlockPolicy
    assert reg.plugin_names() == ["builtins", "wrap-transformer"]


def test_registry_builds_a_detecting_policy() -> None:
    """wrap_policy("transformer") with no options detects the block class when it plans."""
    policy = registry().wrap_policy("transformer")
    assert isinstance(policy, TransformerBlockPolicy)
    assert policy.block_classes is None
    assert summary(plan_wraps(Toy(), policy)) == TOY_PLAN
    assert policy.detected_block_class is Block


def test_registry_passes_block_classes() -> None:
    """wrap_policy("transformer", block_classes=...) makes those classes the units."""
    policy = registry().wrap_policy("transformer", block_classes={Attention})
    assert isinstance(policy, TransformerBlockPolicy)
    assert policy.block_classes == (Attention,)
    assert summary(plan_wraps(Toy(2), policy)) == [
        ("layers.0.attn", 288),
        ("layers.1.attn", 288),
        ("", 864),
    ]
    assert policy.detected_block_class is None


def test_given_classes_need_no_block_list() -> None:
    """With block classes given, a model with no ModuleList plans, subclasses matching too."""
    model = nn.Sequential(Block(), SubBlock(), nn.Linear(8, 2))
    policy = TransformerBlockPolicy([Block, Block])
    assert isinstance(policy, WrapPolicy)
    assert policy.block_classes == (Block,)
    assert summary(plan_wraps(model, policy)) == [("0", 584), ("1", 584), ("", 18)]


def test_single_class_is_accepted() -> None:
    """One class stands for a set of one."""
    assert TransformerBlockPolicy(Block).block_classes == (Block,)


def test_detects_the_repeated_class_of_a_module_list() -> None:
    """The block list is the ModuleList of same-class entries; its class is the block class."""
    model = Toy()
    assert find_block_list(model) == BlockList("layers", Block, 3, 1752)
    assert detect_block_class(model) is Block


def test_the_list_holding_most_parameters_wins() -> None:
    """Of blocks and the experts inside them, the list of blocks (it holds the experts) wins."""
    assert find_block_list(MoE()) == BlockList("layers", MoEBlock, 2, 608)
    assert summary(plan_wraps(MoE(), TransformerBlockPolicy())) == [
        ("layers.0", 304),
        ("layers.1", 304),
        ("", 128),
    ]


def test_of_two_stacks_the_larger_one_wins() -> None:
    """encoder.layers (1168 elements) beats decoder.layers (912): only Blocks become units."""
    assert find_block_list(EncoderDecoder()) == BlockList("encoder.layers", Block, 2, 1168)
    plan = plan_wraps(EncoderDecoder(), TransformerBlockPolicy())
    assert [t.name for t in plan] == ["encoder.layers.0", "encoder.layers.1", ""]


def test_equal_lists_go_to_the_first() -> None:
    """Two lists holding as many elements: the first in named_modules() order wins."""
    model = nn.Module()
    model.a = nn.ModuleList([Expert(), Expert()])
    model.b = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    assert find_block_list(model) == BlockList("a", Expert, 2, 144)


def test_the_model_itself_can_be_the_list() -> None:
    """A ModuleList root is its own block list (the walker then refuses it as the root unit)."""
    model = nn.ModuleList([Block(), Block()])
    assert find_block_list(model) == BlockList("", Block, 2, 1168)


def test_no_block_list_is_an_error_naming_the_lists_seen() -> None:
    """Planning a model with no block list says why each list failed and to pass block_classes."""
    with pytest.raises(
        WrapPlanError,
        match=r"^TransformerBlockPolicy: found no transformer block class in NoBlocks: no "
        r"nn\.ModuleList in it holds two or more modules of one class with parameters "
        r"\(nn\.ModuleLists seen: 'mixed': 2 entries of Block, SubBlock, 1168 parameter "
        r"elements; 'single': 1 entry of Block, 584 parameter elements; 'drops': 2 entries "
        r"of Dropout, 0 parameter elements\); name the block classes instead: "
        r"TransformerBlockPolicy\(block_classes=\{MyBlock\}\), or "
        r'wrap_policy\("transformer", block_classes=\{MyBlock\}\)$',
    ):
        plan_wraps(NoBlocks(), TransformerBlockPolicy())
    assert find_block_list(NoBlocks()) is None


def test_failed_detection_forgets_the_previous_model() -> None:
    """After a model with no block list, the class detected on an earlier model is dropped."""
    policy = TransformerBlockPolicy()
    plan_wraps(Toy(), policy)
    with pytest.raises(WrapPlanError, match=r"^TransformerBlockPolicy: found no transformer"):
        plan_wraps(NoBlocks(), policy)
    assert policy.detected_block_class is None


def test_model_without_any_module_list() -> None:
    """A model with no ModuleList at all is refused with 'none' seen."""
    with pytest.raises(
        WrapPlanError,
        match=r"^TransformerBlockPolicy: found no transformer block class in Linear: .* "
        r"\(nn\.ModuleLists seen: none\); name the block classes instead",
    ):
        detect_block_class(nn.Linear(2, 2))


def test_wrap_before_the_root_is_an_error() -> None:
    """A detecting policy asked wrap() before descend() on a root says how to use it."""
    with pytest.raises(
        WrapPlanError,
        match=r"^TransformerBlockPolicy: asked about module 'layers\.0' \(Block\) before it saw "
        r"a root to detect the block class on; plan with shard_core\.plan_wraps\(model, "
        r"policy\), which shows it the root first, or name the block classes: "
        r"TransformerBlockPolicy\(block_classes=\{MyBlock\}\)$",
    ):
        TransformerBlockPolicy().wrap(Block(), "layers.0", 584)


def test_each_plan_detects_on_its_own_root() -> None:
    """One policy planning two models detects each model's block class."""
    policy = TransformerBlockPolicy()
    assert [t.name for t in plan_wraps(MoE(), policy)] == ["layers.0", "layers.1", ""]
    first = policy.detected_block_class
    assert summary(plan_wraps(Toy(), policy)) == TOY_PLAN
    assert (first, policy.detected_block_class) == (MoEBlock, Block)


def test_detection_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The detected class, where it was found and its size go to the shard.wrap debug log."""
    caplog.set_level(logging.DEBUG, logger="shard.wrap")
    plan_wraps(Toy(), TransformerBlockPolicy())
    assert caplog.messages == [
        "TransformerBlockPolicy: detected block class Block from 'layers' (3 blocks, "
        "1752 parameter elements)"
    ]


def test_repr_shows_given_or_detected_classes() -> None:
    """The repr names the given classes, or None and, once planned, the detected class."""
    assert repr(TransformerBlockPolicy({Block})) == "TransformerBlockPolicy(block_classes={Block})"
    policy = TransformerBlockPolicy()
    assert repr(policy) == "TransformerBlockPolicy(block_classes=None)"
    plan_wraps(Toy(), policy)
    assert repr(policy) == "TransformerBlockPolicy(block_classes=None, detected=Block)"


def test_empty_block_classes_is_rejected() -> None:
    """An empty block_classes is refused: None, not empty, asks for detection."""
    with pytest.raises(
        WrapPlanError,
        match=r"^TransformerBlockPolicy: block_classes is empty, so no module would become a "
        r"unit; name the block classes, e.g. block_classes=\{MyBlock\}, or pass None to "
        r"detect the block class$",
    ):
        TransformerBlockPolicy(set())


def test_non_class_entry_is_rejected() -> None:
    """A class name given as a string is refused with the value seen."""
    with pytest.raises(
        WrapPlanError,
        match=r"^TransformerBlockPolicy: block_classes must hold nn\.Module subclasses, got "
        r"'GPT2Block' \(str\); pass the class itself, e.g. block_classes=\{MyBlock\}$",
    ):
        TransformerBlockPolicy({"GPT2Block"})  # type: ignore[arg-type]


def test_string_block_classes_is_rejected() -> None:
    """A bare string is not taken for a set of classes."""
    with pytest.raises(
        WrapPlanError,
        match=r"^TransformerBlockPolicy: block_classes must be a set of nn\.Module subclasses "
        r"or None, got 'GPT2Block' \(str\); pass e\.g\. block_classes=\{MyBlock\}, or None "
        r"to detect the block class$",
    ):
        TransformerBlockPolicy("GPT2Block")  # type: ignore[arg-type]


def test_container_block_class_is_rejected() -> None:
    """ModuleList has no forward, so naming it as a block class is refused up front."""
    with pytest.raises(
        WrapPlanError,
        match=r"^TransformerBlockPolicy: block_classes holds ModuleList, which has no forward, "
        r"so it cannot be a unit; name the class of its entries instead$",
    ):
        TransformerBlockPolicy({nn.ModuleList})


def test_package_exports() -> None:
    """The package's public names are the policy, the detection functions and the version."""
    assert shard_wrap_transformer.__all__ == [
        "BlockList",
        "TransformerBlockPolicy",
        "__version__",
        "detect_block_class",
        "find_block_list",
    ]
