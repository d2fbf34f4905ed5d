"""jzero.zero.flat.collectives, per device inside a shard_map: a bucket's reduction leaves each rank its slice
of the sum of every rank's bucket (under HSDP too), the gather is its inverse, the global norm counts every
element once across dp and tp, and one rank's inf is every rank's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.mesh import DENSE_DP_AXES as DP
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import OuterStrategy, ShardingStrategy
from jzero.zero.flat.collectives import any_nonfinite, bucket_ranks, gather_bucket, global_norm, reduce_bucket
from jzero.zero.flat.convert import params_to_buckets
from jzero.zero.flat.plan import make_flat_plan


def flat_plan(strategy, dp=4, tp=1, dp_outer=1, outer=OuterStrategy.NO_SHARD):
    specs = pytree.TP_SPECS if tp > 1 else pytree.NO_TP
    mesh = pytree.mesh(dp, tp, dp_outer)
    plan = make_plan(mesh, ShardingStrategy(strategy), pytree.abstract(), specs, outer_strategy=outer)
    return make_flat_plan(plan, None, False)


def per_device(fn, fp, in_specs, out_specs, check_vma=True):
    return jax.jit(jax.shard_map(fn, mesh=fp.plan.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


@pytest.mark.parametrize(
    "strategy, dp, dp_outer, outer",
    [
        ("optim", 4, 1, "no_shard"),
        ("no_shard", 4, 1, "no_shard"),
        ("optim_grads", 2, 2, "no_shard"),
        ("optim_grads", 2, 2, "optim"),
    ],
    ids=["zero", "ddp", "hsdp", "hsdp-optim"],
)
def test_each_rank_keeps_its_slice_of_the_sum_and_the_gather_inverts_it(strategy, dp, dp_outer, outer):
    fp = flat_plan(strategy, dp=dp, dp_outer=dp_outer, outer=OuterStrategy(outer))
    (buf,) = fp.buffers
    size = buf.layout.numel
    local = np.random.default_rng(0).standard_normal((4, size)).astype(np.float32)  # each DP rank's bucket
    total = local.sum(axis=0)
    state_spec = P(buf.shard_axes if buf.sharded else None)  # rank r of `shard_axes` holds [r S/d, (r+1) S/d)
    reduce = per_device(lambda g: reduce_bucket(buf, g[0]), fp, P(DP), state_spec)
    reduced = reduce(local)
    assert reduced.shape == (size,)
    np.testing.assert_allclose(reduced, total, rtol=1e-5, atol=1e-5)
    if buf.sharded:
        assert reduced.addressable_shards[0].data.shape == (size // buf.d,)
    gather = per_device(lambda g: gather_bucket(buf, reduce_bucket(buf, g[0]))[None], fp, P(DP), P(DP))
    for row in np.asarray(gather(local)):  # every rank: the whole reduced bucket
        np.testing.assert_allclose(row, total, rtol=1e-5, atol=1e-5)


def test_the_global_norm_counts_each_element_once_across_dp_and_tp():
    """dp 2 x tp 2: w, bias and v are split over tp (each tp rank's rows distinct), s is replicated over tp
    (the same in both rows, counted once)."""
    fp = flat_plan("optim_grads", dp=2, tp=2)
    grads = {k: jnp.asarray(np.random.default_rng(1).standard_normal(s), jnp.float32) for k, s in pytree.SHAPES.items()}
    buckets = params_to_buckets(fp, jax.tree.leaves(grads))  # [tp, S]: the reduced grads, before each rank's slice
    norm = per_device(
        lambda b: global_norm(fp, [b[0]], bucket_ranks(fp)), fp, tuple(fp.bucket_specs()), P(), check_vma=False
    )
    np.testing.assert_allclose(float(norm(buckets)), float(optax.tree.norm(grads)), rtol=1e-6)


def test_one_ranks_inf_is_every_ranks():
    fp = flat_plan("optim")
    axes = tuple(fp.plan.mesh.axis_names)
    g = np.ones((4, 8), np.float32)
    # check_vma=False, as in the flat step: jax 0.11 refuses a pmax over tp, in which x does not vary.
    flags = per_device(lambda x: any_nonfinite([x[0]], axes)[None], fp, P(DP), P(DP), check_vma=False)
    assert not np.any(flags(g))
    g[2, 5] = np.nan
    assert np.all(flags(g))


def test_bucket_ranks_are_the_rank_in_the_shard_axes():
    fp = flat_plan("optim_grads", dp=2, dp_outer=2, outer=OuterStrategy.OPTIM)  # shard axes (dp, ep, dp_outer)
    ranks = per_device(lambda: bucket_ranks(fp)[0][None], fp, (), P(DP))()
    mesh = fp.plan.mesh
    outer, inner = np.meshgrid(range(2), range(2), indexing="ij")  # device order: dp_outer major, then dp
    np.testing.assert_array_equal(ranks, (inner * mesh.shape["dp_outer"] + outer).reshape(-1))
