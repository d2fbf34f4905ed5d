"""jzero.zero.flat.state: the flat path's train state: the optimizer state one array per bucket shard
(a state leaf of no bucket shard's shape refused), and the params held whole or, where they rest sharded,
as bucket shards that read back as the params tree bitwise."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import flat_config, pytree
from jzero.errors import ConfigError
from jzero.train.loop import setup
from jzero.zero.flat.state import from_model_params, opt_state_shardings, param_shardings, to_model_params
from jzero.zero.memory import formula_split, per_device_bytes

SCAN = {"scan_layers": True, "remat": True}


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


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_params_rest_whole_or_as_bucket_shards_and_convert_both_ways(strategy):
    """ZeRO-1 without overlap_param_gather: the params tree, conversions the identity; ZeRO-3: one
    array per bucket split over the inner DP axes, `to_model_params` inverts `from_model_params`."""
    z = pytree.build(strategy, "flat", zero={"bucket_size": 100, "overlap_grad_reduce": False})
    fp, params = z.flat, jax.jit(pytree.init_params)()
    if not fp.plan.stage.params_rest_sharded:
        assert to_model_params(fp, params) is params and from_model_params(fp, params) is params
        assert param_shardings(fp) == fp.plan.param_shardings()
        return
    assert [s.spec for s in param_shardings(fp)] == fp.param_specs()
    buckets = jax.jit(lambda p: from_model_params(fp, p))(params)
    assert [b.shape for b in buckets] == fp.bucket_shapes()
    back = jax.jit(lambda b: to_model_params(fp, b))(buckets)
    for k in pytree.SHAPES:
        np.testing.assert_array_equal(back[k], params[k])


@pytest.mark.slow
def test_resting_bucket_shards_read_back_as_the_params():
    """ZeRO-3 on the flat path, bf16, a scanned stack: the state holds one bf16 array per bucket, 1/d of it
    per device (the memory formula's padded bytes); `full_params` gives the params tree, which
    `params_from_model` lays back bitwise; `evaluate` on the state's params is the step's loss."""
    bf16 = {"param_dtype": "bfloat16"}
    run = setup(flat_config("optim_grads_params", (4, 1, 2), model=SCAN, precision=bf16, bucket_size=3000))
    state = run.init_state()
    z, fp = run.zero, run.zero.flat
    assert len(state.params) == fp.n_buckets
    padded = sum(math.prod(s) for s in fp.bucket_shapes()) // 2  # tp rows are 2 devices' halves
    assert per_device_bytes(state.params) == 2 * padded // 4 == formula_split(z)["params"]
    full = z.full_params(state.params)
    want = jax.jit(run.model.init)()
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(z.params_from_model(full)), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = run.device_batch(0)
    loss = float(z.evaluate(state.params, batch)["loss"])
    _, metrics = z.step(state, batch)
    assert loss == pytest.approx(float(metrics["loss"]), rel=1e-6)
