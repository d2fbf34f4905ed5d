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
