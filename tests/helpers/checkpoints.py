"""Checkpoints written and read in-process (`Checkpointer`), for the tests that move a state between
stages, paths and meshes: `train_and_save` one config's run, `restore_matches` onto another's."""

from __future__ import annotations

import jax
import numpy as np

from jzero.train.checkpoint import Checkpointer
from jzero.train.loop import setup


def train_and_save(directory, cfg, steps=2, run=None) -> dict:
    """Trains `steps` steps of `cfg`, saves the state to `directory`; returns what was saved (model
    space: the params tree, the optimizer state per param) as host arrays. run: `setup(cfg)` already
    built (a test that restores onto `cfg` too builds and compiles it once)."""
    run = setup(cfg) if run is None else run
    state = run.init_state()
    for i in range(steps):
        state, _ = run.zero.step(state, run.device_batch(i))
    ck = Checkpointer(directory, run, async_save=False)
    ck.save(state, cfg)
    whole = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), ck._model_state(state))
    ck.close()
    return whole


def restore_matches(directory, whole, cfg, steps=2, train=False, run=None) -> None:
    """Restores step `steps` of `directory` into `cfg`'s run (`run`, or `setup(cfg)`): every device's shard
    of every saved array (params, moments) is the saved slice at its index; with `train`, one more step
    runs and its loss is finite."""
    run = setup(cfg) if run is None else run
    reader = Checkpointer(directory, run, writer=False)
    state = reader.restore(steps)
    restored = reader._model_state(state)
    reader.close()
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(whole)[0]]
    for path, x, saved in zip(paths, jax.tree.leaves(restored), jax.tree.leaves(whole)):
        for shard in getattr(x, "addressable_shards", []):
            np.testing.assert_array_equal(np.asarray(shard.data), saved[shard.index], err_msg=path)
    if train:
        _, m = run.zero.step(state, run.device_batch(steps))
        assert np.isfinite(float(m["loss"]))
