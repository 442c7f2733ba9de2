"""The training text: vocabulary, encoding, and batches that depend on the step alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shard_cli import CharCorpus, load_corpus
from shard_cli._corpus import TokenFile, fingerprint, load_data


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


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_batches_equal_the_same_tokens_in_memory(tmp_path: Path, dtype: str) -> None:
    """A .bin of token ids gives the batches a corpus of the same tokens gives, step by step."""
    ids = np.arange(300, dtype=dtype) * 7 % 1000
    ids.tofile(tmp_path / "train.bin")
    tokens = load_data(str(tmp_path / "train.bin"), dtype)
    assert isinstance(tokens, TokenFile)
    assert (tokens.length, tokens.vocab_size) == (
        300,
        996,
    )  # 7 * 285 % 1000 = 995 is the largest id
    same = CharCorpus(text="", vocab="", tokens=torch.from_numpy(ids.astype(np.int64)))
    for step in (1, 2):
        x, y = tokens.batch(step=step, rank=1, batch=3, seq=10, seed=5)
        ex, ey = same.batch(step=step, rank=1, batch=3, seq=10, seed=5)
        assert x.dtype == torch.long
        assert torch.equal(x, ex)
        assert torch.equal(y, ey)


def test_token_file_of_the_wrong_dtype_size_names_the_flag(tmp_path: Path) -> None:
    """A .bin whose size is not a whole number of tokens says to pass --data-dtype."""
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"has 3 bytes, not a whole number of uint16 tokens"):
        load_data(str(tmp_path / "odd.bin"))


def test_text_data_keeps_every_character(tmp_path: Path) -> None:
    """A UTF-8 text file is one token per character, non-ASCII ones included."""
    (tmp_path / "t.txt").write_text("caf\u00e9 ab", encoding="utf-8")
    corpus = load_data(str(tmp_path / "t.txt"))
    assert isinstance(corpus, CharCorpus)
    assert corpus.vocab == " abcf\u00e9"


def test_an_edit_anywhere_moves_every_batch_and_the_fingerprint() -> None:
    """Three characters inserted mid-text, the vocabulary the same: other windows at step 4
    (what a restart after an edit of the sources trained on), and another fingerprint."""
    text = "".join(chr(97 + i * 7 % 26) for i in range(5000))
    before = CharCorpus.from_text(text)
    after = CharCorpus.from_text(text[:2500] + "abc" + text[2500:])
    assert before.vocab == after.vocab
    x, _ = before.batch(step=4, rank=0, batch=4, seq=8, seed=0)
    y, _ = after.batch(step=4, rank=0, batch=4, seq=8, seed=0)
    assert not torch.equal(x, y)
    assert fingerprint(before) == fingerprint(CharCorpus.from_text(text))
    assert fingerprint(before) != fingerprint(after)
    assert len(fingerprint(before)) == 16


def test_a_token_files_fingerprint_sees_an_edit_and_a_truncation(tmp_path: Path) -> None:
    """The sampled hash of a .bin changes with a token in a sampled window, or the length."""
    ids = (np.arange(100_000) % 50).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    first = fingerprint(TokenFile.open(path))
    assert fingerprint(TokenFile.open(path)) == first
    ids[0] = 7
    ids.tofile(path)
    edited = fingerprint(TokenFile.open(path))
    assert edited != first
    ids[:-1].tofile(path)
    assert fingerprint(TokenFile.open(path)) not in (first, edited)
