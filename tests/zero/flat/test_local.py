"""jzero.zero.flat.local: the per-device bucket operations: params laid into buckets at their ranges with
zeros elsewhere and cut back out (`flatten`, `unflatten`), rank r's owned shard, per-param constants laid
out like a shard (`values_on_shard`), a scanned stack's [L, S_b] bucket handled layer by layer."""

import jax
import jax.numpy as jnp
import numpy as np

from helpers import pytree
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import ShardingStrategy
from jzero.zero.flat.local import flatten, owned, unflatten, values_on_shard
from jzero.zero.flat.plan import make_flat_plan


def flat_plan(dp=4, bucket_size=100, per_unit=False):
    plan = make_plan(pytree.mesh(dp, 1), ShardingStrategy.OPTIM, pytree.abstract(), pytree.NO_TP)
    return make_flat_plan(plan, bucket_size, False)


def test_flatten_puts_each_param_at_its_range_and_zeros_elsewhere():
    fp = flat_plan()
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
    fp = flat_plan()
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


def test_a_scanned_stacks_bucket_is_laid_out_alike_in_every_layer():
    """A stacked unit [L, ...] gets an [L, S_b] bucket whose row l is layer l's params laid out as one
    layer's; owned shards and `unflatten` work on the last axis."""
    abstract = {"blocks": {"b": jax.ShapeDtypeStruct((3, 4), jnp.float32), "w": jax.ShapeDtypeStruct((3, 8, 4),
                jnp.float32)}, "head": jax.ShapeDtypeStruct((4, 2), jnp.float32)}  # fmt: skip
    units = {"blocks": {"b": 1, "w": 1}, "head": None}
    specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), abstract)
    plan = make_plan(pytree.mesh(4, 1), ShardingStrategy.OPTIM_GRADS, abstract, specs, units=units)
    fp = make_flat_plan(plan, None, False)
    leaves = [jnp.arange(np.prod(x.shape), dtype=jnp.float32).reshape(x.shape) + 1 for x in jax.tree.leaves(abstract)]
    buckets = flatten(fp, leaves, jnp.float32)
    assert [g.layers for g in fp.groups] == [3, None]  # the stack, then the rest (head)
    for bucket, (buf, b) in zip(buckets, fp.buckets):
        assert bucket.shape == (*buf.lead, buf.numel(b))
        shards = [owned(buf, bucket, r) for r in range(buf.d)]
        np.testing.assert_array_equal(jnp.concatenate(shards, axis=-1), bucket)
        if buf.layers:
            assert buf.lead == (3,)
            start = buf.layout.bucket_indices[b][0]
            for j in buf.layout.bucket_params[b]:
                ps, pe, _ = buf.layout.param_index_map[j]
                for layer in range(3):
                    want = leaves[buf.params[j]][layer].reshape(-1)
                    np.testing.assert_array_equal(bucket[layer, ps - start : pe - start], want)
    for a, x in zip(unflatten(fp, buckets, [x.dtype for x in leaves]), leaves):
        np.testing.assert_array_equal(a, x)
