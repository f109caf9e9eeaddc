"""The synthetic corpus and the token-file loader: determinism, labels, splits, errors."""

import numpy as np
import pytest

from dropless.data._datasets import SyntheticCorpus, TokenFile, token_file_splits


def corpus(**kwargs) -> SyntheticCorpus:
    return SyntheticCorpus(vocab_size=512, **kwargs)


def test_same_seed_and_step_give_the_same_batch():
    a = corpus().batch(7, seed=3, batch_size=8, seq_len=32)
    b = corpus().batch(7, seed=3, batch_size=8, seq_len=32)  # a new object: nothing cached
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.language, b.language)
    assert a.tokens.shape == (8, 33) and a.tokens.dtype == np.int32
    assert a.language.shape == (8,) and a.language.dtype == np.int32


def test_steps_seeds_and_splits_differ():
    c = corpus()
    base = c.batch(0, seed=0, batch_size=8, seq_len=32).tokens
    for other in (
        c.batch(1, seed=0, batch_size=8, seq_len=32).tokens,
        c.batch(0, seed=1, batch_size=8, seq_len=32).tokens,
        c.batch(0, seed=0, batch_size=8, seq_len=32, split="eval").tokens,
    ):
        assert (other != base).mean() > 0.5


def test_language_labels_name_the_chain_that_wrote_each_sequence():
    c = corpus(n_languages=4, overlap=0.0)
    batch = c.batch(0, seed=0, batch_size=64, seq_len=32)
    assert set(batch.language.tolist()) == {0, 1, 2, 3}
    width = 512 // 4
    # Without overlap, language l writes only tokens of its own slice of the vocabulary.
    slices = batch.tokens // width
    np.testing.assert_array_equal(slices, np.broadcast_to(batch.language[:, None], slices.shape))


def test_corpus_is_learnable_far_below_uniform():
    c = corpus()
    assert c.entropy_rate() < 0.3 * np.log(512)
    tokens = c.batch(0, seed=0, batch_size=32, seq_len=64).tokens
    assert tokens.min() >= 0 and tokens.max() < 512
    # A first-order chain: each token has at most `branching` successors within a language.
    successors: dict[tuple[int, int], set] = {}
    batch = c.batch(0, seed=0, batch_size=32, seq_len=64)
    for row, lang in zip(batch.tokens, batch.language, strict=True):
        for prev, nxt in zip(row[:-1], row[1:], strict=True):
            successors.setdefault((int(lang), int(prev)), set()).add(int(nxt))
    assert max(len(s) for s in successors.values()) <= c.branching


def test_corpus_rejects_bad_settings():
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticCorpus(vocab_size=6, n_languages=4)
    with pytest.raises(ValueError, match="split"):
        corpus().batch(0, seed=0, batch_size=2, seq_len=4, split="test")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_are_slices_of_the_file(tmp_path, dtype):
    data = (np.arange(10_000) * 7 % 50_000).astype(dtype)
    path = tmp_path / "tokens.bin"
    data.tofile(path)
    ds = TokenFile(str(path), dtype)
    a = ds.batch(5, seed=1, batch_size=4, seq_len=16)
    b = ds.batch(5, seed=1, batch_size=4, seq_len=16)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.tokens.shape == (4, 17) and a.tokens.dtype == np.int32
    np.testing.assert_array_equal(a.language, -1)
    for row in a.tokens:
        start = int(np.flatnonzero(data == row[0])[0])
        np.testing.assert_array_equal(row, data[start : start + 17])
    assert not np.array_equal(a.tokens, ds.batch(6, seed=1, batch_size=4, seq_len=16).tokens)


def test_token_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    train, held_out = token_file_splits(str(path), "uint16", eval_fraction=0.2)
    for step in range(20):
        assert train.batch(step, seed=0, batch_size=8, seq_len=9).tokens.max() < 800
        assert (
            held_out.batch(step, seed=0, batch_size=8, seq_len=9, split="eval").tokens.min() >= 800
        )


def test_token_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        TokenFile(str(tmp_path / "missing.bin"))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="multiple of 2"):
        TokenFile(str(odd), "uint16")
    short = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenFile(str(short)).batch(0, seed=0, batch_size=1, seq_len=32)
