"""The training text: vocabulary, encoding, and batches that depend on the step alone."""

from __future__ import annotations

import pytest
import torch

from shard_cli import CharCorpus, load_corpus


def test_from_text_keeps_ascii_and_sorts_the_vocabulary() -> None:
    """Non-ASCII characters are dropped; tokens index the sorted vocabulary."""
    corpus = CharCorpus.from_text("bca\u00e9a")
    assert corpus.vocab == "abc"
    assert corpus.tokens.tolist() == [1, 2, 0, 0]
    assert corpus.decode(corpus.encode("cab")) == "cab"


def test_encode_names_characters_outside_the_vocabulary() -> None:
    """Encoding an unknown character is an error naming it."""
    with pytest.raises(ValueError, match=r"characters \['z'\] are not in the corpus vocabulary"):
        CharCorpus.from_text("abc").encode("az")


def test_batches_depend_on_seed_step_and_rank_only() -> None:
    """The same (seed, step, rank) gives the same batch; targets are inputs shifted by one."""
    corpus = CharCorpus.from_text("".join(chr(97 + i % 26) for i in range(500)))
    x, y = corpus.batch(step=3, rank=1, batch=4, seq=8, seed=0)
    x2, y2 = corpus.batch(step=3, rank=1, batch=4, seq=8, seed=0)
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(x, x2)
    assert torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    other, _ = corpus.batch(step=3, rank=0, batch=4, seq=8, seed=0)
    assert not torch.equal(x, other)


def test_batch_needs_a_corpus_longer_than_the_sequence() -> None:
    """A sequence as long as the corpus is an error that suggests a shorter --seq."""
    with pytest.raises(
        ValueError, match=r"the corpus has 5 characters, too few for sequences of 8"
    ):
        CharCorpus.from_text("abcde").batch(step=1, rank=0, batch=1, seq=8, seed=0)


def test_load_corpus_reads_shard_sources() -> None:
    """The default corpus is shard's own Python code: large, with ``def`` in it."""
    corpus = load_corpus()
    assert len(corpus.text) > 100_000
    assert "def fully_shard(" in corpus.text
    assert 60 < corpus.vocab_size < 128
