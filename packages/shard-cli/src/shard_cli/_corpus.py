"""The text ``shard train`` learns: shard's own Python sources, one character per token.

Why this text: it ships with every installation (no download), it is large
enough (hundreds of kilobytes) that a small model does not memorize it in a
demo's few hundred steps, and a person can tell from a generated sample
whether the model learned something (indentation, ``def``, docstrings).

[Note: batches from the step alone]
The batch of a step is drawn from a generator seeded by ``(seed, step,
rank)`` and nothing else: no sampler state to checkpoint, a resumed run
sees exactly the batches an uninterrupted one would have seen, and every
rank draws its own. The same corpus on every rank needs the same installed
sources; the vocabulary is stored with the run so a resumed run checks it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["CORPUS_PACKAGES", "CharCorpus", "load_corpus"]

CORPUS_PACKAGES: tuple[str, ...] = (
    "shard_core",
    "shard_comms",
    "shard_runtime",
    "shard_checkpoint",
    "shard_cli",
)
"""Import names whose ``.py`` files make the corpus, in this order."""


@dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus: the text, its vocabulary and the text as token ids.

    Attributes:
        text: The whole corpus (ASCII only).
        vocab: Every character of ``text``, sorted; token ``i`` is ``vocab[i]``.
        tokens: ``text`` as token ids, 1-D int64.
    """

    text: str
    vocab: str
    tokens: torch.Tensor = field(repr=False)

    @classmethod
    def from_text(cls, text: str) -> CharCorpus:
        """The corpus of ``text`` (non-ASCII characters dropped)."""
        text = "".join(ch for ch in text if ch.isascii())
        vocab = "".join(sorted(set(text)))
        index = {ch: i for i, ch in enumerate(vocab)}
        tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        return cls(text=text, vocab=vocab, tokens=tokens)

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens."""
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text``; characters outside the vocabulary are an error."""
        index = {ch: i for i, ch in enumerate(self.vocab)}
        missing = sorted({ch for ch in text if ch not in index})
        if missing:
            raise ValueError(
                f"cannot encode {text!r}: characters {missing!r} are not in the corpus "
                "vocabulary; use characters that occur in shard's sources"
            )
        return torch.tensor([index[ch] for ch in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        """The text of token ids ``tokens`` (1-D)."""
        return "".join(self.vocab[int(t)] for t in tokens.tolist())

    def batch(
        self, *, step: int, rank: int, batch: int, seq: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets of ``step`` on ``rank``: two ``(batch, seq)`` int64.

        See [Note: batches from the step alone].
        """
        if len(self.tokens) <= seq + 1:
            raise ValueError(
                f"the corpus has {len(self.tokens)} characters, too few for sequences of "
                f"{seq}; use a shorter --seq"
            )
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + rank)
        starts = torch.randint(0, len(self.tokens) - seq - 1, (batch,), generator=generator)
        rows = starts.unsqueeze(1) + torch.arange(seq + 1).unsqueeze(0)
        window = self.tokens[rows]
        return window[:, :-1], window[:, 1:]


def _source_files(package: str) -> list[Path]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    files: list[Path] = []
    for location in spec.submodule_search_locations:
        files.extend(sorted(Path(location).rglob("*.py")))
    return files


def load_corpus(packages: tuple[str, ...] = CORPUS_PACKAGES) -> CharCorpus:
    """The corpus of ``packages``' Python sources, found without importing them.

    Raises:
        RuntimeError: none of the packages has a source file (an installation
            without sources, a zip say).
    """
    parts: list[str] = []
    for package in packages:
        for path in _source_files(package):
            parts.append(path.read_text(encoding="utf-8", errors="ignore"))
    if not parts:
        raise RuntimeError(
            f"found no Python sources for {', '.join(packages)} to train on; install the "
            "shard packages from a shard checkout (pip install ./packages/shard-cli; not a "
            "zipped build, nor PyPI's unrelated shard-cli)"
        )
    return CharCorpus.from_text("\n".join(parts))
