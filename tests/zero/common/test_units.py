"""jzero.zero.common.units: an FSDP unit is a plain call outside a ZeRO-2/3 step; inside one, its params are
gathered (ZeRO-3) and its grads reduce-scattered as its backward ends, to the grads of the plain loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import pytree
from jzero.zero.common.units import unit

UNITS = {"w": 0, "bias": 0, "v": None, "s": None}  # the first layer is one unit; v and s are in none


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["bias"])


def unit_loss(params, batch):
    """`pytree.loss` with its first layer run as one unit."""
    h = unit(layer, {"w": params["w"], "bias": params["bias"]}, batch["x"])
    return jnp.mean((h @ params["v"] + jnp.mean(params["s"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("remat", [False, True])
def test_outside_a_zero_step_a_unit_is_a_plain_call(remat):
    params, batch = pytree.init_params(), pytree.batch()

    def loss(params):
        h = unit(layer, {"w": params["w"], "bias": params["bias"]}, batch["x"], remat=remat)
        return jnp.mean(h)

    def plain(params):
        return jnp.mean(layer(params, batch["x"]))

    assert float(loss(params)) == float(plain(params))
    for k, g in jax.grad(loss)(params).items():
        np.testing.assert_allclose(g, jax.grad(plain)(params)[k], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "strategy, reshard", [("optim_grads_params", True), ("optim_grads", True), ("optim_grads_params", False)]
)
@pytest.mark.matrix
def test_a_units_reduced_grads_are_the_plain_loss_grads(strategy, reshard):
    z = pytree.build(strategy, zero={"reshard_after_forward": reshard}, units=UNITS, loss_fn=unit_loss)
    params = jax.jit(pytree.init_params)()
    batch = pytree.batch()
    got = z.grads(jax.device_put(params, z.shardings.params), jax.device_put(batch, z.batch_sharding))
    want = jax.grad(pytree.loss)(params, batch)
    assert [g.sharding for g in jax.tree.leaves(got)] == jax.tree.leaves(z.plan.state_shardings())
    for k in pytree.SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
