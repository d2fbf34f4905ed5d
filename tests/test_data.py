"""Data is a pure function of (seed, step, row): a resumed run sees exactly the batches it would have,
and each process can read only its own devices' rows."""

import dataclasses

import numpy as np
import pytest

from helpers import tiny_config
from jzero.train.data import SyntheticData, TextData
from jzero.train.loop import setup


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


@pytest.fixture
def datasets(tmp_path):
    (tmp_path / "a.py").write_text("".join(f"print({i})\n" for i in range(200)))
    return [SyntheticData(vocab_size=64, seq_len=16, global_batch=8, seed=0), TextData(str(tmp_path), 16, 8, seed=1)]


@pytest.mark.parametrize("start, stop", [(0, 8), (0, 3), (3, 8), (2, 6), (7, 8), (5, 5)])
def test_rows_are_the_batch_rows(datasets, start, stop):
    for data in datasets:
        rows = data.rows(2, start, stop)
        assert rows.shape == (stop - start, 17) and rows.dtype == np.int32
        np.testing.assert_array_equal(rows, data.batch(2)[start:stop])


class RecordingData:
    """A dataset that records the row ranges asked of it."""

    def __init__(self, data):
        self.data, self.shape, self.asked = data, data.shape, []

    def rows(self, step, start, stop):
        self.asked.append((start, stop))
        return self.data.rows(step, start, stop)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (4, 1, 2), (2, 2, 2), (2, 1, 4)])  # (dp, ep, tp)
def test_device_batch_reads_only_device_rows(mesh):
    run = setup(tiny_config(mesh=mesh))
    data = RecordingData(run.dataset)
    x = dataclasses.replace(run, dataset=data).device_batch(3)
    b = data.shape[0]
    shard_rows = {idx[0].indices(b)[:2] for idx in x.sharding.devices_indices_map(x.shape).values()}
    # Each read is exactly one device's rows, each distinct range read once (tp replicas share it).
    assert sorted(data.asked) == sorted(shard_rows)
    assert all(stop - start == b // run.cfg.dp_domain_size for start, stop in data.asked)
    # ... and the ranges tile the global batch: every row read once.
    assert [r for start, stop in sorted(data.asked) for r in range(start, stop)] == list(range(b))
    np.testing.assert_array_equal(np.asarray(x), run.dataset.batch(3))
