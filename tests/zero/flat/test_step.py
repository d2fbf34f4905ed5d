"""jzero.zero.flat.step: the flat path's reduced buckets hold the whole batch's grads for every strategy and
number of microbatches, its step trains as single-device optax (tp-split params too), and its state's
layout refuses a state leaf that is neither a scalar nor a bucket shard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import pytree
from jzero.errors import ConfigError
from jzero.zero.flat.convert import buckets_to_params
from jzero.zero.flat.step import opt_state_shardings


@pytest.mark.parametrize(
    "strategy, microbatches", [("optim_grads", 2), ("no_shard", 1), ("optim", 2), ("optim_grads", 1)]
)
@pytest.mark.matrix
def test_the_reduced_buckets_hold_the_whole_batchs_grads(strategy, microbatches):
    z = pytree.build(strategy, "flat", microbatches=microbatches, zero={"bucket_size": 100})
    assert z.flat.n_buckets > 1
    params, batch = jax.jit(pytree.init_params)(), pytree.batch()
    buckets = z.grads(jax.device_put(params, z.shardings.params), jax.device_put(batch, z.batch_sharding))
    assert [b.shape for b in buckets] == z.flat.bucket_shapes()
    got = buckets_to_params(z.flat, buckets)
    for g, want in zip(got, jax.tree.leaves(jax.grad(pytree.loss)(params, batch))):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dp, tp", [(4, 1), (2, 2)])
@pytest.mark.matrix
def test_the_flat_step_trains_as_single_device_optax(dp, tp):
    z = pytree.build("optim_grads", "flat", dp=dp, tp=tp, zero={"bucket_size": 100})
    state = z.init_state(pytree.init_params)
    batches = [pytree.batch(seed) for seed in range(3)]
    for b in batches:
        state, metrics = z.step(state, jax.device_put(b, z.batch_sharding))
    init = jax.jit(pytree.init_params)()
    before_last = pytree.optax_steps(optax.adam(1e-2), init, batches[:-1])
    np.testing.assert_allclose(float(metrics["loss"]), float(pytree.loss(before_last, batches[-1])), rtol=1e-5)
    want = pytree.optax_steps(optax.adam(1e-2), init, batches)
    for k in pytree.SHAPES:
        np.testing.assert_allclose(state.params[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_state_leaf_of_no_bucket_shards_shape_is_refused():
    z = pytree.build("optim", "flat")
    odd = optax.GradientTransformation(lambda params: {"odd": jnp.zeros(3)}, lambda u, s, p=None: (u, s))
    with pytest.raises(ConfigError) as e:
        opt_state_shardings(odd, z.flat)
    assert str(e.value) == (
        "zero.path=flat: optimizer state leaf ['odd'] of shape (3,) is neither a scalar nor shaped like a buffer "
        "shard; use zero.path=spec"
    )
    adam = opt_state_shardings(optax.adam(1e-2), z.flat)
    assert [s.spec for s in adam.inner_state[0].mu] == z.flat.bucket_specs() and adam.main_params is None
