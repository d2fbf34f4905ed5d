"""jzero.zero.spec.layout: each strategy's reduced grads are the grads of the loss on the whole batch, in the
plan's grad shardings, for any number of microbatches; evaluate is that loss; the unit hooks say where each
param is gathered and its grad reduced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.mesh import DENSE_DP_AXES as DP
from jzero.zero.common.batch import batch_sharding
from jzero.zero.common.schedule import Phase
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import OuterStrategy, ShardingStrategy, StepOptions, ZeroConfig
from jzero.zero.spec.grads import reduced_grads, unit_hooks
from jzero.zero.spec.layout import evaluate_fn

UNITS = {"w": 0, "bias": 0, "v": None, "s": None}


@pytest.mark.parametrize(
    "strategy, microbatches",
    [("optim_grads", 2), ("no_shard", 1), ("optim", 2), ("optim_grads", 1), ("optim_grads_params", 2)],
)
@pytest.mark.matrix
def test_reduced_grads_are_the_grads_of_the_whole_batch(strategy, microbatches):
    mesh = pytree.mesh(dp=4)
    plan = make_plan(mesh, ShardingStrategy(strategy), pytree.abstract(), pytree.NO_TP)
    options = StepOptions(microbatches=microbatches, grad_reduce_dtype=jnp.float32)
    replicated = NamedSharding(mesh, P())
    grads = jax.jit(
        lambda p, b: reduced_grads(pytree.loss, p, b, plan, options, ZeroConfig(strategy)),
        in_shardings=(plan.param_shardings(), batch_sharding(mesh)),
        out_shardings=(replicated, replicated, replicated, plan.state_shardings()),
    )
    params, batch = jax.jit(pytree.init_params)(), pytree.batch()
    loss, metrics, stats, g = grads(params, batch)
    want = pytree.loss(params, batch)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert metrics == {} and stats == {}
    for k, x in jax.grad(pytree.loss)(params, batch).items():
        np.testing.assert_allclose(g[k], x, rtol=1e-5, atol=1e-7)
    evaluate = jax.jit(lambda p, b: evaluate_fn(pytree.loss, plan, options)(p, b, None))
    np.testing.assert_allclose(float(evaluate(params, batch)["loss"]), float(want), rtol=1e-6)


def test_unit_hooks_gather_sharded_params_and_scale_every_grad():
    plan = make_plan(
        pytree.mesh(dp=4), ShardingStrategy.OPTIM_GRADS_PARAMS, pytree.abstract(), pytree.NO_TP, units=UNITS
    )
    options = StepOptions(microbatches=2, grad_reduce_dtype=jnp.bfloat16)  # 1 / (d x M) = 1 / 8
    hooks = unit_hooks(plan, options, True, Phase.ALIKE)
    w, bias, s = hooks["w"], hooks["bias"], hooks["s"]
    assert (w.dim, w.inner, w.outer, w.gathers, w.reshard, w.to_varying) == (-2, DP, (), True, True, ())
    assert (s.dim, s.gathers) == (-2, True)  # dim 1 of 3, counted from the end
    # bias is replicated over DP: its grad is all-reduced, and it enters as the same value on every rank.
    assert (bias.dim, bias.gathers, bias.reshard, bias.to_varying) == (None, False, False, DP)
    assert {h.scale for h in hooks.values()} == {1 / 8} and {h.reduce_dtype for h in hooks.values()} == {"bfloat16"}


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hsdp_hooks_reduce_across_dp_outer_after_the_inner_axes(outer):
    mesh = pytree.mesh(dp=2, dp_outer=2)
    plan = make_plan(
        mesh, ShardingStrategy.OPTIM_GRADS_PARAMS, pytree.abstract(), pytree.NO_TP, units=UNITS, outer_strategy=outer
    )
    w = unit_hooks(plan, StepOptions(), True, Phase.ALIKE)["w"]
    assert (w.inner, w.outer) == (("dp", "ep"), ("dp_outer",))
    assert w.outer_scatter == (OuterStrategy(outer) == OuterStrategy.OPTIM)
