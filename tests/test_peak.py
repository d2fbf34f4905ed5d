"""What fills temp memory at the peak (jzero.inspect.peak), read from XLA's dump of one compile.

Every fixture is a real program compiled here: on the 8 simulated CPU devices, and, where the
CUDA plugin is installed, deviceless for 8 H100s (docs/xla.md, "Deviceless GPU compilation").
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import tiny_config
from jzero.inspect import peak
from jzero.inspect.compile import compile_step, compile_with_dump
from jzero.inspect.targets import cuda_plugin_available, gpu_mesh

D = 1024
needs_gpu_plugin = pytest.mark.skipif(
    not cuda_plugin_available(), reason="CUDA PJRT plugin not installed: pip install -e .[gpu-aot]"
)


def _cpu_mesh():
    return Mesh(np.asarray(jax.devices()[:8]), ("dp",))


def _h100_mesh():
    return gpu_mesh("h100", "1 x 1 x 8", (8,), ("dp",))


def _sds(shape, mesh, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def _grad_then_reduce(mesh, reduce: str):
    """One rank's grad of a [D, D] weight (its local grad), then psum (DDP) or psum_scatter (ZeRO)."""

    def body(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(jax.lax.pcast(w, "dp", to="varying"))
        if reduce == "psum":
            return w - 0.1 * jax.lax.psum(g, "dp")
        return 0.5 * jax.lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True)

    out = P() if reduce == "psum" else P("dp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=out))
    return f.lower(_sds((D, D), mesh, P()), _sds((64, D), mesh, P("dp")))


def _memory(compiled) -> tuple[int, ...]:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100", marks=needs_gpu_plugin)])
def test_compiling_with_the_dump_builds_the_same_program(target):
    lowered = _grad_then_reduce(_cpu_mesh() if target == "cpu" else _h100_mesh(), "psum_scatter")
    dumped, dump = compile_with_dump(lowered)
    plain = lowered.compile()
    assert dumped.as_text() == plain.as_text() and _memory(dumped) == _memory(plain)
    assert "ENTRY" in dump.hlo and "allocation 0:" in dump.buffer_assignment and "BufferLiveRange:" in dump.live_range


def _peak(lowered, **kw):
    compiled, dump = compile_with_dump(lowered)
    p = peak.peak(dump.buffer_assignment, dump.live_range, dump.hlo, **kw)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert p.allocation_bytes == temp and 0 < p.live_bytes <= temp
    assert sum(p.by_category().values()) == p.live_bytes
    return p


def test_peak_holds_the_local_grad_before_its_reduce_scatter():
    p = _peak(_grad_then_reduce(_cpu_mesh(), "psum_scatter"), param_shapes={(D, D)}, seq_len=0, attention_elements=1)
    assert p.by_category()["local_grads"] == D * D * 4


def test_peak_holds_the_all_reduced_grad():
    p = _peak(_grad_then_reduce(_cpu_mesh(), "psum"), param_shapes={(D, D)}, seq_len=0, attention_elements=1)
    assert p.by_category()["reduced_grads"] == D * D * 4


def test_peak_attention_scores_saved_for_backward():
    h, t, k, d = 8, 256, 32, 64

    def attention(q, k, v):  # [H, T, K]
        probs = jax.nn.softmax(jnp.einsum("htk,hsk->hts", q, k), axis=-1)
        return jnp.einsum("hts,hsk->htk", probs, v)

    def grads(w, x):  # w [3, D, H, K], x [T, D]
        def loss(w):
            return jnp.sum(attention(*(jnp.einsum("td,dhk->htk", x, w[i]) for i in range(3))) ** 2)

        return jax.grad(loss)(w)

    lowered = jax.jit(grads).lower(jnp.ones((3, d, h, k)), jnp.ones((t, d)))
    p = _peak(lowered, param_shapes={(3, h, k, d)}, seq_len=t, attention_elements=h * t * t)
    by = p.by_category()
    assert by["attention"] >= 2 * h * t * t * 4  # the scores' max and the probabilities
    assert by["attention"] == max(by.values()) and p.buffers[0].function.endswith(".attention")


def test_zero2_step_reports_peak_on_cpu():
    c = compile_step(tiny_config("optim_grads", microbatches=2))
    pk = peak.peak_report(c)
    assert pk["allocation_bytes"] == pk["temp_bytes"] == c.compiled.memory_analysis().temp_size_in_bytes
    assert math.isclose(sum(pk["by_category"].values()), pk["live_bytes"]) and pk["live_bytes"] <= pk["temp_bytes"]
    assert peak.format_lines({"peak": pk})[0].startswith("  temp at its peak")
