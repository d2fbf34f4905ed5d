"""What fills temp memory at the peak (jzero.inspect.peak), read from XLA's dump of one compile.

Every fixture is a real program compiled here: on the 8 simulated CPU devices, and, where the
CUDA plugin is installed, deviceless for 8 H100s (docs/xla.md, "Deviceless GPU compilation").
"""

import math

import jax
import jax.numpy as jnp
import pytest

from helpers import tiny_config
from helpers.programs import D, cpu_mesh, grad_then_reduce, h100_mesh, needs_gpu_plugin
from jzero.inspect import peak
from jzero.inspect.compile import compile_step, compile_with_dump


def _memory(compiled) -> tuple[int, ...]:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100", marks=needs_gpu_plugin)])
def test_compiling_with_the_dump_builds_the_same_program(target):
    lowered = grad_then_reduce(cpu_mesh() if target == "cpu" else h100_mesh(), "psum_scatter")
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
    p = _peak(grad_then_reduce(cpu_mesh(), "psum_scatter"), param_shapes={(D, D)}, seq_len=0, attention_elements=1)
    assert p.by_category()["local_grads"] == D * D * 4


def test_peak_holds_the_all_reduced_grad():
    p = _peak(grad_then_reduce(cpu_mesh(), "psum"), param_shapes={(D, D)}, seq_len=0, attention_elements=1)
    assert p.by_category()["reduced_grads"] == D * D * 4


@needs_gpu_plugin
def test_peak_reads_a_combined_all_reduce_s_slices_as_reduced_grads():
    """XLA:GPU all-reduces a layer's grads in one combined collective (the spec path's DDP,
    `compiler.COMBINE["all_reduces"]`) and cuts its flat result into the grads with slices: the stacked
    grads a layer loop writes them into are reduced grads."""
    from jax.sharding import PartitionSpec as P

    from helpers.programs import sds
    from jzero.zero.common.compiler import COMBINE

    mesh, layers = h100_mesh(), 3

    def body(w1s, w2s, x):
        def layer(h, ws):
            def loss(w1, w2):
                return jnp.sum(jnp.tanh(jnp.tanh(h @ w1) @ w2) ** 2)

            g = jax.grad(loss, argnums=(0, 1))(*(jax.lax.pcast(w, "dp", to="varying") for w in ws))
            return jnp.tanh(h @ ws[0]), jax.lax.psum(g, "dp")

        _, (g1s, g2s) = jax.lax.scan(layer, x, (w1s, w2s))
        return jnp.sum(g1s * g2s)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=P("dp")),
                compiler_options=COMBINE["all_reduces"])  # fmt: skip
    stacked = sds((layers, D, D), mesh, P())
    p = _peak(f.lower(stacked, stacked, sds((64, D), mesh, P("dp"))), param_shapes={(D, D)}, seq_len=0,
              attention_elements=1)  # fmt: skip
    assert p.by_category()["reduced_grads"] == 2 * layers * D * D * 4


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


@pytest.mark.slow
def test_zero2_step_reports_peak_on_cpu():
    c = compile_step(tiny_config("optim_grads", microbatches=2))
    pk = peak.peak_report(c)
    assert pk["allocation_bytes"] == pk["temp_bytes"] == c.compiled.memory_analysis().temp_size_in_bytes
    assert math.isclose(sum(pk["by_category"].values()), pk["live_bytes"]) and pk["live_bytes"] <= pk["temp_bytes"]
    assert peak.format_lines({"peak": pk})[0].startswith("  temp at its peak")
