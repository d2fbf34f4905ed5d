"""A step at the card's roofline (jzero.inspect.roofline): each kernel of the compiled XLA:GPU program at the
larger of its matmuls at peak and its HBM bytes at the card's bandwidth. Programs compiled deviceless for one
H100."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers.programs import D, needs_gpu_plugin
from jzero.inspect.roofline import roofline, roofline_report
from jzero.inspect.targets import TARGETS, gpu_mesh

PEAK, BANDWIDTH = 1e15, 1e13


def _compiled(f, *shapes_dtypes):
    mesh = gpu_mesh("h100", "1 x 1 x 1", (1,), ("dp",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes_dtypes]
    return jax.jit(f).lower(*args).compile().as_text()


@needs_gpu_plugin
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_matmul_on_fp32_operands_takes_twice_the_time(dtype):
    """x @ w, [4D, D] x [D, D]: compute-bound at these rates; an fp32 one runs at half the peak (TF32)."""
    text = _compiled(lambda x, w: x @ w, ((4 * D, D), dtype), ((D, D), dtype))
    r = roofline(text, PEAK, BANDWIDTH)
    flops = 2 * 4 * D * D * D
    assert r.dot_flops == flops
    assert r.fp32_dot_flops == (flops if dtype == jnp.float32 else 0)
    size = jnp.dtype(dtype).itemsize
    assert r.hbm_bytes == (4 * D * D + D * D + 4 * D * D) * size  # x and w read, the product written
    assert r.seconds == pytest.approx(flops / PEAK * (2 if dtype == jnp.float32 else 1))


@needs_gpu_plugin
def test_a_loop_counts_each_trip_and_reads_one_slice_of_a_stack():
    """A scan over L stacked [D, D] weights, x [8, D] @ w[i] each trip: L x one matmul's flops, and bytes linear
    in L (each trip reads its slice of the stack, not the stack: that would be quadratic); memory-bound here."""

    def f(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    r = {n: roofline(_compiled(f, ((8, D), jnp.float32), ((n, D, D), jnp.float32)), PEAK, BANDWIDTH) for n in (4, 8)}
    assert r[8].dot_flops == 2 * r[4].dot_flops == 8 * 2 * 8 * D * D
    assert r[8].hbm_bytes >= 8 * D * D * 4  # the stack, read once
    assert r[8].hbm_bytes == pytest.approx(2 * r[4].hbm_bytes, rel=0.01)
    assert r[8].seconds == pytest.approx(r[8].hbm_bytes / BANDWIDTH, rel=0.05)


@needs_gpu_plugin
def test_report_takes_the_targets_figures_and_the_peak_override():
    text = _compiled(lambda x: jnp.sin(x) * 2, ((D, D), jnp.float32))
    rep = roofline_report("h100", text)
    assert rep["hbm_bandwidth"] == TARGETS["h100"].hbm_bandwidth == 3.35232e12  # the target file's
    assert rep["hbm_bytes"] == 2 * D * D * 4 and rep["dot_flops"] == 0
    assert rep["seconds"] == pytest.approx(rep["hbm_bytes"] / rep["hbm_bandwidth"])
    assert rep["line"].startswith("roofline ~ ") and "fp32" not in rep["line"]
    assert roofline_report("h100", text, peak_tflops=10.0)["peak_flops"] == 10e12
    assert roofline_report("cpu", text) is None


# A fusion that writes one [D, D] update into an [8, D, D] stack it sees through a bitcast (XLA:GPU's form when
# the stack's layout puts the scanned dim inside: LLaMA-2-7B's gathered-weight stacks).
_IN_PLACE = """HloModule m, is_scheduled=true

%fused (p0: f32[8,1024,1024], p1: f32[1024,1024], p2: s32[]) -> f32[1024,8,1024] {
  %p0 = f32[8,1024,1024]{1,0,2} parameter(0)
  %b0 = f32[1024,8,1024]{2,1,0} bitcast(%p0)
  %p1 = f32[1024,1024]{0,1} parameter(1)
  %b1 = f32[1024,1,1024]{2,1,0} bitcast(%p1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dus = f32[1024,8,1024]{2,1,0} dynamic-update-slice(%b0, %b1, %c, %p2, %c)
}

ENTRY %main (a: f32[8,1024,1024], w: f32[1024,1024], i: s32[]) -> f32[1024,8,1024] {
  %a = f32[8,1024,1024]{1,0,2} parameter(0)
  %w = f32[1024,1024]{0,1} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[1024,8,1024]{2,1,0} fusion(%a, %w, %i), kind=kLoop, calls=%fused
}
"""


def test_an_update_in_place_through_a_bitcast_moves_only_the_update():
    r = roofline(_IN_PLACE, PEAK, BANDWIDTH)
    assert r.hbm_bytes == 2 * D * D * 4 + 4  # the update read and written, and the index; not the stack


# A conditional whose branches cost 8 KiB (negate a [D] vector) and 4 MiB (reduce a [D, D] matrix): the owned
# path's update is one (`lax.switch` over the ranks).
_BRANCHES = """HloModule c, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%small (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %n = f32[1024]{0} negate(%p)
}

%big (q: f32[1024,1024]) -> f32[1024] {
  %q = f32[1024,1024]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[1024]{0} reduce(%q, %z), dimensions={1}, to_apply=%add
}

ENTRY %main (k: pred[], x: f32[1024], y: f32[1024,1024]) -> f32[1024] {
  %k = pred[] parameter(0)
  %x = f32[1024]{0} parameter(1)
  %y = f32[1024,1024]{1,0} parameter(2)
  ROOT %c = f32[1024]{0} conditional(%k, %x, %y), true_computation=%small, false_computation=%big
}
"""


def test_a_conditional_counts_its_costliest_branch_alone():
    r = roofline(_BRANCHES, PEAK, BANDWIDTH)
    assert r.hbm_bytes == D * D * 4 + 4 + D * 4  # the reduce's matrix and init read, its vector written
    assert r.seconds == pytest.approx(r.hbm_bytes / BANDWIDTH)


@needs_gpu_plugin
def test_a_lookup_reads_the_rows_it_picks_and_its_grad_scatters_them_in_place():
    """An embedding lookup's gather reads the rows it picks, not the table, and its grad's scatter-add reads and
    writes those rows of the zeroed grad in place: the table's bytes move once, for the zeroing."""
    rows, picked = 64 * D, 64  # a 256 MiB fp32 table

    def grad(table, ids):
        return jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) ** 2))(table)

    r = roofline(_compiled(grad, ((rows, D), jnp.float32), ((picked,), jnp.int32)), PEAK, BANDWIDTH)
    table = rows * D * 4
    assert table <= r.hbm_bytes < table + 16 * picked * D * 4  # counted as whole-table passes: 3-4 x the table
