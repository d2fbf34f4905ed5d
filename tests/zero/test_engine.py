"""jzero.zero.engine: the one step engine. Every layout registered in `build.LAYOUTS` builds a `Layout`, and
the engine's step is the layout's grads followed by its update, with nothing else changing the numbers."""

import jax
import numpy as np
import pytest

from helpers import pytree
from jzero.zero.build import LAYOUTS
from jzero.zero.config import ZeroPath
from jzero.zero.engine import Layout


def test_every_path_has_a_layout():
    assert set(LAYOUTS) == set(ZeroPath)


@pytest.mark.parametrize("path", ["spec", "flat"])
def test_the_step_is_the_layouts_grads_then_its_update(path):
    z = pytree.build("optim_grads", path, microbatches=2)
    assert isinstance(z.layout, Layout)
    state = z.init_state(pytree.init_params)
    batch = jax.device_put(pytree.batch(0), z.batch_sharding)

    def by_hand(state, batch):
        (loss, _, _), grads = z.layout.grads(state.params, batch, None, None)
        params, _, metrics = z.layout.update(state.params, state.opt_state, grads)
        return params, loss, metrics["grad_norm"]

    params, loss, grad_norm = jax.jit(by_hand)(state, batch)
    params = z.full_params(params)  # the params tree, wherever the state holds them as bucket shards
    new, metrics = z.step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(grad_norm), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(z.full_params(new.params)), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
