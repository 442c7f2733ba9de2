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
sources. That holds only if the data does not change under the run: an
edit anywhere in the text moves every window (the starts are drawn over its
length), so a resume (or a restart, which resumes) after an edit of the
sources or of ``--data`` would train on other batches without a word; it
once showed as losses that differed from step 4 on after a restart at step
3, while a merge edited the sources a test trained on. So the run directory
records the data's :func:`fingerprint` and its vocabulary, and a resumed run
checks both (``_train.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CORPUS_PACKAGES",
    "TOKEN_DTYPES",
    "CharCorpus",
    "TokenFile",
    "fingerprint",
    "load_corpus",
    "load_data",
]

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
    def from_text(cls, text: str, *, ascii_only: bool = True) -> CharCorpus:
        """The corpus of ``text`` (non-ASCII characters dropped unless ``ascii_only`` is false)."""
        if ascii_only:
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
        starts = _starts(len(self.tokens), step=step, rank=rank, batch=batch, seq=seq, seed=seed)
        rows = starts.unsqueeze(1) + torch.arange(seq + 1).unsqueeze(0)
        window = self.tokens[rows]
        return window[:, :-1], window[:, 1:]


def _starts(length: int, *, step: int, rank: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Where the ``batch`` windows of ``step`` on ``rank`` start; see [Note: batches ...]."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + rank)
    return torch.randint(0, length - seq - 1, (batch,), generator=generator)


TOKEN_DTYPES: tuple[str, ...] = ("uint16", "uint32")
"""Element types of a ``.bin`` token file (``--data-dtype``)."""


@dataclass(frozen=True)
class TokenFile:
    """A flat binary file of token ids (nanoGPT's ``train.bin``), memory-mapped, never loaded.

    Attributes:
        path: The file.
        dtype: ``uint16`` or ``uint32``, native byte order.
        length: Number of tokens.
        vocab_size: The largest token id plus one (read once, at open).
    """

    path: str
    dtype: str
    length: int
    vocab_size: int

    @classmethod
    def open(cls, path: str | Path, dtype: str = "uint16") -> TokenFile:
        """The token file at ``path``.

        Raises:
            ValueError: ``dtype`` is not one of :data:`TOKEN_DTYPES`, or the
                file's size is not a multiple of its element size, or it is empty.
        """
        if dtype not in TOKEN_DTYPES:
            raise ValueError(
                f"--data-dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}"
            )
        tokens = _memmap(path, dtype)
        if len(tokens) == 0:
            raise ValueError(f"--data {str(path)!r} holds no tokens")
        return cls(
            path=str(path), dtype=dtype, length=len(tokens), vocab_size=int(tokens.max()) + 1
        )

    def batch(
        self, *, step: int, rank: int, batch: int, seq: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of ``step`` on ``rank``, as :meth:`CharCorpus.batch`."""
        import numpy as np

        if self.length <= seq + 1:
            raise ValueError(
                f"--data {self.path!r} has {self.length} tokens, too few for sequences of "
                f"{seq}; use a shorter --seq"
            )
        tokens = _memmap(self.path, self.dtype)
        starts = _starts(self.length, step=step, rank=rank, batch=batch, seq=seq, seed=seed)
        window = torch.from_numpy(
            np.stack([tokens[s : s + seq + 1] for s in starts.tolist()]).astype(np.int64)
        )
        return window[:, :-1], window[:, 1:]


# A token file's fingerprint hashes this many evenly spaced windows of this many tokens.
_SAMPLES, _SAMPLE_TOKENS = 64, 4096


def fingerprint(data: CharCorpus | TokenFile) -> str:
    """A short hash that changes when the data does (see [Note: batches from the step alone]).

    A text corpus hashes all of its text; a token file (possibly many
    gigabytes) its length and 64 evenly spaced windows, which any insertion,
    deletion or truncation moves and most in-place edits touch.
    """
    digest = hashlib.sha256()
    if isinstance(data, CharCorpus):
        digest.update(data.text.encode("utf-8"))
        return digest.hexdigest()[:16]
    tokens = _memmap(data.path, data.dtype)
    digest.update(f"{data.dtype}:{data.length}".encode())
    stride = max(1, data.length // _SAMPLES)
    for start in range(0, data.length, stride)[:_SAMPLES]:
        digest.update(tokens[start : start + _SAMPLE_TOKENS].tobytes())
    return digest.hexdigest()[:16]


def _memmap(path: str | Path, dtype: str) -> Any:
    import numpy as np

    size = np.dtype(dtype).itemsize
    bytes_ = Path(path).stat().st_size
    if bytes_ % size:
        raise ValueError(
            f"--data {str(path)!r} has {bytes_} bytes, not a whole number of {dtype} tokens; "
            "pass the --data-dtype it was written with"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def load_data(path: str | None, dtype: str = "uint16") -> CharCorpus | TokenFile:
    """What ``--data`` names: shard's sources (``None``), a ``.bin`` of token ids, or a text file.

    A text file is read as UTF-8 and tokenized one character per token, its
    vocabulary the characters it holds (sorted).

    Raises:
        ValueError: the file does not exist, is not UTF-8, or is too small.
    """
    if path is None:
        return load_corpus()
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--data {path!r} is not a file; pass a UTF-8 text file or a .bin")
    if file.suffix == ".bin":
        return TokenFile.open(file, dtype)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--data {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); a file "
            "of token ids must end in .bin"
        ) from exc
    if not text:
        raise ValueError(f"--data {path!r} is empty")
    return CharCorpus.from_text(text, ascii_only=False)


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
