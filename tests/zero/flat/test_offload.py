"""jzero.zero.flat.offload: the flat path offloads whole buckets in bucket order, by Megatron's rule on the
elements each device steps; a bucket's state leaves and its params go with it."""

import jax
import jax.numpy as jnp
import optax
import pytest

from helpers import pytree
from jzero.zero.common.offload import choose
from jzero.zero.common.strategies import make_plan, path_name
from jzero.zero.config import ShardingStrategy
from jzero.zero.flat.offload import flat_offload
from jzero.zero.flat.plan import make_flat_plan
from jzero.zero.flat.state import opt_state_shardings


@pytest.mark.parametrize("fraction", [0.5, 1.0, 0.0])
def test_whole_buckets_in_order(fraction):
    plan = make_plan(pytree.mesh(dp=4), ShardingStrategy.OPTIM, pytree.abstract(jnp.bfloat16), pytree.NO_TP)
    fp = make_flat_plan(plan, 100, False)  # 3 buckets: [w, v], [s], [bias]
    inner = optax.adam(1e-2)
    offload = flat_offload(fp, inner, opt_state_shardings(inner, fp), fraction)
    sizes = [fp.shard_size(b) for b in range(fp.n_buckets)]
    assert sizes == [64, 32, 32]
    chosen = {0.5: [True, False, False], 1.0: [True] * 3, 0.0: [False] * 3}[fraction]
    assert choose(sizes, fraction) == chosen
    assert offload.units == tuple(f"bucket {b}" for b, c in enumerate(chosen) if c)
    assert (offload.offloaded_numel, offload.total_numel) == (sum(n for n, c in zip(sizes, chosen) if c), 128)
    buckets_of = {"w": 0, "v": 0, "s": 1, "bias": 2}
    leaves = ["bias", "s", "v", "w"]
    assert offload.params == {i for i, name in enumerate(leaves) if chosen[buckets_of[name]]}
    assert offload.mask.main_params == chosen
    for path, host in jax.tree_util.tree_flatten_with_path(offload.mask.inner_state)[0]:
        name = path_name(path)
        assert host == (not name.endswith("count") and chosen[int(name.split("/")[-1])]), name
