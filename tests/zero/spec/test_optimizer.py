"""jzero.zero.spec.optimizer: the spec path's distributed optimizer steps its inner optax transformation on
the state's shards as optax steps the whole params, and gives every state leaf a sharding, param-shaped or not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.mesh import DENSE_DP_AXES as DP
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import DynamicLossScale, ShardingStrategy
from jzero.zero.spec.optimizer import inner_state_shardings, opt_state_shardings, zero_optimizer


def plan(strategy=ShardingStrategy.OPTIM, dtype=jnp.float32):
    return make_plan(pytree.mesh(dp=4), strategy, pytree.abstract(dtype), pytree.NO_TP)


def test_zero1_steps_the_shards_as_optax_steps_the_params():
    p, inner = plan(), optax.adam(1e-2)
    opt = zero_optimizer(inner, p, clip_grad=None)
    init = jax.jit(pytree.init_params)()
    params = jax.device_put(init, p.param_shardings())
    state = jax.jit(opt.init)(params)
    assert state.main_params is None and state.grad_scaler is None  # fp32 params, no loss scaling
    for x, want in zip(jax.tree.leaves(state.inner_state[0].mu), jax.tree.leaves(p.state_shardings())):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    g = jax.grad(pytree.loss)(init, pytree.batch())
    new_params, new_state, metrics = jax.jit(opt.step)(jax.device_put(g, p.state_shardings()), state, params)
    want = pytree.optax_steps(inner, init, [pytree.batch()])
    for k in pytree.SHAPES:
        np.testing.assert_allclose(new_params[k], want[k], rtol=1e-6, atol=1e-7)
    for x, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(p.param_shardings())):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(g)), rtol=1e-6)


def test_bf16_params_are_the_updated_main_params_cast():
    p = plan(ShardingStrategy.OPTIM_GRADS, jnp.bfloat16)
    opt = zero_optimizer(optax.adam(1e-2), p, clip_grad=1.0)
    params = jax.device_put(pytree.init_params(dtype=jnp.bfloat16), p.param_shardings())
    state = jax.jit(opt.init)(params)
    assert [x.dtype for x in jax.tree.leaves(state.main_params)] == [jnp.dtype(jnp.float32)] * 4
    g = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), params)
    new_params, new_state, _ = jax.jit(opt.step)(jax.device_put(g, p.state_shardings()), state, params)
    for k in pytree.SHAPES:
        assert new_params[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(new_params[k], new_state.main_params[k].astype(jnp.bfloat16))


def odd_state() -> optax.GradientTransformation:
    """A transformation whose state is not shaped like the params: a leaf under a param's name but of
    another shape, a leaf of no param, a scalar, and a leaf no DP size divides."""

    def init(params):
        z = jnp.zeros
        return {"w": z((16,)), "stats": z((8, 3)), "count": z((), jnp.int32), "odd": z((3, 5))}

    return optax.GradientTransformation(init, lambda u, s, p=None: (u, s))


@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_state_leaves_not_shaped_like_their_param_get_shardings_of_their_own(strategy):
    specs = {k: s.spec for k, s in inner_state_shardings(odd_state(), plan(ShardingStrategy(strategy))).items()}
    if strategy == "no_shard":
        assert set(specs.values()) == {P()}
    else:
        assert specs == {"w": P(DP), "stats": P(DP, None), "count": P(), "odd": P()}


def test_opt_state_shardings_keep_main_params_for_bf16_and_the_scaler_replicated():
    sh = opt_state_shardings(optax.adam(1e-2), plan(dtype=jnp.bfloat16), DynamicLossScale())
    assert jax.tree.leaves(sh.main_params) == jax.tree.leaves(plan(dtype=jnp.bfloat16).state_shardings())
    assert {s.spec for s in sh.grad_scaler} == {P()}
    assert opt_state_shardings(optax.adam(1e-2), plan()).main_params is None
