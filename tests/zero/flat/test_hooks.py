"""jzero.zero.flat.hooks: each FSDP unit's buckets reduced (and, under ZeRO-3, gathered) inside the layer
loop of a scanned stack, one layer's slice at a time, moving the theory's bytes; a bucket's hook cuts a
gathered bucket into its params and lays their grads back at Megatron's ranges."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import flat_config
from jzero.inspect import comms
from jzero.inspect.compile import compile_step
from jzero.inspect.hlo import ring_wire_bytes
from jzero.mesh import AXES
from jzero.train.loop import setup
from jzero.zero.flat.hooks import Mode, bucket_hooks, sink_axes

SCAN = {"scan_layers": True, "remat": True}


def test_a_hook_cuts_its_bucket_into_params_and_lays_grads_at_their_ranges():
    """Outside a shard_map, on one device's values: `split` of a gathered bucket gives each param at its
    range; `reduce_grads` without reduction gives the bucket of the grads as they are (unscaled, in their
    dtype: the step scales them into its fp32 accumulator), zero in the gaps. A sink varies over every
    axis but those its reduction sums without scattering (DDP's)."""
    run = setup(flat_config("optim_grads", (8, 1, 1), model=SCAN, bucket_size=3000), with_data=False)
    fp = run.zero.flat
    (buf, b), hook = next(((bb, h) for bb, h in zip(fp.buckets, bucket_hooks(fp, Mode.SHARD, 0.5, jnp.float32))
                           if bb[0].layers))  # fmt: skip
    start, end = buf.layout.bucket_indices[b]
    bucket = jnp.arange(end - start, dtype=jnp.float32)
    params = jax.jit(lambda x: hook.split(x))(bucket)
    for x, j, shape in zip(params, buf.layout.bucket_params[b], hook.shapes):
        ps, pe, _ = buf.layout.param_index_map[j]
        assert x.shape == shape
        np.testing.assert_array_equal(np.asarray(x).reshape(-1), np.arange(ps, pe) - start)
    local = bucket_hooks(fp, Mode.PARAMS, 0.5, jnp.float32, reduce=False)[fp.buckets.index((buf, b))]
    laid = local.reduce_grads(tuple(jnp.full(s, 3.0, jnp.bfloat16) for s in local.shapes), None)
    assert laid.dtype == jnp.bfloat16
    filled = np.zeros(end - start, bool)
    for j in buf.layout.bucket_params[b]:
        ps, pe, _ = buf.layout.param_index_map[j]
        filled[ps - start : pe - start] = True
    np.testing.assert_array_equal(np.asarray(laid, np.float32), np.where(filled, 3.0, 0.0))
    assert sink_axes(buf, reduce=False) == sink_axes(buf, reduce=True) == AXES  # a reduce-scatter's shard is per rank
    ddp = setup(flat_config("no_shard", (8, 1, 1), model=SCAN), with_data=False).zero.flat.buffers[0]
    assert set(sink_axes(ddp, reduce=True)) == set(AXES) - set(ddp.dp_axes)  # a psum's sum is the same on every rank


# ---------------------------------------------------------------- the compiled program

NO_BIAS = {"scan_layers": True, "bias": False, "n_layers": 3}  # every unit's bucket without padding


@functools.cache
def compiled(strategy, microbatches=1) -> tuple[dict, object]:
    """(`jzero hlo`'s document, the flat plan) of one flat per-unit strategy on 8 CPU devices, fp32."""
    c = compile_step(flat_config(strategy, (8, 1, 1), microbatches, model=NO_BIAS))
    return comms.analyze(c), c.run.zero.flat


def _loop_and_step(doc, kind) -> tuple[float, float]:
    """Per-step wire bytes of the DP collectives of `kind`: (in a loop body, in the step itself)."""
    sch, loop, step = doc["schedule"], 0.0, 0.0
    for r in sch["collectives"]:
        if r["kind"] == kind and r["axes"] == ["dp"]:
            if r["computation"] == sch["entry"]:
                step += r["wire_bytes"] * r["runs"]
            else:
                loop += r["wire_bytes"] * r["runs"]
    return loop, step


@pytest.mark.parametrize("strategy, microbatches", [("optim_grads_params", 1), ("optim", 2), ("no_shard", 1)])
@pytest.mark.matrix
def test_each_units_buckets_are_reduced_inside_the_layer_loop(strategy, microbatches):
    """8 CPU devices, a scanned stack of 3 blocks: every unit bucket's reduction (ZeRO-3's and ZeRO-1's
    reduce-scatter in the last micro-batch, DDP's all-reduce) runs in the layer loop, once per layer; the
    rest group's once in the step; ZeRO-3 gathers each unit's bucket twice in the loop. The DP bytes per
    step are the ring formulas over the padded buckets, which are the theory's but for the rest group's
    64 elements of padding."""
    doc, fp = compiled(strategy, microbatches)
    d, units = 8, [buf for buf in fp.buffers if buf.layers]
    unit_bytes = 4 * sum(buf.layers * buf.layout.numel for buf in units)
    rest_bytes = 4 * sum(buf.layout.numel for buf in fp.buffers if not buf.layers)
    assert unit_bytes == 4 * sum(t.numel for t in jax.tree.leaves(fp.plan.tensors) if t.unit_dims)  # no padding
    reduce = "all-reduce" if strategy == "no_shard" else "reduce-scatter"
    loop, step = _loop_and_step(doc, reduce)
    assert loop == pytest.approx(ring_wire_bytes(reduce, unit_bytes, d))
    assert step - ring_wire_bytes(reduce, rest_bytes, d) == pytest.approx(0, abs=64)  # loss and norm scalars
    gathers = {"optim_grads_params": 2, "optim": 1, "no_shard": 0}[strategy]
    loop, step = _loop_and_step(doc, "all-gather")
    assert loop == pytest.approx(gathers * ring_wire_bytes("all-gather", unit_bytes, d))
    assert step == pytest.approx(ring_wire_bytes("all-gather", rest_bytes, d) if gathers else 0)
    laid_out = sum(math.prod(buf.lead) * buf.layout.numel for buf in fp.buffers)
    padding = laid_out - sum(t.numel for t in jax.tree.leaves(fp.plan.tensors))
    assert 0 < padding <= 64
    assert 1 <= doc["ratio"] < 1 + 64 / (rest_bytes / 4)


