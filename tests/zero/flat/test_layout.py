"""jzero.zero.flat.layout: the flat layout's reduced buckets hold the whole batch's grads for every strategy and
number of microbatches, with each bucket reduced inside the backward (`overlap_grad_reduce`) or after it,
and its step trains as single-device optax (tp-split params too); its programs hold the params whole, or as
bucket shards where they rest sharded. The state's layout: tests/zero/flat/test_state.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import pytree
from jzero.zero.flat import layout
from jzero.zero.flat.convert import buckets_to_params


@pytest.mark.parametrize(
    "strategy, microbatches, overlap",
    [("optim_grads", 2, True), ("no_shard", 1, False), ("optim", 2, True), ("optim_grads", 1, False),
     ("optim_grads_params", 2, True), ("optim", 3, False), ("no_shard", 3, True)],
)  # fmt: skip
@pytest.mark.matrix
def test_the_reduced_buckets_hold_the_whole_batchs_grads(strategy, microbatches, overlap):
    zero = {"bucket_size": 100, "overlap_grad_reduce": overlap}
    z = pytree.build(strategy, "flat", microbatches=microbatches, zero=zero)
    assert z.flat.n_buckets > 1
    params, batch = jax.jit(pytree.init_params)(), pytree.batch(rows=48)
    buckets = z.grads(z.params_from_model(params), jax.device_put(batch, z.batch_sharding))
    assert [b.shape for b in buckets] == z.flat.bucket_shapes()
    got = buckets_to_params(z.flat, buckets)
    for g, want in zip(got, jax.tree.leaves(jax.grad(pytree.loss)(params, batch))):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "dp, tp, strategy", [(4, 1, "optim_grads"), (2, 2, "optim_grads"), (2, 2, "optim_grads_params")]
)
@pytest.mark.matrix
def test_the_flat_step_trains_as_single_device_optax(dp, tp, strategy):
    z = pytree.build(strategy, "flat", dp=dp, tp=tp, zero={"bucket_size": 100})
    state = z.init_state(pytree.init_params)
    batches = [pytree.batch(seed) for seed in range(3)]
    for b in batches:
        state, metrics = z.step(state, jax.device_put(b, z.batch_sharding))
    init = jax.jit(pytree.init_params)()
    before_last = pytree.optax_steps(optax.adam(1e-2), init, batches[:-1])
    np.testing.assert_allclose(float(metrics["loss"]), float(pytree.loss(before_last, batches[-1])), rtol=1e-5)
    want = pytree.optax_steps(optax.adam(1e-2), init, batches)
    got = z.full_params(state.params)
    for k in pytree.SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "strategy, overlap, rest_sharded",
    [("no_shard", True, False), ("optim", False, False), ("optim", True, True), ("optim_grads_params", False, True)],
)
def test_the_programs_hold_the_params_whole_or_as_bucket_shards(strategy, overlap, rest_sharded):
    """Where the params rest sharded (ZeRO-3; ZeRO-1/2 with overlap_param_gather, which follows
    overlap_grad_reduce) `flat_layout`'s state holds one param-dtype array per bucket, split over
    the inner DP axes, and `to_state` lays the params tree into them; elsewhere the params tree."""
    z = pytree.build(strategy, "flat", zero={"bucket_size": 100, "overlap_grad_reduce": overlap})
    fp = z.flat
    assert fp.plan.stage.params_rest_sharded == rest_sharded
    programs = z.layout
    assert isinstance(programs, layout.Layout) and programs.flat is fp
    if not rest_sharded:
        assert programs.to_state is None
        assert jax.tree.structure(programs.shardings.params) == jax.tree.structure(pytree.abstract())
        return
    assert [s.spec for s in programs.shardings.params] == fp.param_specs()
    held = programs.to_state(jax.jit(pytree.init_params)())
    assert [x.shape for x in held] == fp.bucket_shapes() and {x.dtype for x in held} == {jnp.dtype(jnp.float32)}
