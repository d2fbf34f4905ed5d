"""Data is a pure function of (seed, step): a resumed run sees exactly the batches it would have."""

import numpy as np

from jzero.train.data import SyntheticData, TextData


def test_text_batches_are_deterministic_bytes(tmp_path):
    (tmp_path / "a.py").write_text("print('hello world')\n" * 50)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "b.py").write_text("#" * 5000)
    data = TextData(str(tmp_path), seq_len=16, global_batch=4, seed=1)
    assert len(data.tokens) == 50 * 21  # installed packages are skipped
    b = data.batch(3)
    assert b.shape == (4, 17) and b.dtype == np.int32 and b.max() < 256
    np.testing.assert_array_equal(b, TextData(str(tmp_path), 16, 4, 1).batch(3))
    assert not np.array_equal(b, data.batch(4))


def test_synthetic_is_seeded_and_learnable():
    data = SyntheticData(vocab_size=64, seq_len=32, global_batch=8, seed=0)
    np.testing.assert_array_equal(data.batch(5), SyntheticData(64, 32, 8, 0).batch(5))
    assert not np.array_equal(data.batch(5), SyntheticData(64, 32, 8, 1).batch(5))
    # Each token has a few likely successors: the empirical next-token entropy is well below log(64).
    tokens = np.concatenate([data.batch(s) for s in range(50)])
    pairs = np.zeros((64, 64))
    np.add.at(pairs, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
    p = pairs / pairs.sum(1, keepdims=True).clip(1)
    entropy = -(pairs * np.log(np.where(p > 0, p, 1))).sum() / pairs.sum()
    assert entropy < 0.75 * np.log(64)
