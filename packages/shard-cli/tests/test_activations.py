"""The fake forward counts exactly what a real forward saves for backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shard_cli._activations import lm_activation_profile
from shard_cli.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=40, d_model=32, n_heads=4, n_layers=2, seq_len=16)


def _real_saved_bytes() -> int:
    model = GPT(CONFIG)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.zeros((3, 16), dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
        F.cross_entropy(logits.float().reshape(-1, 40), tokens.reshape(-1))
    return sum(seen.values())


def test_profile_equals_a_real_cpu_forward() -> None:
    """Saved bytes (parameters left out) match a real forward; units in forward order."""
    profile = lm_activation_profile(
        lambda: GPT(CONFIG), ["blocks.0", "blocks.1", ""], batch=3, seq=16, vocab_size=40
    )
    assert profile.order == ("", "blocks.0", "blocks.1")
    assert profile.total == _real_saved_bytes()
    assert profile.saved["blocks.0"] == profile.saved["blocks.1"] > 0
    # The root holds the logits: 3 x 16 x 40 floats, its largest saved tensor.
    assert profile.largest[""] == 3 * 16 * 40 * 4


def test_bf16_saves_about_half() -> None:
    """Computing in bfloat16 halves what blocks save (their tensors are all bf16)."""
    names = ["blocks.0", "blocks.1", ""]
    fp32 = lm_activation_profile(lambda: GPT(CONFIG), names, batch=3, seq=16, vocab_size=40)
    bf16 = lm_activation_profile(
        lambda: GPT(CONFIG), names, batch=3, seq=16, vocab_size=40, dtype=torch.bfloat16
    )
    assert bf16.saved["blocks.0"] * 2 <= fp32.saved["blocks.0"] + 3 * 16 * 4 * 8
    assert bf16.saved["blocks.0"] < fp32.saved["blocks.0"]
