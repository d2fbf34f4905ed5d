"""jzero.zero.common.collectives, the HSDP rule every layout's reductions follow: per rank inside a shard_map
over (dp_outer, dp), `reduce` leaves each rank its slice of the sum over the whole DP domain, and `gather`
is its inverse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.zero.common import collectives

INNER, OUTER = ("dp",), ("dp_outer",)


def _per_rank(fn, mesh):
    spec = P(("dp_outer", "dp"))  # row r of the input is rank r's (dp_outer-major) local tensor
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.mark.parametrize("outer_scatter", [False, True], ids=["outer-no_shard", "outer-optim"])
def test_reduce_leaves_each_rank_its_slice_of_the_sum_and_gather_inverts_it(outer_scatter):
    mesh = pytree.mesh(dp=2, dp_outer=2)
    x = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8) ** 2  # 4 ranks' [8] grads
    total = np.asarray(x).sum(0)

    def step(g):  # [1, 8] per rank -> its shard, then the whole again
        shard = collectives.reduce(g, 1, INNER, OUTER, outer_scatter=outer_scatter)
        whole = collectives.gather(shard, 1, INNER, OUTER if outer_scatter else ())
        return jnp.concatenate([jnp.pad(shard, ((0, 0), (0, 8 - shard.shape[1]))), whole], axis=1)

    out = np.asarray(_per_rank(step, mesh)(x))
    d = 4 if outer_scatter else 2  # the slices: over both axes, or over dp only (replicated across dp_outer)
    for rank in range(4):
        outer, inner = divmod(rank, 2)
        r = inner * 2 + outer if outer_scatter else inner  # inner rank major
        np.testing.assert_array_equal(out[rank, : 8 // d], total[r * 8 // d : (r + 1) * 8 // d])
        np.testing.assert_array_equal(out[rank, 8:], total)


def test_no_split_dim_is_one_psum_and_regather_is_a_hierarchical_all_reduce():
    mesh = pytree.mesh(dp=2, dp_outer=2)
    x = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8) + 1
    total = np.asarray(x).sum(0)
    whole = _per_rank(lambda g: collectives.reduce(g, None, INNER, OUTER, outer_scatter=False), mesh)(x)
    hierarchical = _per_rank(lambda g: collectives.reduce(g, 1, INNER, OUTER, outer_scatter=False, regather=True),
                             mesh)(x)  # fmt: skip
    for out in (whole, hierarchical):
        np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(total, (4, 8)))
