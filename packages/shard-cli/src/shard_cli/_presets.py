"""Named model sizes for ``shard train`` and ``shard plan``.

``tiny`` and ``small`` train on a 2-core laptop (``small`` is the default of
``shard train``: about a minute on two CPU ranks); the GPT-2 sizes and the
larger ones are there so ``shard plan`` answers "will it fit" for models
people know, and so ``shard train`` scales up on GPUs with one flag.

The names are ``--preset``'s choices, so this module stays free of torch:
the model's config class is imported only when a preset builds one (see
[Note: lazy public names] in ``__init__.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shard_cli.gpt import GPTConfig

__all__ = ["PRESETS", "Preset", "get_preset"]


@dataclass(frozen=True)
class Preset:
    """A model size and the training settings that suit it.

    Attributes:
        name: What ``--preset`` takes.
        d_model: Width of the residual stream.
        n_heads: Attention heads per block.
        n_layers: Number of blocks.
        seq_len: Context length (the position embedding's rows; ``--seq`` default).
        vocab_size: Token ids; ``None`` means the character vocabulary of the
            training corpus (about 95).
        steps: Default number of optimizer steps.
        batch: Default sequences per rank per step.
        lr: Default AdamW learning rate.
        description: One line for ``--help`` and ``shard plan``.
    """

    name: str
    d_model: int
    n_heads: int
    n_layers: int
    seq_len: int
    vocab_size: int | None
    steps: int
    batch: int
    lr: float
    description: str

    def config(
        self,
        *,
        vocab_size: int | None = None,
        seq_len: int | None = None,
        d_model: int | None = None,
        n_heads: int | None = None,
        n_layers: int | None = None,
    ) -> GPTConfig:
        """The model's sizes, with the given fields replaced.

        Raises:
            ValueError: the preset has no vocabulary of its own and ``vocab_size``
                is ``None``, or the sizes are inconsistent (see ``GPTConfig``).
        """
        vocab = self.vocab_size if self.vocab_size is not None else vocab_size
        if vocab is None:
            raise ValueError(
                f"preset {self.name!r} uses the corpus' character vocabulary: pass vocab_size"
            )
        from shard_cli.gpt import GPTConfig

        return GPTConfig(
            vocab_size=vocab,
            d_model=d_model or self.d_model,
            n_heads=n_heads or self.n_heads,
            n_layers=n_layers or self.n_layers,
            seq_len=seq_len or self.seq_len,
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", 64, 4, 2, 64, None, 40, 8, 3e-3, "2 blocks of width 64 (~0.1 M params)"),
        Preset("small", 128, 4, 3, 64, None, 400, 16, 3e-3, "3 blocks of width 128 (~0.6 M)"),
        Preset(
            "gpt2",
            768,
            12,
            12,
            1024,
            50257,
            1000,
            8,
            6e-4,
            "GPT-2 small's shape, 163 M (untied head)",
        ),
        Preset(
            "gpt2-medium", 1024, 16, 24, 1024, 50257, 1000, 8, 3e-4, "GPT-2 medium's shape, 406 M"
        ),
        Preset(
            "gpt2-large", 1280, 20, 36, 1024, 50257, 1000, 8, 2.5e-4, "GPT-2 large's shape, 838 M"
        ),
        Preset("gpt2-xl", 1600, 25, 48, 1024, 50257, 1000, 8, 2e-4, "GPT-2 XL's shape, 1.6 B"),
        Preset("gpt-7b", 4096, 32, 32, 2048, 50257, 1000, 4, 1.2e-4, "GPT-3 6.7B's shape, 6.9 B"),
        Preset("gpt-13b", 5120, 40, 40, 2048, 50257, 1000, 4, 1e-4, "GPT-3 13B's shape, 13.1 B"),
    )
}
"""Every preset by name."""


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ValueError: no preset has that name (the message lists them).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}") from None
