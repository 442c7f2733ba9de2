"""The transformer policy on GPT-2 and Llama from ``transformers``, built from tiny configs."""

from __future__ import annotations

import pytest
from torch import nn

from shard_core import WrapTarget, plan_wraps
from shard_wrap_transformer import BlockList, TransformerBlockPolicy, find_block_list

transformers = pytest.importorskip("transformers")
modeling_gpt2 = pytest.importorskip("transformers.models.gpt2.modeling_gpt2")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def gpt2() -> nn.Module:
    """GPT-2, 2 blocks of 872 elements; the root keeps wte 128, wpe 64, ln_f 16 (lm_head tied)."""
    config = transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def llama() -> nn.Module:
    """Llama, 3 decoder layers of 592 elements; the root keeps embed 128, norm 8, lm_head 128."""
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=0,
    )
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def summary(plan: list[WrapTarget]) -> list[tuple[str, str, int]]:
    return [(t.name, type(t.module).__name__, t.numel) for t in plan]


def test_gpt2_blocks_are_detected_and_wrapped() -> None:
    """GPT2Block in transformer.h is detected; each block is a unit, the root keeps the rest."""
    model = gpt2()
    assert find_block_list(model) == BlockList("transformer.h", modeling_gpt2.GPT2Block, 2, 1744)
    assert summary(plan_wraps(model, TransformerBlockPolicy())) == [
        ("transformer.h.0", "GPT2Block", 872),
        ("transformer.h.1", "GPT2Block", 872),
        ("", "GPT2LMHeadModel", 208),
    ]


def test_llama_decoder_layers_are_detected_and_wrapped() -> None:
    """LlamaDecoderLayer in model.layers is detected; each layer is a unit."""
    model = llama()
    assert find_block_list(model) == BlockList(
        "model.layers", modeling_llama.LlamaDecoderLayer, 3, 1776
    )
    assert summary(plan_wraps(model, TransformerBlockPolicy())) == [
        ("model.layers.0", "LlamaDecoderLayer", 592),
        ("model.layers.1", "LlamaDecoderLayer", 592),
        ("model.layers.2", "LlamaDecoderLayer", 592),
        ("", "LlamaForCausalLM", 264),
    ]


def test_detection_matches_naming_the_class() -> None:
    """The detected plan is the plan of block_classes={LlamaDecoderLayer}, module for module."""
    model = llama()
    detected = plan_wraps(model, TransformerBlockPolicy())
    named = plan_wraps(model, TransformerBlockPolicy({modeling_llama.LlamaDecoderLayer}))
    assert detected == named
