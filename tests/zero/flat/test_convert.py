"""jzero.zero.flat.convert: global params to bucket rows (one per tp rank, each holding its tp block, a
tp-replicated param copied) and back, exactly; optimizer state to model space and back, exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from helpers import pytree
from jzero.zero.common.state import ZeroState
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import ShardingStrategy
from jzero.zero.flat.convert import buckets_to_params, flat_to_model_space, model_space_to_flat, params_to_buckets
from jzero.zero.flat.plan import make_flat_plan


def flat_plan(dtype=jnp.float32, bucket_size=None):
    plan = make_plan(pytree.mesh(dp=2, tp=2), ShardingStrategy.OPTIM, pytree.abstract(dtype), pytree.TP_SPECS)
    return make_flat_plan(plan, bucket_size, False)


def test_each_tp_rank_row_holds_its_block_and_the_round_trip_is_exact():
    fp = flat_plan()
    params = pytree.init_params()
    (bucket,) = params_to_buckets(fp, jax.tree.leaves(params))
    layout = fp.buffers[0].layout
    assert bucket.shape == (2, layout.numel)
    blocks = {  # tp rank t's block of each param: w split on dim 1, bias and v on dim 0, s whole
        "bias": lambda t: params["bias"][3 * t : 3 * t + 3],
        "s": lambda t: params["s"],
        "v": lambda t: params["v"][3 * t : 3 * t + 3],
        "w": lambda t: params["w"][:, 3 * t : 3 * t + 3],
    }
    for i, name in enumerate(["bias", "s", "v", "w"]):  # leaves order
        start, end, _ = layout.param_index_map[i]
        for t in range(2):
            np.testing.assert_array_equal(bucket[t, start:end], blocks[name](t).reshape(-1))
    back = buckets_to_params(fp, [bucket])
    for a, x in zip(back, jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, x)


def test_optimizer_state_round_trips_through_model_space():
    fp = flat_plan(jnp.bfloat16, bucket_size=100)  # bf16 params: fp32 main params kept; several buckets
    inner = optax.adam(1e-2)
    rng = np.random.default_rng(0)

    def draw(x):
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype) if x.ndim else x

    model = ZeroState(pytree.init_params(), jax.tree.map(draw, inner.init(pytree.init_params())))
    flat = model_space_to_flat(fp, inner, model)
    assert len(flat.main_params) == fp.n_buckets > 1
    assert [x.shape for x in flat.inner_state[0].mu] == fp.bucket_shapes()
    back = flat_to_model_space(fp, inner, flat)
    assert jax.tree.structure(back) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)
