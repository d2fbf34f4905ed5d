"""jzero.zero.flat.plan: the flat-buffer view of a ShardingPlan: one buffer of the local params in leaves
order, Megatron's layout over it, and the per-device operations (flatten, unflatten, owned, values_on_shard)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.errors import ConfigError
from jzero.mesh import DENSE_DP_AXES as DP
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import ShardingStrategy
from jzero.zero.flat.plan import flatten, make_flat_plan, owned, unflatten, values_on_shard

LEAVES = ["bias", "s", "v", "w"]  # jax's order of the model's dict


def flat_plan(dp=4, tp=1, strategy=ShardingStrategy.OPTIM, bucket_size=None, abstract=None):
    specs = pytree.TP_SPECS if tp > 1 else pytree.NO_TP
    plan = make_plan(pytree.mesh(dp, tp), strategy, abstract or pytree.abstract(), specs)
    return make_flat_plan(plan, bucket_size, False)


def test_one_dense_buffer_of_the_tp_local_params():
    fp = flat_plan(dp=2, tp=2)
    (buf,) = fp.buffers
    assert (buf.kind, buf.params, buf.d, buf.sharded, buf.model_axes) == ("dense", (0, 1, 2, 3), 2, True, ("tp",))
    assert fp.local_shapes == ((3,), (3, 8, 5), (3, 12), (16, 3))  # bias, s, v, w: tp halves all but s
    assert fp.tp_sharded == (True, False, True, True)
    assert [end - start for start, end, _ in buf.layout.param_index_map] == [3, 120, 36, 48]
    assert buf.layout.numel % math.lcm(2, 128) == 0
    assert fp.bucket_shapes() == [(2, buf.layout.numel)] and fp.bucket_specs() == [P("tp", DP)]
    assert fp.shard_size(0) == buf.layout.numel // 2
    ddp = flat_plan(dp=2, tp=2, strategy=ShardingStrategy.NO_SHARD)
    assert ddp.shard_size(0) == ddp.buffers[0].layout.numel and ddp.bucket_specs() == [P("tp", None)]


def test_flatten_puts_each_param_at_its_range_and_zeros_elsewhere():
    fp = flat_plan(bucket_size=100)
    (buf,) = fp.buffers
    assert buf.n_buckets > 1
    leaves = jax.tree.leaves(pytree.init_params())
    buckets = flatten(fp, leaves, jnp.float32)
    for b, bucket in enumerate(buckets):
        start, end = buf.layout.bucket_indices[b]
        assert bucket.shape == (end - start,)
        filled = np.zeros(end - start, bool)
        for j in buf.layout.bucket_params[b]:
            ps, pe, _ = buf.layout.param_index_map[j]
            np.testing.assert_array_equal(bucket[ps - start : pe - start], leaves[buf.params[j]].reshape(-1))
            filled[ps - start : pe - start] = True
        assert not np.any(np.asarray(bucket)[~filled])  # alignment gaps and end padding
        shards = [owned(buf, bucket, r) for r in range(buf.d)]
        assert {s.shape for s in shards} == {(fp.shard_size(b),)}
        np.testing.assert_array_equal(jnp.concatenate(shards), bucket)  # rank r owns [r S/d, (r+1) S/d)
    back = unflatten(fp, buckets, [x.dtype for x in leaves])
    for a, x in zip(back, leaves):
        np.testing.assert_array_equal(a, x)


def test_values_on_shard_are_each_elements_params_value():
    fp = flat_plan(bucket_size=100)
    (buf,) = fp.buffers
    per_param = [0.5, 2.0, 3.0, 0.0]  # leaves order
    for b in range(buf.n_buckets):
        start, _ = buf.layout.bucket_indices[b]
        size = buf.shard_size(b)
        for r in range(buf.d):
            values = np.asarray(jax.jit(lambda r, b=b: values_on_shard(buf, b, per_param, r))(jnp.int32(r)))
            assert values.shape == (size,)
            for j in buf.layout.bucket_params[b]:
                ps, pe, _ = buf.layout.param_index_map[j]
                lo, hi = max(ps - start, r * size), min(pe - start, (r + 1) * size)  # the param's part of the shard
                if lo < hi:
                    assert np.all(values[lo - r * size : hi - r * size] == per_param[buf.params[j]])


def test_the_flat_path_needs_one_param_dtype():
    mixed = pytree.abstract() | {"bias": jax.ShapeDtypeStruct((6,), jnp.bfloat16)}
    with pytest.raises(ConfigError, match=r"^zero.path=flat needs one param dtype \(one buffer\); got"):
        flat_plan(abstract=mixed)
