"""jzero.zero.common.batch: a global batch [B, ...] is split over the dense DP domain rank-major, rank r
holding rows [r B/n, (r+1) B/n), and its microbatch m is the m-th contiguous block of those."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.errors import ConfigError
from jzero.mesh import BATCH_AXES
from jzero.zero.common.batch import batch_sharding, split_batch


@pytest.mark.parametrize("n_dp, microbatches", [(4, 2), (2, 4), (1, 3), (8, 1)])
def test_split_batch_is_rank_major(n_dp, microbatches):
    rows = 24
    batch = {"x": np.arange(rows * 2).reshape(rows, 2), "y": np.arange(rows)}
    out = split_batch(batch, n_dp, microbatches)
    b = rows // (n_dp * microbatches)
    assert out["x"].shape == (microbatches, n_dp, b, 2) and out["y"].shape == (microbatches, n_dp, b)
    for m in range(microbatches):
        for r in range(n_dp):
            first = r * rows // n_dp + m * b
            np.testing.assert_array_equal(out["x"][m, r], batch["x"][first : first + b])
            np.testing.assert_array_equal(out["y"][m, r], batch["y"][first : first + b])


def test_each_rank_holds_the_rows_split_batch_gives_it():
    mesh = pytree.mesh(dp=4)
    sharding = batch_sharding(mesh)
    assert sharding.spec == P(BATCH_AXES)
    x = jax.device_put(np.arange(16 * 3).reshape(16, 3), sharding)
    rank = {d: r for r, d in enumerate(mesh.devices.flat)}  # dp_outer, ep and tp are 1: the device order
    split = split_batch(np.asarray(x), 4, 1)
    for shard in x.addressable_shards:
        np.testing.assert_array_equal(shard.data, split[0, rank[shard.device]])


@pytest.mark.parametrize(
    "path, message",
    [
        ("spec", "the batch's 24 rows do not split into 4 DP ranks x 4 micro-batches"),
        ("flat", "a DP rank's 6 batch rows do not split into 4 micro-batches"),
    ],
)
def test_a_batch_the_micro_batches_do_not_divide_is_one_clear_error(path, message):
    """Through the Python API (the CLI's config check never lets this through): 24 rows over 4 ranks and 4
    micro-batches. Before, the spec path failed in a reshape and the flat path inside shard_map."""
    z = pytree.build("optim", path, dp=4, microbatches=4)
    state = z.init_state(lambda: pytree.init_params())
    with pytest.raises(ConfigError, match=f"^{message}: give the step a multiple of DP size x micro-batches"):
        z.step(state, jax.device_put(pytree.batch(rows=24), z.batch_sharding))
